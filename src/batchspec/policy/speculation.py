"""How many drafts each row verifies each step: a fixed k, or `auto`, chosen from measured costs.

`Fixed(k)` asks the proposer for k drafts per row every step.

`Adaptive(k_max)` (`-k auto`) maximises the expected tokens per second of each whole step,

    rate(q) = E(q) / (T_prop + T_step(B, q, S)),   q = 1 .. k_max + 1 (q - 1 drafts per row),

where T_step is the target's step of B rows, q tokens each, over span S, and T_prop the
proposer's time (costmodel.py: each width modelled apart, probed at start, refined from every step
timed), and E(q) = sum over rows of 1 + sum_{j <= k_b} prod_{l <= j} a_b(l), with
k_b = min(q - 1, drafts row b got) and a_b(l) the
estimated probability that draft l is accepted once drafts 1 .. l-1 were:

    a_b(l) = table[bin of draft l, l] x r_b

`table` is acceptance by the proposer's confidence bin (the n-gram match length; the draft model's
probability of its token, in tenths) and position, learned online (exponential moving averages);
`r_b` is row b's recent accepted / expected ratio (its text is more or less predictable than
average), relaxing towards 1 while the row does not speculate. All expected accepted drafts are
scaled by the realised / predicted ratio of the recent verify steps (the choice favours steps
whose estimates happen to be high, so uncorrected estimates run optimistic).

Estimates only change where steps test them, so after EXPLORE_EVERY steps without a verified draft
the next step that can propose verifies at least one (at most one 2-token verify per 32 steps),
and after EXPLORE_EVERY steps that all verified, the next is plain (a plain step's cost, which the
choice weighs every step, is then measured at the batch's shape now, not only probed at start).
Costs probed on another day (the tuning cache) start at today's speed: the load factor begins at
a forward timed at start over its fit (costmodel.now). And the clock has the last word: per bucket
of rows, the steps that proposed and the plain ones are each averaged by what they realised over
the rate of a plain step of their shape by the probes (`Realised`); where proposing realised less,
the steps there are plain (a draft still explored every EXPLORE_EVERY steps, which keeps that
average current; plain steps are explored every REALISED_EXPLORE steps until a bucket has a few),
and where it realised more, they propose and verify the width the model rates best.

The k = 0 arm has no tax: before proposing, if no width q > 1 can beat a plain step (for a cheap
proposer even if every row's drafts were of its best bin; for a draft model at the acceptance seen
so far, one forward per draft a width verifies), the step is plain decoding (no proposer call, no
extra tensors). A draft model whose forward costs so much that no width could pay even if every
draft were accepted is never asked, not even to explore. Nor does a draft model's prefill tax it:
the ragged layout does not feed a sequence's prompt to the draft at admission (`lazy`) but when a
step first drafts for it (`RaggedBatch.warm`). A draft model stops drafting as soon as one more
draft is expected to lower the rate. Every row is verified over the same width q (the layouts'
forwards are rectangular); row b verifies k_b = min(q - 1, its drafts) of them.

Output never depends on these choices (acceptance.py, sampling.py); only speed does.
"""

from __future__ import annotations

import sys
import time
import weakref
from typing import Protocol, runtime_checkable

import torch

from ..core import diskcache, tree
from ..core.config import AUTO_K_MAX, EngineConfig
from ..distributed import tp
from .costmodel import StepCost, from_disk, now, prepare_linears, probe, sync
from .drafter import COPY_ACCEPT, SPAN

