"""Which model drafts, chosen from measured costs: `--draft auto`, and a user's own `--draft D`.

A pair loaded with `--draft auto` brings the target's own int4 copy as a candidate
(`ModelPair.draft_candidate`); one loaded with `--target T --draft D` (no --draft-quant) brings their
draft D, and beside it, where memory allows, the target's int4 copy (`ModelPair.copy`) and D's own
(`ModelPair.draft_int4`). Unless `--proposer` names one, the decoder and the server ask `choose`
which to run: lookup alone, or the model with the best expected rate. The costs are those `-k
auto` probes anyway (costmodel.probe, kept in the tuning cache; with a fixed k they are probed for
the choice alone): the target's forward of q tokens a row, t_q, and the model's one-token
forward, c, at the batch's rows. Each candidate's expected rate, as a multiple of plain decoding's:

    model:  max over q = 2 .. k_max + 1 of  E(q) t_1 / (t_q + (q - 1) c),   E(q) = 1 + a + ... + a^(q-1)
            (a fixed k: at q = k + 1 alone, the width every step verifies)
    lookup: LOOKUP_GAIN

with a = COPY_ACCEPT for the copy, and for D (and D in int4) its greedy agreement with the target,
teacher-forced on a built-in text, scaled as the copy's was (`estimated_accept`). These are
acceptances measured before or on other text, not on the user's prompts: what this step measures is the costs, which
decide the choice on a CPU (an int4 product is fast with bfloat16 units and slow without; a copy
of a small target, or a sibling a third its size, costs most of a target step). The best runs;
`-k auto` then decides every step whether to draft at all, so a wrong guess costs at most the k = 0
floor's exploring steps. After a run with a model, the acceptance its drafts met on the user's
prompts replaces the guess (`revise`): where its estimate then falls to the next best's (the next
best model beside a user's draft, where that one beats lookup; else lookup's), the decoder's next run
uses that. A run in which `-k auto` drafted with it in at most IDLE_SHARE of its row-steps (`idle`)
switches to lookup: the policy found it not worth drafting with, so no acceptance is learned, and
lookup costs nothing to keep. (A server keeps its first choice.)
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from ..core import tree
from ..core.config import EngineConfig
from .costmodel import StepCost, now, prepare_linears, probe

#: Conditional acceptance of the target's own int4 copy's drafts (in groups of 32 it keeps the int8
#: copy's 95.8% agreement, teacher-forced on Spec-Bench; about 5 tokens a step at one row), taken
#: lower for harder text.
COPY_ACCEPT = 0.9
#: Prompt lookup's rate over plain decoding under -k auto on Spec-Bench, paired benches of the
#: built-in target as a user's GGUF (1.07-1.44x at one row, 0.98-1.15x at four, on two CPUs): the
#: bar the copy's estimate must clear. A copy estimated near it drafted little at four rows (1.05
#: tokens a step): 1.07x `ar` against lookup's 1.15x (docs/benchmarks.md).
LOOKUP_GAIN = 1.15
#: The attended span the costs are read at: a chat prompt and its answer.
SPAN = 256
#: Drafts the copy must have had tested (the policy's decayed count) before the acceptance measured
#: on the user's prompts replaces COPY_ACCEPT in the choice (`revise`); and row-steps a run must
#: have taken before its share drafting with the copy says it is idle (`idle`).
REVISE_AFTER = 64
#: The most row-steps of a run (a share) `-k auto` may have drafted with the copy in for it to count
#: as idle: the policy's exploring steps draft in about one step in 32.
IDLE_SHARE = 0.1


@dataclass(frozen=True)
class Costs:
    """Seconds of the target's forward of q tokens a row, `verify[q - 1]` (q = 1 .. k_max + 1), and
    of the copy's one-token forward `draft`, at the same rows and span. `fixed`: a fixed k's width
    (k + 1), the only one its steps verify; None under `-k auto`, which chooses among all."""

    verify: tuple[float, ...]
    draft: float
    fixed: int | None = None


def _rate(costs: Costs, q: int, accept: float) -> float:
    """The copy's expected rate over plain decoding verifying q tokens a row: E(q) t_1 / (t_q + (q - 1) c)."""
    tokens = sum(accept**j for j in range(q))
    return tokens * costs.verify[0] / (costs.verify[q - 1] + (q - 1) * costs.draft)


def copy_gain(costs: Costs, accept: float = COPY_ACCEPT) -> tuple[float, int]:
    """(the copy's best expected rate over plain decoding, the width q that gives it); (1.0, 1)
    where no width beats a plain step (under a fixed k: the rate at its width, whatever it is)."""
    if costs.fixed is not None:
        return _rate(costs, costs.fixed, accept), costs.fixed
    return max([(1.0, 1)] + [(_rate(costs, q, accept), q) for q in range(2, len(costs.verify) + 1)])


@dataclass(frozen=True)
class Candidate:
    """A model that may draft: `label` names it in reports, `costs` are its own (the target's
    verifies, its one-token forward), `accept` the conditional acceptance its estimate assumes."""

    label: str
    costs: Costs
    accept: float = COPY_ACCEPT

    def gain(self) -> tuple[float, int]:
        return copy_gain(self.costs, self.accept)


