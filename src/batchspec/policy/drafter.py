"""`--draft auto`: lookup alone or the target's own quantized copy, chosen from measured costs.

A pair loaded with `--draft auto` brings the copy as a candidate (`ModelPair.draft_candidate`);
unless `--proposer` names one, the decoder and the server ask `choose` which proposer to run. The
costs are those `-k auto` probes anyway (costmodel.probe, kept in the tuning cache; with a fixed k
they are probed for the choice alone): the target's forward of q tokens a row, t_q, and the copy's
one-token forward, c, at the batch's rows. Each candidate's expected rate, as a multiple of plain
decoding's:

    copy:   max over q = 2 .. k_max + 1 of  E(q) t_1 / (t_q + (q - 1) c),   E(q) = 1 + a + ... + a^(q-1)
            (a fixed k: at q = k + 1 alone, the width every step verifies)
    lookup: LOOKUP_GAIN

with a = COPY_ACCEPT. Both are acceptances measured before (docs/benchmarks.md, "The drafter a
user's model gets"), not on the user's text: what this step measures is the costs, which decide
the choice on a CPU (an int4 product is fast with bfloat16 units and slow without; a copy of a
small target costs most of a target step). The larger runs; `-k auto` then decides every step
whether to draft at all, so a wrong guess costs at most the k = 0 floor's exploring steps. After a
run with the copy, the acceptance its drafts met on the user's prompts replaces the guess
(`revise`): where the copy's estimate then falls to lookup's, the decoder's next run uses lookup.
So does a run in which `-k auto` drafted with the copy in at most IDLE_SHARE of its row-steps
(`idle`): the policy found it not worth drafting with, so no acceptance is learned, and lookup costs
nothing to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core import tree
from ..core.config import EngineConfig
from .costmodel import StepCost, prepare_linears, probe

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
class Choice:
    """What `choose` chose: the proposer to run (None: the one the config names), why, and the
    costs it was chosen from (None where nothing was measured)."""

    proposer: str | None
    why: str
    costs: Costs | None = None


def decide(costs: Costs) -> tuple[str, str]:
    """(the proposer to run, "draft" or "ngram"; why, for the start-up report) from `costs`."""
    gain, q = copy_gain(costs)
    ms = f"a forward of the copy {1e3 * costs.draft:.1f} ms, a plain step {1e3 * costs.verify[0]:.1f} ms"
    if gain > LOOKUP_GAIN:
        return "draft", f"auto: the target's own copy (measured: {ms}; {gain:.2f}x expected at width {q})"
    return "ngram", f"auto: lookup alone (measured: {ms}; the copy at best {gain:.2f}x, lookup {LOOKUP_GAIN}x)"


def measure(config: EngineConfig, target, draft) -> Costs:
    """The costs at `config`'s rows, from the probes `-k auto` takes (or the tuning cache)."""
    rows = config.batch_size
    columns = 1 + tree.columns(config.branches, config.k_max)
    prepare_linears(config, target, draft)
    verify = StepCost(probe(target, rows, columns))
    return Costs(
        tuple(verify(rows, q, SPAN) for q in range(1, columns + 1)),
        StepCost(probe(draft, rows, 1))(rows, 1, SPAN),
        None if config.k == "auto" else config.k + 1,
    )


def choose(pair, config: EngineConfig) -> Choice | None:
    """The proposer to run for a pair whose draft is a candidate, measured, where the config names
    none (a Choice of None where it does: it runs, as asked); None for any other pair."""
    if not pair.draft_candidate or not config.speculative:
        return None
    if config.proposer is not None:
        return Choice(None, f"auto: --proposer {config.proposer} as asked (beside the target's own int4 copy)")
    costs = measure(config, pair.target, pair.draft)
    return Choice(*decide(costs), costs)


def revise(costs: Costs, tested: float, accepted: float) -> str | None:
    """After a run with the copy: why to switch to lookup alone, where the copy's drafts `tested`
    (at least REVISE_AFTER) were accepted at a rate `accepted` that leaves its estimate at or under
    lookup's; else None (keep it). One way: lookup's runs measure nothing of the copy."""
    if tested < REVISE_AFTER:
        return None
    gain, _ = copy_gain(costs, accepted)
    if gain > LOOKUP_GAIN:
        return None
    return (
        f"auto: lookup alone, switched from the copy after {tested:.0f} drafts accepted at {accepted:.2f} "
        f"(the copy then {gain:.2f}x, lookup {LOOKUP_GAIN}x)"
    )


def idle(chosen_k: dict[int, int]) -> str | None:
    """After a run with the copy: why to switch to lookup alone, where the run took at least
    REVISE_AFTER row-steps and drafted with the copy in at most IDLE_SHARE of them (`chosen_k`:
    row-steps by the drafts they verified, Stats.chosen_k); else None."""
    steps = sum(chosen_k.values())
    drafting = sum(n for k, n in chosen_k.items() if k > 0)
    if steps < REVISE_AFTER or drafting > IDLE_SHARE * steps:
        return None
    return (
        f"auto: lookup alone, switched from the copy after -k auto drafted with it in {drafting} of "
        f"{steps} row-steps (it did not pay here; lookup costs nothing to keep)"
    )