#: Forgetting of the acceptance counts per observation of a cell (memory of about 1 / TABLE_RATE).
TABLE_RATE = 0.03
#: Forgetting per verify step of the predicted / realised acceptance sums (all estimates are
#: scaled by realised / predicted: the choices select steps whose estimates happen to be high).
CALIBRATION_DECAY = 0.98
#: Pseudo observations that shrink a cell towards the one before it (or the prior).
PSEUDO = 2.0
#: Weight of one step's observation in a row's accepted / expected ratio.
ROW_RATE = 0.3
#: After this many steps in a row without a verified draft, the next step that can propose
#: verifies at least one: estimates that turned pessimistic (acceptance, a width's cost) are only
#: corrected by steps that test them. Costs at most one 2-token verify per this many steps. After
#: as many steps that all verified, the next is plain, for the same reason.
EXPLORE_EVERY = 32
#: The measured-rate check (`Realised`): weight of one step in its arm's average, and the plain
#: steps and the steps that proposed an arm must have timed in a bucket of rows before drafting
#: there can be found to lose.
REALISED_RATE, REALISED_MIN = 0.1, (3, 8)
#: Until a bucket of rows has REALISED_MIN plain steps timed, a plain step is explored there after
#: this many steps that all verified (else EXPLORE_EVERY): a server's steps spread over every row
#: count, and one plain step in 32 left buckets of a hundred steps with one plain step timed.
REALISED_EXPLORE = 8
#: A row's remaining tokens that feeding the draft its prompt (a warm) may be paid back over, at
#: most (rows often stop at EOS well before their budget).
WARM_HORIZON = 128
#: A draft model whose forward costs at least this share of a plain target step weighs the feed of
#: the rows it lacks before drafting (`_warm_pays`): a self-draft, a sibling a third of the target's
#: size. A lighter one (the shipped 2-layer draft, a draft head: 5-10%) feeds them as it drafts; its
#: feed costs little beside the target's own prefill, and the estimate (which does not count what
#: lookup first adds) kept the built-in pair from speculating at all at B = 4.
HEAVY_DRAFT = 0.25
#: A cost fit read from the disk cache whose load factor (timed / fitted) is outside 1 / DRIFT ..
#: DRIFT (looked at every DRIFT_STEPS timed steps) was measured on another machine state (a
#: quieter or busier day): it is probed again, once per policy, and the cache updated.
DRIFT, DRIFT_STEPS = 2.5, 64


@runtime_checkable
class Speculation(Protocol):
    """What the step asks of a speculation policy (`step.decode_step`)."""

    k_max: int  # the most drafts a row verifies in one step (KV slots are reserved for it)
    lazy: bool  # may plan plain steps for long: a layout that can warms the proposer's cache on demand
    defer: bool  # keep slow upkeep (probing costs again) for `idle` instead of doing it mid-step

    def idle(self, stop=None) -> None:
        """Upkeep for a moment when no row runs (a server in a lull); `stop()` turning True (a
        request arrived) abandons it, to be done at a later lull."""
        ...

    def plan(self, batch) -> int:
        """Drafts to ask the proposer for this step (0: a plain step, no proposer call)."""
        ...

    def stop_rule(self, batch, started: float):
        """A proposer.StopRule for drafting step by step, or None."""
        ...

    def choose(self, batch, proposal, started: float) -> int:
        """How many of the proposal's drafts to verify (the width less one)."""
        ...

    def observe(self, seqs, proposal, width, num_accepted, prop_s, step_s, span, carried=False) -> None:
        """The step's outcome: accepted drafts per row [B], seconds spent proposing and stepping
        (`step_s` None: not timed, its forward carried a prompt's chunk of no estimated share;
        `carried`: it carried one, whose estimated share `step_s` is less)."""
        ...

    def describe(self) -> dict | None:
        """What the policy measured and learned, for the run's stats (None: nothing to say)."""
        ...

    def acceptance(self) -> tuple[float, float]:
        """(drafts tested, the share of them accepted), as the policy has learned them (0, 0: it
        learns none)."""
        return 0.0, 0.0

    def warmed(self, tokens: int, seconds: float) -> None:
        """The layout fed the proposer `tokens` tokens of rows it lacked (`Layout.warm`) in `seconds`."""
        return None


class Fixed(Speculation):
    """k drafts per row every step (a row gets fewer when its proposer finds fewer)."""

    lazy = False  # drafts every step: the proposer's cache is fed at admission

    def __init__(self, k: int):
        self.k_max, self.defer = k, False

    def idle(self, stop=None) -> None:
        pass

    def plan(self, batch) -> int:
        return self.k_max

    def stop_rule(self, batch, started: float):
        return None

    def choose(self, batch, proposal, started: float) -> int:
        """All drafts, but no column no row uses."""
        n = proposal.num_proposed
        return int(proposal.drafts.shape[1] if n is None else n.max())

    def observe(self, seqs, proposal, width, num_accepted, prop_s, step_s, span, carried=False) -> None:
        pass

    def describe(self) -> None:
        return None