COPY = "the target's own copy"
YOURS = "your draft model"
YOURS_INT4 = "your draft model in int4"


@dataclass(frozen=True)
class Choice:
    """What `choose` chose: the proposer to run (None: the one the config names), why, the costs it
    was chosen from (None where nothing was measured), `label` the model that drafts, and `pair`
    the pair to build the proposer from where it is not the one given (its copy as the draft).
    `rival`: what `revise` switches to, where it is not lookup alone."""

    proposer: str | None
    why: str
    costs: Costs | None = None
    label: str = COPY
    pair: object | None = None
    gain: float = 1.0  # the expected rate it was chosen at
    rival: Choice | None = None  # the next best model, where it would beat lookup, beside a user's draft chosen


def pick(candidates: list[Candidate]) -> tuple[Candidate | None, str]:
    """(the candidate with the best expected rate, or None: lookup alone; why, for the start-up
    report). A model runs only where its rate beats LOOKUP_GAIN."""
    rated = [(c.gain(), c) for c in candidates]
    (gain, q), best = max(rated, key=lambda r: r[0][0])
    parts = []
    for (g, _), c in rated:
        accept = "" if c.label == COPY else f" accepting {c.accept:.2f}"
        parts.append(f"a forward of {_short(c.label)} {1e3 * c.costs.draft:.1f} ms{accept}")
        if len(rated) > 1:
            parts.append(f"{_short(c.label)} {g:.2f}x")
    parts.append(f"a plain step {1e3 * best.costs.verify[0]:.1f} ms")
    measured = f"measured: {', '.join(parts)}"
    if gain > LOOKUP_GAIN:
        return best, f"auto: {best.label} ({measured}; {gain:.2f}x expected at width {q})"
    return None, f"auto: lookup alone ({measured}; {best.label} at best {gain:.2f}x, lookup {LOOKUP_GAIN}x)"


def decide(costs: Costs) -> tuple[str, str]:
    """(the proposer to run, "draft" or "ngram"; why, for the start-up report) for the target's own
    copy at `costs` against lookup alone."""
    best, why = pick([Candidate(COPY, costs)])
    return ("draft" if best else "ngram"), why


def measure(config: EngineConfig, target, draft) -> Costs:
    """The costs at `config`'s rows, from the probes `-k auto` takes (or the tuning cache), each
    model's at this machine's speed now (`now`)."""
    rows = config.batch_size
    columns = 1 + tree.columns(config.branches, config.k_max)
    prepare_linears(config, target, draft)
    verify, drafting = StepCost(probe(target, rows, columns)), StepCost(probe(draft, rows, 1))
    verify_now, draft_now = now(target, rows, columns, verify, SPAN), now(draft, rows, 1, drafting, SPAN)
    return Costs(
        tuple(verify(rows, q, SPAN) * verify_now for q in range(1, columns + 1)),
        drafting(rows, 1, SPAN) * draft_now,
        None if config.k == "auto" else config.k + 1,
    )


def choose(pair, config: EngineConfig) -> Choice | None:
    """The proposer to run for a pair whose draft is a candidate, measured, where the config names
    none (a Choice of None where it does: it runs, as asked); None for any other pair. With `--draft
    auto` the candidates are the copy (the pair's draft) and lookup; with a user's draft model,
    theirs, lookup, and the copies the pair holds (`pair.copy`, the target's; `pair.draft_int4`,
    theirs)."""
    if not pair.draft_candidate or not config.speculative:
        return None
    beside = COPY if pair.draft_copies_target else YOURS
    if config.proposer is not None:
        return Choice(None, f"auto: --proposer {config.proposer} as asked (beside {beside})")
    if pair.draft_copies_target:
        costs = measure(config, pair.target, pair.draft)
        return Choice(*decide(costs), costs)
    candidates = [Candidate(YOURS, measure(config, pair.target, pair.draft), estimated_accept(pair))]
    if pair.copy is not None:
        candidates.append(Candidate(COPY, measure(config, pair.target, pair.copy[0])))
    if pair.draft_int4 is not None:
        view = pair.with_draft_int4()
        candidates.append(Candidate(YOURS_INT4, measure(config, pair.target, view.draft), estimated_accept(view, pair)))
    best, why = pick(candidates)
    if best is None:
        return Choice("ngram", why, candidates[0].costs, YOURS)
    paying = (c for c in candidates if c is not best and c.gain()[0] > LOOKUP_GAIN)
    rival = max(paying, key=lambda c: c.gain()[0], default=None)
    return replace(_choice(pair, best, why), rival=rival and _choice(pair, rival, why))


def pair_to_run(choice: Choice | None, pair):
    """The pair to build `choice`'s proposer from: its view with the copy as the draft, else `pair`."""
    return choice.pair if choice is not None and choice.pair is not None else pair