class Realised:
    """What steps realised, by bucket of rows (1, 2-3, 4-7, 8-15, ...) and arm (the steps that
    proposed, plain steps): the average of each step's tokens per second over the rate of a plain
    step of its shape by the probes' fit (no learned factor: a yardstick that does not move while
    the load does), so the rows and spans inside a bucket, and the fit's error, cancel between the
    two arms. Both timed at least REALISED_MIN times, drafting `loses` where the steps that
    proposed realised less than the plain ones, and `wins` where they realised more: the clock
    overrules the cost model either way (measured in a server at 16 rows: the plain step predicted
    at 1.5x its cost, one draft a row verified in nearly every step, 16% under plain steps; and
    offline at one row on a slow day: 92% plain steps while the steps that proposed realised 1.8x
    the plain ones)."""

    def __init__(self):
        self.arms: dict[tuple[int, bool], tuple[float, int]] = {}  # (bucket, proposed) -> (average, steps)

    def observe(self, rows: int, proposed: bool, tokens: int, seconds: float, plain_s: float) -> None:
        key = (rows.bit_length(), proposed)
        gain = tokens * plain_s / (rows * max(seconds, 1e-9))
        mean, n = self.arms.get(key, (0.0, 0))
        self.arms[key] = (mean + max(REALISED_RATE, 1.0 / (n + 1)) * (gain - mean), n + 1)

    def count(self, rows: int, proposed: bool) -> int:
        """Steps of the arm timed in the bucket of `rows` rows."""
        return self.arms.get((rows.bit_length(), proposed), (0.0, 0))[1]

    def loses(self, rows: int) -> bool:
        """Whether the steps that proposed realised less than plain ones at `rows` rows."""
        both = self._both(rows)
        return both is not None and both[1] < both[0]

    def wins(self, rows: int) -> bool:
        """Whether the steps that proposed realised more than plain ones at `rows` rows."""
        both = self._both(rows)
        return both is not None and both[1] > both[0]

    def _both(self, rows: int) -> tuple[float, float] | None:
        """(plain, proposed) averages in the bucket of `rows`, where both are timed enough."""
        plain, drafted = self.arms.get((rows.bit_length(), False)), self.arms.get((rows.bit_length(), True))
        if plain is None or drafted is None or plain[1] < REALISED_MIN[0] or drafted[1] < REALISED_MIN[1]:
            return None
        return plain[0], drafted[0]

    def describe(self) -> dict:
        """{"rows a-b": {"proposed": [average, steps], "plain": [...]}}, JSON-ready."""
        out: dict = {}
        for (bucket, proposed), (mean, n) in sorted(self.arms.items()):
            low = 1 << (bucket - 1)
            name = f"rows {low}-{2 * low - 1}" if low > 1 else "rows 1"
            out.setdefault(name, {})["proposed" if proposed else "plain"] = [round(mean, 3), n]
        return out