def _choice(pair, candidate: Candidate, why: str) -> Choice:
    """The Choice that runs `candidate` of `pair`'s (a copy: through the pair's view with it)."""
    view = {COPY: pair.with_copy, YOURS_INT4: pair.with_draft_int4}.get(candidate.label, lambda: None)()
    return Choice("draft", why, candidate.costs, candidate.label, view, candidate.gain()[0])


#: Plain prose the agreement of a user's draft model with the target is measured on, teacher-forced
#: (`agreement`): expository text of the kind chat answers are made of, no domain's jargon.
TEXT = (
    "The water cycle describes how water moves between the oceans, the air and the land. Heat from the "
    "sun warms the surface of the sea, and some of the water evaporates into the air as vapour. As the "
    "warm, moist air rises, it cools, and the vapour condenses into tiny droplets that form clouds. When "
    "the droplets grow heavy enough, they fall back to the ground as rain or snow. Some of that water "
    "flows into rivers and lakes, some soaks into the soil and feeds plants, and some returns to the sea, "
    "where the cycle begins again. Without this cycle, fresh water would not reach most of the places "
    "where people, animals and plants live."
)
#: The copy's teacher-forced agreement that COPY_ACCEPT was taken from ("A self-draft in int4",
#: docs/benchmarks.md): a draft's agreement on TEXT is scaled by COPY_ACCEPT / COPY_AGREEMENT, as
#: the copy's was, into the acceptance its estimate assumes.
COPY_AGREEMENT = 0.958
#: The acceptance assumed for a user's draft whose agreement cannot be measured (no tokenizer, or a
#: reduced head, --draft-vocab, whose scores are not the target's tokens'): a draft model a few
#: times smaller than its target; `-k auto` and `revise` correct it as it runs.
DRAFT_ACCEPT = 0.7
_agreements: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft model -> its estimate


def estimated_accept(pair, full=None) -> float:
    """The acceptance a user's draft model is estimated at (`agreement`, scaled), measured once per
    draft model. Where it cannot be measured: for an int4 copy of theirs (`full`: the pair with
    their draft as loaded) their draft's estimate x COPY_AGREEMENT (what int4 kept of the target's
    agreement), else DRAFT_ACCEPT."""
    if pair.draft not in _agreements:
        agreed = agreement(pair)
        if agreed is not None:
            _agreements[pair.draft] = min(1.0, agreed * COPY_ACCEPT / COPY_AGREEMENT)
        else:
            _agreements[pair.draft] = DRAFT_ACCEPT if full is None else estimated_accept(full) * COPY_AGREEMENT
    return _agreements[pair.draft]


@torch.inference_mode()
def agreement(pair) -> float | None:
    """The share of TEXT's next tokens whose greedy choice the pair's draft model shares with the
    target's, teacher-forced (one forward of each over TEXT); None where the draft's scores are not
    over the target's tokens (a reduced head) or there is no tokenizer."""
    if pair.tokenizer is None or pair.draft_vocab_ids is not None:
        return None
    ids = torch.tensor([pair.tokenizer(TEXT)["input_ids"]], device=pair.device)
    want = pair.target(input_ids=ids).logits.argmax(-1)
    got = pair.draft(input_ids=ids).logits.argmax(-1)
    return float((got == want).float().mean())


def revise(costs: Costs, tested: float, accepted: float, label: str = COPY, rival: Choice | None = None) -> str | None:
    """After a run with a model (`label`): why to switch, where its drafts `tested` (at least
    REVISE_AFTER) were accepted at a rate `accepted` that leaves its estimate at or under the next
    best's: `rival` (the next best model beside a user's draft, at its own estimate) or else lookup alone;
    None: keep it. One way: the runs after the switch measure nothing of the model left."""
    if tested < REVISE_AFTER:
        return None
    gain, _ = copy_gain(costs, accepted)
    bar, to = (rival.gain, rival.label) if rival is not None else (LOOKUP_GAIN, "lookup alone")
    if gain > bar:
        return None
    return (
        f"auto: {to}, switched from {_short(label)} after {tested:.0f} drafts accepted at {accepted:.2f} "
        f"({_short(label)} then {gain:.2f}x, {_short(to)} {bar:.2f}x)"
    )


def idle(chosen_k: dict[int, int], label: str = COPY) -> str | None:
    """After a run with a model (`label`): why to switch to lookup alone, where the run took at
    least REVISE_AFTER row-steps and drafted with it in at most IDLE_SHARE of them (`chosen_k`:
    row-steps by the drafts they verified, Stats.chosen_k); else None."""
    steps = sum(chosen_k.values())
    drafting = sum(n for k, n in chosen_k.items() if k > 0)
    if steps < REVISE_AFTER or drafting > IDLE_SHARE * steps:
        return None
    return (
        f"auto: lookup alone, switched from {_short(label)} after -k auto drafted with it in {drafting} of "
        f"{steps} row-steps (it did not pay here; lookup costs nothing to keep)"
    )


def _short(label: str) -> str:
    return {COPY: "the copy", YOURS: "your draft", YOURS_INT4: "your draft in int4", "lookup alone": "lookup"}[label]