class Adaptive(Speculation):
    """Per-step widths from measured costs and learned acceptance (module docstring)."""

    lazy = True  # often plans plain steps only: sequences admitted meanwhile are not fed to the draft

    def __init__(self, target, proposer, capacity: int, k_max: int = AUTO_K_MAX):
        self.k_max, self.proposer = k_max, proposer
        self.branches = proposer.branches  # a draft tree verifies 1 + its nodes to that depth
        self.target, self.capacity = target, capacity
        columns = self._columns(k_max)
        self.step_cost = StepCost(probe(target, capacity, columns))
        self.step_cost.load = now(target, capacity, columns, self.step_cost, SPAN)  # cached fits: at today's speed
        cheap = proposer.model is None
        self.prop_cost = StepCost([] if cheap else probe(proposer.model, capacity, 1))
        if not cheap:
            self.prop_cost.load = now(proposer.model, capacity, 1, self.prop_cost, SPAN)
        self.timed, self.reprobed = 0, False  # steps timed; whether a drifted fit was probed again
        self.stale: list[str] = []  # fits found drifted, to probe again ("target", "proposer")
        self.defer = False  # True (a server): probe them in `idle`, not in the step that found them
        self.prior = _prior(proposer.bins)  # [bins] acceptance of a bin's first draft before any data
        self.hits = torch.zeros(proposer.bins, k_max, dtype=torch.float64)  # decayed accepted counts
        self.seen = torch.zeros_like(self.hits)  # decayed tested counts
        self._estimate()
        self.calibration = [1.0, 1.0]  # decayed sums: accepted drafts predicted, realised
        self.predicted = 0.0
        self.unverified = 0  # steps since the last one that verified a draft
        self.unplain = 0  # steps since the last plain one
        self.ratio: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> r_b
        self.warm_rate: float | None = None  # seconds per token of feeding the draft rows it lacks
        self.realised = Realised()  # what steps that proposed and plain steps realised, measured

    # --- before proposing -----------------------------------------------------------------
    def plan(self, batch) -> int:
        """Drafts to ask the proposer for: k_max, or 0 when no width can beat a plain step."""
        rows, span = len(batch.seqs), batch.attended_span()
        if self.unplain >= (EXPLORE_EVERY if self.realised.count(rows, False) >= REALISED_MIN[0] else REALISED_EXPLORE):
            return 0  # explore: time a plain step (sooner while these rows' plain steps are few)
        if self.unverified < EXPLORE_EVERY and self.realised.loses(rows):
            return 0  # measured: steps that proposed realised less than plain ones at these rows
        r = self._ratios(batch.seqs)
        # A cheap proposer (lookup) is asked unless even its best bin could not pay; a model only
        # when the acceptance seen so far, whatever the bin, can.
        prior = self.table.max(dim=0).values if self.proposer.model is None else self.any_bin
        a = (prior[None, :] * r[:, None]).clamp(max=0.98)
        # A lookup costs one call whatever the width; a model one forward per draft verified (the
        # stop rule ends drafting at the width worth verifying).
        call = self.prop_cost(rows, 1, span)
        model = self.proposer.model is not None
        plain = self.step_cost(rows, self._columns(0), span)  # seconds of a plain step
        if model and self._never_pays(rows, span, call, plain):
            return 0  # not even to explore: drafting would first feed the draft every row's tokens
        rates = self._rates(a.cumprod(dim=1), 0.0 if model else call, rows, span, sunk=False, per_draft=call * model)
        heavy = model and call >= HEAVY_DRAFT * plain
        explore = self.unverified >= EXPLORE_EVERY
        if heavy and not self._warm_pays(batch, rates, plain if explore else 0.0):
            return 0  # feeding the draft the rows it lacks would cost more than drafting saves
        if int(rates.argmax()) == 0 and not explore and not self.realised.wins(rows):
            for seq, r_b in zip(batch.seqs, r.tolist()):  # a row that does not speculate drifts back to average
                self.ratio[seq] = r_b + 0.05 * (1.0 - r_b)
            return 0
        return self.k_max

    def _warm_pays(self, batch, rates: torch.Tensor, allowance: float = 0.0) -> bool:
        """Whether drafting now is worth feeding the draft the rows it lacks first (`Layout.warm`:
        rows admitted while nothing was drafted): the feed's cost, at the seconds per token timed
        in earlier feeds, against the time the best width saves over the rows' remaining tokens
        (at most WARM_HORIZON each) at the rates estimated now, plus `allowance` seconds (an
        exploring step pays up to a plain step's time for a feed: a copy of the target's entries,
        for its own quantized copy, costs about nothing, and without it a pessimistic estimate
        would never be tested while every new row arrives cold). Before any feed was timed, the
        first is taken."""
        cold = batch.cold(self.proposer.role) if batch.warms else 0
        if not cold or self.warm_rate is None:
            return True
        remaining = sum(min(seq.max_len - len(seq), WARM_HORIZON) for seq in batch.seqs)
        best, plain = float(rates.max()), float(rates[0])
        saved = remaining * (1.0 / plain - 1.0 / best)
        return saved + allowance >= cold * self.warm_rate

    def warmed(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            rate = seconds / tokens
            self.warm_rate = rate if self.warm_rate is None else 0.5 * (self.warm_rate + rate)

    def _never_pays(self, rows: int, span: int, call: float, plain: float) -> bool:
        """Whether a draft model costs so much per forward (`call` s) that no width could beat a
        plain step (`plain` s) even if every draft were accepted (a draft as deep as the target, say): then
        the policy never drafts, and the layout never feeds it a prompt."""
        return all(
            q / (self.step_cost(rows, self._columns(q - 1), span) + call * (q - 1)) <= 1.0 / plain
            for q in range(2, self.k_max + 2)
        )

    def stop_rule(self, batch, started: float):
        """For a drafting proposer: stop once one more draft is expected to lower the rate."""
        if self.proposer.model is None:
            return None
        rows, span = len(batch.seqs), batch.attended_span()
        r = self._ratios(batch.seqs)

        def stop(i: int, bins: torch.Tensor) -> bool:
            a = self._estimates(bins.cpu(), r)  # [B, i+1]
            nxt = (self.table[bins[:, -1].cpu(), i + 1] * r).clamp(max=0.98)  # the next draft: like the last
            p = torch.cat([a, nxt[:, None]], dim=1).cumprod(dim=1)
            spent = time.perf_counter() - started
            now = self._rates(p[:, :-1], spent, rows, span).max()
            more = self._rates(p, spent + self.prop_cost(rows, 1, span), rows, span)[-1]
            return bool(more <= now)

        return stop

    # --- after proposing ------------------------------------------------------------------
    def choose(self, batch, proposal, started: float) -> int:
        """The verify width's draft count q - 1 that maximises the step's expected rate."""
        drafts = proposal.drafts.shape[1]
        if proposal.num_proposed is not None:  # no column that no row uses, however cheap it looks
            drafts = min(drafts, int(proposal.num_proposed.max()))
        if drafts == 0:
            return 0
        rows, span = len(batch.seqs), batch.attended_span()
        a = self._estimates(proposal.signal[:, :drafts].cpu(), self._ratios(batch.seqs))
        if proposal.num_proposed is not None:
            a = a * (torch.arange(drafts)[None, :] < proposal.num_proposed.cpu()[:, None])
        spent = time.perf_counter() - started
        p = a.cumprod(dim=1)
        rates = self._rates(p, spent, rows, span)
        width = int(rates.argmax())
        if width == 0 and bool((a[:, 0] > 0).any()):
            if self.realised.wins(rows):  # measured: steps that proposed realised more than plain ones here
                width = 1 + int(rates[1:].argmax())
            elif self.unverified >= EXPLORE_EVERY:
                width = 1  # explore: test the estimates that keep this policy from verifying
        self.predicted = float(p[:, :width].sum())  # accepted drafts expected (before calibration)
        return width

    def observe(self, seqs, proposal, width, num_accepted, prop_s, step_s, span, carried=False) -> None:
        """Learn from a finished step: acceptance by bin and position, each row's ratio, costs."""
        rows = len(num_accepted)
        if step_s is not None and not carried:  # a rider's share is an estimate: the clock alone here
            plain_s = self.step_cost.fitted(rows, self._columns(0), span)  # a plain step of this shape, by the probes
            self.realised.observe(rows, proposal is not None, rows + sum(num_accepted), prop_s + step_s, plain_s)
        if step_s is not None:
            self.step_cost.observe(rows, self._columns(width), span, step_s)
            self._check_drift()
        self.unverified = 0 if width > 0 else self.unverified + 1
        self.unplain = 0 if width == 0 else self.unplain + 1
        if proposal is None:
            return
        if width > 0:  # predicted vs realised accepted drafts, over the recent verify steps
            self.calibration = [
                CALIBRATION_DECAY * c + x for c, x in zip(self.calibration, (self.predicted, sum(num_accepted)))
            ]
        forwards = self._forwards(proposal)
        if forwards:
            self.prop_cost.observe(rows, 1, span, prop_s / forwards)
        if width == 0:
            return
        got = torch.tensor(num_accepted, dtype=torch.float64)
        offered = torch.full((rows,), width)
        if proposal.num_proposed is not None:
            offered = torch.minimum(offered, proposal.num_proposed.cpu())
        bins = proposal.signal[:, :width].cpu()
        r = self._ratios(seqs)
        expected = self._estimates(bins, r).cumprod(dim=1)
        pos = torch.arange(width)
        reached = (pos[None, :] <= got[:, None]) & (pos[None, :] < offered[:, None])  # draft l+1 was tested
        passed = (pos[None, :] < got[:, None]).double()
        for b, j in reached.nonzero().tolist():
            bin_ = int(bins[b, j])
            self.hits[bin_, j] = (1 - TABLE_RATE) * self.hits[bin_, j] + float(passed[b, j])
            self.seen[bin_, j] = (1 - TABLE_RATE) * self.seen[bin_, j] + 1
        self._estimate()
        for b, seq in enumerate(seqs):
            if int(offered[b]) > 0:
                e = float((expected[b] * (pos < offered[b])).sum())
                ratio = (float(got[b]) + 0.5) / (e + 0.5)
                r_b = self.ratio.get(seq, 1.0)
                self.ratio[seq] = min(2.0, max(0.25, r_b + ROW_RATE * (ratio - r_b)))

    def acceptance(self) -> tuple[float, float]:
        """(drafts tested, the share accepted), over every bin and position's decayed counts."""
        seen = float(self.seen.sum())
        return seen, float(self.hits.sum()) / seen if seen else 0.0

    def describe(self) -> dict:
        """What the policy measured and learned (JSON-ready): the fitted costs per width q in ms,
        t_q = (fixed + per_row x B + per_row_per_1k_span x B S / 1000) x load x scale_q, and
        acceptance by bin."""
        return {
            "step_cost": self.step_cost.describe(),
            "proposer_cost": self.prop_cost.describe(),
            "acceptance_by_bin": {
                str(b): [round(float(a), 3) for a in row] for b, row in enumerate(self.table) if self.seen[b].sum() > 0
            },
            "acceptance_any_bin": [round(float(a), 3) for a in self.any_bin],
            "realised": self.realised.describe(),
        }

    def _check_drift(self) -> None:
        """Probe the costs again (once) when the steps timed say a fit read from the disk cache is
        off by DRIFT or more (a fit measured in this process is left to the online factors): now,
        or at the next `idle` when `defer` (a probe takes seconds: no request should wait on it).
        Tensor-parallel ranks decide together (rank 0's clock)."""
        self.timed += 1
        if self.reprobed or self.stale or self.timed % DRIFT_STEPS:
            return  # looked at every DRIFT_STEPS steps, until a fit was probed again
        q_max = self._columns(self.k_max)
        if tp.agree(from_disk(self.target, self.capacity, q_max) and _drifted(self.step_cost)):
            self.stale.append("target")
        model = self.proposer.model
        if model is not None and from_disk(model, self.capacity, 1) and _drifted(self.prop_cost):
            self.stale.append("proposer")  # a whole model per rank: each rank's own decision
        if self.stale and not self.defer:
            self.idle()

    def idle(self, stop=None) -> None:
        """Probe again the fits `_check_drift` found drifted (what `stop` abandons stays to do)."""
        while self.stale:
            role, started = self.stale[0], time.perf_counter()
            if role == "target":
                load = self.step_cost.load
                samples = probe(self.target, self.capacity, self._columns(self.k_max), fresh=True, stop=stop)
            else:
                load = self.prop_cost.load
                samples = probe(self.proposer.model, self.capacity, 1, fresh=True, stop=stop)
            if samples is None:
                return
            if role == "target":
                self.step_cost = StepCost(samples)
            else:
                self.prop_cost = StepCost(samples)
            _say(f"cached {role} costs were off by {load:.2f}x: measured again ({time.perf_counter() - started:.1f}s)")
            self.reprobed = True
            self.stale.pop(0)

    # --- the model ------------------------------------------------------------------------
    def _estimate(self) -> None:
        """table [bins, k_max] and any_bin [k_max] from the decayed counts: each cell's rate,
        shrunk towards the cell before it (the first towards the prior) by PSEUDO observations, so
        a position never tested yet is expected to do as the one before it. The prior of any bin
        is the bins' mean, or for the target's own copy its measured agreement (drafter.py: the
        estimate that chose it), so it drafts from the first step instead of after exploring."""
        self.table = _shrunk(self.hits, self.seen, self.prior)
        first = COPY_ACCEPT if self.proposer.kv_from_target else float(self.prior.mean())  # the target's own copy
        any_prior = torch.tensor([first], dtype=torch.float64)
        self.any_bin = _shrunk(self.hits.sum(0, keepdim=True), self.seen.sum(0, keepdim=True), any_prior)[0]

    def _columns(self, width: int) -> int:
        """Columns a verification of `width` drafts feeds per row: every node of a tree of that depth."""
        return 1 + tree.columns(self.branches, width)

    def _ratios(self, seqs) -> torch.Tensor:
        return torch.tensor([self.ratio.get(s, 1.0) for s in seqs], dtype=torch.float64)

    def _estimates(self, bins: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        """bins [B, j] -> a [B, j]: estimated conditional acceptance of each draft."""
        pos = torch.arange(bins.shape[1])[None, :].expand_as(bins)
        return (self.table[bins, pos] * r[:, None]).clamp(max=0.98)

    def _forwards(self, proposal) -> int:
        """Proposer calls a proposal took: its own count where it gives one, else one per draft
        column for a model and one for a lookup."""
        if proposal.forwards is not None:
            return proposal.forwards
        return proposal.drafts.shape[1] if self.proposer.model is not None else 1

    def _rates(
        self, p: torch.Tensor, prop_s: float, rows: int, span: int, sunk: bool = True, per_draft: float = 0.0
    ) -> torch.Tensor:
        """p [B, j]: probability that drafts 1..l are all accepted -> expected tokens per second of
        widths q = 1 .. j + 1 (index q - 1). The proposer's time `prop_s` is already spent (`sunk`,
        charged to every width) or still avoidable (charged to widths q > 1 only); `per_draft` more
        is charged per draft a width verifies (q - 1 of them: drafting still to do)."""
        predicted, realised = self.calibration
        extra = torch.cat([torch.zeros(1, dtype=torch.float64), p.sum(dim=0).cumsum(dim=0)])
        tokens = rows + extra * min(2.0, max(0.25, realised / predicted))
        seconds = torch.tensor(
            [
                self.step_cost(rows, self._columns(q - 1), span)
                + (prop_s if sunk or q > 1 else 0.0)
                + per_draft * (q - 1)
                for q in range(1, p.shape[1] + 2)
            ],
            dtype=torch.float64,
        )
        return tokens / seconds.clamp(min=1e-9)


def _say(message: str) -> None:
    print(f"batchspec: {message}", file=sys.stderr, flush=True)


def _drifted(cost: StepCost) -> bool:
    return not 1 / DRIFT <= cost.load <= DRIFT


def _prior(bins: int) -> torch.Tensor:
    """Starting acceptance by bin: a bin's share of the way to 0.9 (bin 0: no confidence)."""
    return (torch.arange(bins, dtype=torch.float64) + 0.5) / bins * 0.9


def _shrunk(hits: torch.Tensor, seen: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """[bins, k] rates (hits + PSEUDO x previous) / (seen + PSEUDO), previous = the prior [bins]
    for position 0, else the estimate of the position before."""
    out, previous = torch.empty_like(hits), prior
    for j in range(hits.shape[1]):
        previous = out[:, j] = (hits[:, j] + PSEUDO * previous) / (seen[:, j] + PSEUDO)
    return out


def timed(device) -> float:
    """perf_counter after the device's queued work (the costs are measured on what ran)."""
    sync(device)
    return time.perf_counter()


def make_speculation(config: EngineConfig, target, proposer):
    """`Fixed(k)`, or `Adaptive` for k = "auto" (probes the costs of a batch of `batch_size` rows).
    First the models' linear layers measure every row count a step can feed them (linears.py)."""
    prepare_linears(config, target, None if proposer is None else proposer.model)
    if config.k == "auto" and proposer is not None:
        return Adaptive(target, proposer, config.batch_size, config.k_max)
    return Fixed(config.k_max)


def prepare(config: EngineConfig, target, proposer) -> tuple[Speculation, dict]:
    """`make_speculation`, and what it cost the start: {"tuning_s": seconds, "tuning": "measured",
    "cached", "partly cached" or "none"} (the stats' and the server log's start-up report)."""
    started, before = time.perf_counter(), diskcache.tally.copy()
    speculation = make_speculation(config, target, proposer)
    return speculation, {"tuning_s": round(time.perf_counter() - started, 3), "tuning": diskcache.tuning(before)}
