"""Admission into a running batch without stalls or padding waste (chunked prefill).

Waiting sequences are prefilled between decode steps, at most `chunk` prompt tokens per engine
iteration (as Sarathi-Serve and vLLM do), so a long prompt never stalls the running rows for its
whole length: their step time grows by at most one chunk's cost. Short prompts that fit in the
chunk together are prefilled together, in length buckets (little padding); a prompt longer than
the chunk is fed alone, chunk by chunk, into its own cache, then moved into the batch once
complete (one copy).

The chunk follows measured costs. A prefill forward of n tokens costs a + b n seconds (`PrefillCost`:
a fixed part, the weights streamed once, and a part per token, fitted to the prefills timed), so
the chunk is the n whose forward costs `share` decode steps: n = (share x step - a) / b, and never
less than a / b (below it the fixed part is most of the forward: the per-token cost spirals up as
chunks shrink, which a mean per token mistook for the price of prefill and answered with ever
smaller chunks: 16 tokens per iteration, rows idle for seconds). `share` grows with the rows that
are idle for want of admission: share = SHARE x (running + idle rows with a prompt waiting) /
running, so one running row does not hold fifteen waiting ones at a trickle, while a full batch
pays at most SHARE steps per iteration for a late arrival. While no row is running there is
nothing to stall, and every waiting prompt that fits is prefilled at once; so too while the idle
rows are at least as many as the running ones, unless a longest gap between a running row's steps
is set (`max_gap_s`, the server's `--max-itl-ms`, and `gap_steps`, its `--max-itl-steps`: at most
that many decode steps as last measured, so a few rows with short steps are not held for a long
chunk; the smaller of the two): then every iteration prefills at most what fits in that gap beside
its decode step, whatever waits, and the chunk is the smaller of the two;
and a wave that found nothing running stops once its first forward has started rows, at that much
more (those rows, holding their first token, wait for their second). The forwards' measured seconds
count against the gap as the iteration goes, so a cost fit that is wrong costs at most one forward
past it.
Chunking moves no prefill work, it only chooses who waits: m chunks buy the R running rows m more
steps and delay the I idle rows' first steps by m steps, a net loss of (I - R) x m row-steps
whenever I > R, and no gain at I = R, where the waiting prompt's first token comes sooner at once
(2 synthetic clients: TTFT p50 1.07 -> 0.88 s); the gap bound trades that throughput and those
first tokens for readers that never freeze.

Prompts prefilled together go in forwards of about GROUP_TOKENS tokens each, and each forward hands
out its rows' first tokens before the next begins: once a forward holds that many rows, more rows
make it no cheaper per token, only later for every prompt in it (a wave of 8 prompts of 286 tokens
waited 8 s for its first tokens, all at once, where smaller forwards hand them out one by one).

Where the target's forward can carry them (a compiled decoder: models/forward.py, `Rider`), prompts
admitted while rows run ride in the step's own forward: a long prompt's chunks, its last chunk, or
a group of whole prompts (one padded batch). Their tokens are computed in the same pass as the
running rows', into their own caches, so they cost their tokens' share of a forward and not a
forward's fixed part of their own; a prompt's last chunk gives its first token from the step's
hidden state (its LM head, in `settle`), and its row joins the batch after the step. Riders are
sized by what the steps that carried them took: every step is timed with the rider tokens it
carried (padding included), and a fit of the one to the other (`riding`, as `PrefillCost`) gives a
step's own part and a carried token's, so the gap bounds the whole riding step. The plain steps'
average alone went stale while every step carried a rider (41 ms against 400-500 ms steps: riders
of 2 x 364 padded tokens overran a 0.5 s gap to 1.16 s). The speculation policy times a step that
carried prompt tokens less the rider's share at the fit's cost per token (`Rider.cost_s`), once the
fit is trusted, and not at all before (estimated from the prefill fit, whose b once came from a
first forward's one-time costs, a 526 ms step came out at -0.30 s). A forward that does
not carry them (a draft tree's verify, one the compiled graph does not serve) leaves them to
`settle`, which feeds them alone after the step. Other roles (a draft model fed at admission) are
fed in `settle`, after the target's (a draft head reads its features).

A policy that often drafts nothing (`-k auto`) leaves the proposer's cache empty here: the batch
feeds it a row's tokens when a step first drafts for that row (`RaggedBatch.warm`).

Invariant: a sequence holds a row and its worst-case KV budget (`batch.reserve`) from the moment
its prefill starts, so it can always be moved in when complete.
"""

from __future__ import annotations

import time
from collections import deque

from ..cache import kv
from ..cache.prefixes import PrefixCache, would_reuse
from ..core.sequence import Sequence, Status
from ..distributed import tp
from ..layouts.buckets import buckets
from ..layouts.padded import PaddedBatch
from ..models.forward import Rider, carries
from .step import Context, feed, prefill

MIN_CHUNK = 16  # a measured chunk never drops below this (tiny chunks waste a forward each)
#: Decode steps' worth of prefill one iteration may add while every row is busy (see above).
#: Measured (docs/serving.md, "Admission"): at 1 a late 1,598-token prompt stalled no running row
#: by more than a step but 16 clients got 0.72x the throughput of a 2,048-token chunk; at 4 the
#: throughput of the 2,048-token chunk at 4 and 16 clients, with the running rows' worst step at
#: 0.96 s instead of 3.1 s while the long prompt arrives.
SHARE = 4.0
#: Tokens a prefill forward of whole prompts fills before it runs. Above it the forward's fixed part
#: is under a tenth of it, and more prompts in one forward only make each wait for the others.
#: Measured (SmolLM2-135M, float32, 2 cores): ~30 ms fixed, 1.41 ms a token for one prompt of 286
#: tokens, 1.27-1.34 for 2 to 8 of them in one forward; against 512, TTFT p50 at 2 and 8 clients
#: of 286-token prompts fell from 1.15 / 2.75 s to 1.07 / 2.33 s (docs/serving.md, "Admission").
GROUP_TOKENS = 256
#: Weight of one timed prefill in the cost fit's sums (a memory of about 1 / PREFILL_RATE).
PREFILL_RATE = 0.1
#: The same for the riding steps' fit: a step's cost follows the rows running, which come and go.
STEP_RATE = 0.3
#: Riding steps timed before riders are sized by their fit (one or two gave a 639-token rider and a
#: 1.05 s step against a 0.5 s gap); until then, as a forward of their own.
FIT_RIDES = 4
#: Riders are sized so the riding step, as predicted plus this many times the prediction's RMS error,
#: fits the gap.
MARGIN = 2.0
#: A carried token costs at most this many times a prefilled one (the prefill fit's b, set by many
#: forwards): it computes the same. The riding fit's memory is about three steps, most carrying few
#: tokens, so its slope alone once put a token at 7-97 ms against 1-2 (a 236-token rider given a
#: 22.9 s share of its step, which the speculation policy then learned less).
RIDER_COST_CAP = 2.0
#: The fit separates a from b only once the sizes timed spread by this much (their standard
#: deviation over their mean); before, the cost is all per token.
SPREAD = 0.25


class PrefillCost:
    """Seconds of a prefill forward of n tokens, a + b n (a, b >= 0), fitted by least squares to
    exponentially weighted observations."""

    def __init__(self, rate: float = PREFILL_RATE):
        self.rate = rate  # the weight of the latest observation in the sums
        self.sums = [0.0] * 5  # weighted 1, n, n^2, t, n t
        self.a, self.b = 0.0, None  # b None: nothing timed yet

    def observe(self, tokens: int, seconds: float) -> None:
        n = float(max(tokens, 1))
        point = (1.0, n, n * n, seconds, n * seconds)
        self.sums = [(1 - self.rate) * s + x for s, x in zip(self.sums, point)]
        w, sn, snn, st, snt = self.sums
        det = w * snn - sn * sn  # w^2 x the weighted variance of n
        b = (w * snt - sn * st) / det if det > (SPREAD * sn) ** 2 else 0.0
        if b <= 0:  # sizes too alike to separate a from b (noise would make a / b explode): per token
            self.a, self.b = 0.0, st / sn
            return
        a = (st - b * sn) / w
        self.a, self.b = (a, b) if a >= 0 else (0.0, snt / snn)

    def tokens_for(self, seconds: float) -> int:
        """The largest n whose forward fits in `seconds` (and at least a / b)."""
        b = max(self.b, 1e-12)
        return round(max(seconds - self.a, self.a) / b)


class Admission:
    """Waiting sequences (first in, first out) and at most one prompt being fed in chunks."""

    #: Whether a chunk's target tokens may ride in the step's forward (`rider`) instead of a forward
    #: of their own, where the target's forward can carry them (module docstring; False: never).
    carry = True
    #: Whether a prompt's last chunk may ride as well, its first token picked after the step (False:
    #: a forward of its own, with its first token, as before).
    carry_ends = True
    #: Whether prompts admitted while rows run ride the step as a group (False: prefilled in a forward
    #: of their own, as before). Off: with riders sized by their own steps it gave the same throughput
    #: and longest gaps but a TTFT p50 of 3.8-4.1 s at 16 clients against 1.0-1.7 (one group rides an
    #: iteration, where forwards of their own admit several; docs/serving.md).
    ride_prompts = False

    def __init__(
        self,
        ctx: Context,
        fixed_chunk: int | None = None,
        share: float = SHARE,
        first_chunk: int = 256,
        max_gap_s: float | None = None,
        gap_steps: float | None = None,
    ):
        """`max_gap_s`: the longest a running row should wait between two steps; an iteration
        prefills only what fits in it beside a decode step (None: no bound of its own).
        `gap_steps`: the gap is also at most this many decode steps, as last measured (None: no
        such bound)."""
        self.ctx, self.fixed_chunk, self.share, self.first_chunk = ctx, fixed_chunk, share, first_chunk
        self.max_gap_s, self.gap_steps = max_gap_s, gap_steps
        self.waiting: deque[Sequence] = deque()
        self.partial: PaddedBatch | None = None  # one row, fed chunk by chunk
        self.step_s: float | None = None  # seconds of a step that carried no rider (exponential average)
        self.cost = PrefillCost()  # prefill seconds by tokens per forward
        #: Seconds of a step by the rider tokens it carried (padding included; 0 for a plain step):
        #: a, the step's own part, and b a carried token's, fitted to every step timed.
        self.riding = PrefillCost(STEP_RATE)
        self.rides_timed = 0  # steps timed that carried a rider
        self.ride_error = 0.0  # the riding fit's mean squared error predicting a riding step (seconds^2)
        self.progress = None  # called after each prefill forward (the online engine's heartbeat)
        self.chunks = 0  # prefill chunks that stopped short of a prompt's end
        self.rider: Rider | None = None  # this iteration's chunk for the step to carry, until `settle`
        self._after: list[str] = []  # the rider's chunk's other roles, fed in `settle`
        self.carried = 0  # chunks the step's forward carried
        self.carried_ends = 0  # prompts whose last chunk (and first token) the step's forward carried
        self.prefixes: PrefixCache | None = None  # where prompts start from, if set (Loop sets it)
        #: Prefill seconds measured this iteration since a running row last had a step (None: no
        #: row waits yet); with `max_gap_s`, what the rest of the iteration may still spend.
        self.waited: float | None = None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or self.partial is not None

    def will_prefill(self, batch) -> bool:
        """Whether `admit(batch)` would run a prefill forward now (a prompt being fed, or a
        waiting one that fits)."""
        return self.partial is not None or (bool(self.waiting) and batch.fits(self.waiting[0]))

    def sequences(self) -> list[Sequence]:
        """Waiting sequences and the one being prefilled."""
        return list(self.waiting) + (self.partial.seqs if self.partial is not None else [])

    def drop_cancelled(self, batch) -> None:
        """Forget cancelled sequences; a cancelled prefill gives back its reservation."""
        self.waiting = deque(s for s in self.waiting if not s.cancelled)
        if self.partial is not None and self.partial.seqs[0].cancelled:
            batch.unreserve(self.partial.seqs)
            self.partial = None

    def chunk(self, running: int = 1, idle: int = 0, rides: bool = False) -> int | None:
        """Prompt tokens one iteration may prefill while `running` rows decode and `idle` free
        rows have a prompt waiting for them (None: every waiting prompt that fits). `rides`: they
        ride the step's forward (sized by the riding steps' fit once one is timed)."""
        if self.fixed_chunk is not None:
            return self.fixed_chunk
        step = self.step
        if step is None or self.cost.b is None:
            return None if idle >= running and not self.gapped else self.first_chunk
        tokens_for = self._ride_tokens if rides and self.fitted else self.cost.tokens_for
        by_share = None
        if idle < running:
            share = self.share * (running + idle) / max(running, 1)
            by_share = max(MIN_CHUNK, tokens_for(share * step))
        if self.gap_s is None:
            return by_share
        by_gap = max(MIN_CHUNK, tokens_for(self.gap_s - step))  # the step runs too
        return by_gap if by_share is None else min(by_share, by_gap)

    def _ride_tokens(self, seconds: float) -> int:
        """Rider tokens that add `seconds` to a step, at the riding fit's cost per token (no fixed
        part: the step pays it), less MARGIN x the fit's RMS error predicting a riding step (a
        step's cost varies with k and the rows; the gap is a bound, not a mean)."""
        seconds -= MARGIN * self.ride_error**0.5
        return round(max(seconds, 0.0) / max(self.rider_b, 1e-12))

    @property
    def rider_b(self) -> float:
        """A carried token's seconds: the riding fit's, at most RIDER_COST_CAP x the prefill fit's."""
        b = self.riding.b or 0.0
        return b if self.cost.b is None else min(b, RIDER_COST_CAP * self.cost.b)

    @property
    def fitted(self) -> bool:
        """Whether the riding fit is trusted to size riders and estimate their share (FIT_RIDES)."""
        return self.rides_timed >= FIT_RIDES

    @property
    def step(self) -> float | None:
        """A decode step's seconds without a rider: the riding fit's own part once it separates
        it from the riders' (it follows the batch while every step carries one), else the plain
        steps' average (None: none timed)."""
        return self.riding.a if self.riding.a > 0 else self.step_s

    @property
    def gapped(self) -> bool:
        """Whether a longest gap is set, in seconds or in steps."""
        return self.max_gap_s is not None or self.gap_steps is not None

    @property
    def gap_s(self) -> float | None:
        """The longest gap prefill may open between a running row's steps now: the smaller of
        `max_gap_s` and `gap_steps` decode steps as last measured (None: no bound, or only one in
        steps and no step measured yet)."""
        bounds = [
            self.max_gap_s,
            None if self.gap_steps is None or self.step is None else self.gap_steps * self.step,
        ]
        return min((b for b in bounds if b is not None), default=None)

    def observe_step(self, seconds: float, ridden: int = 0) -> None:
        """A step took `seconds` and carried `ridden` rider tokens (padding included)."""
        if not ridden:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        elif self.rides_timed:  # the fit's miss, before it learns from this step
            miss = seconds - (self.riding.a + self.riding.b * ridden)
            self.ride_error = (1 - STEP_RATE) * self.ride_error + STEP_RATE * miss * miss
        self.rides_timed += ridden > 0
        self.riding.observe(ridden, seconds)

    def _observe_prefill(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)
        if self.waited is not None:
            self.waited += seconds
        if self.progress is not None:
            self.progress()

    def admit(self, batch) -> list[Sequence]:
        """One iteration's prefill work for `batch` (a RaggedBatch). Returns the sequences that
        finished at their first token (they never enter the batch)."""
        # None: nothing running, nothing to stall. A measured chunk is rank 0's on every rank (tp.py).
        limit, self.waited = None, None
        if len(batch):
            idle = min(batch.free, len(self.waiting)) + (self.partial is not None)
            rides = self._carries(batch) and (self.partial is not None or self.ride_prompts)
            limit = self.chunk(len(batch), idle, rides)
            limit = limit if self.fixed_chunk is not None else tp.agree(limit)
            self.waited = 0.0
        spent, finished = 0, []
        if self.partial is not None:
            spent, finished = self._feed(batch, limit)
            limit = self._bounded(batch, limit, spent)
        while self.partial is None and self.waiting and batch.fits(self.waiting[0]):
            room = None if limit is None else limit - spent
            if room is not None and room <= 0:
                break
            hit = self.prefixes.worth(self.waiting[0].token_ids) if self.prefixes is not None else None
            rest = len(self.waiting[0]) - (hit.length if hit is not None else 0)
            if hit is not None or (room is not None and rest > room):  # alone, from its cached prefix
                if spent and room is not None and rest > room:
                    break  # a long prompt starts next iteration, with a whole chunk
                self.partial = self._open(batch, [self.waiting.popleft()], hit)
                used, done = self._feed(batch, room)
                spent, finished = spent + used, finished + done
                limit = self._bounded(batch, limit, spent)
                continue
            # A riding group is bounded as any group (GROUP_TOKENS): bounded by the room alone, it gave
            # 0.76-0.84x the throughput and 5x the TTFT p50 at 16 clients (docs/serving.md).
            rides = room is not None and self._rides(batch)
            group = [self.waiting.popleft()]
            size = len(group[0])  # the group's prompt tokens
            while self.waiting and batch.fits(self.waiting[0], extra=group):
                if size >= GROUP_TOKENS:
                    break  # a full forward: its first tokens go out before the next group's prefill
                if room is not None and _tokens([*group, self.waiting[0]], rides) > room:
                    break  # riding, a group costs its padded tokens (2 x 364 for 200 + 364)
                if self.prefixes is not None and would_reuse(self.waiting[0], group):
                    break  # it starts from this group's entries, once they are stored (n > 1, a system prompt)
                group.append(self.waiting.popleft())
                size += len(group[-1])
            spent += _tokens(group, rides)
            if rides:  # the group rides the step's forward
                self.partial = self._open(batch, sorted(group, key=len))
                self._feed(batch, room)
                break
            finished += self._prefill_group(batch, group)
            limit = self._bounded(batch, limit, spent)
        return finished

    def _rides(self, batch) -> bool:
        """Whether prompts admitted now would ride the step's forward whole (rows run)."""
        return self.ride_prompts and self.carry_ends and self._carries(batch)

    def _carries(self, batch) -> bool:
        """Whether the step's forward can carry a rider now (rows run, the target is compiled)."""
        return self.carry and len(batch) > 0 and carries(self.ctx.target)

    def _bounded(self, batch, limit: int | None, spent: int) -> int | None:
        """The iteration's limit after a forward, once rows run and a gap is set. An unbounded wave
        (nothing was running) stops at the gap's worth of tokens past what it has fed, since the
        rows it started now wait for their next step (each forward hands out first tokens; the
        rest must not hold them). After that, the forwards' measured seconds count: the limit
        is what the cost fit says fits in the gap's time left, and nothing once it is spent. So
        a fit that is wrong (a few forwards timed, the first shapes' one-time costs: a fixed part of
        0.27 s and 0.13 ms a token was seen, which let 2,300 tokens into a 0.5 s gap) costs at most
        one forward past the gap, and the next forwards are sized by the fit it corrected."""
        if not self.gapped or self.fixed_chunk is not None or not len(batch):
            return limit
        if self.waited is None:  # this forward started the first rows: their gap begins now
            self.waited = 0.0
            idle = min(batch.free, len(self.waiting))
            return spent + tp.agree(self.chunk(len(batch), idle))
        if self.gap_s is None:  # a gap in steps only, and no step measured yet
            return limit
        left = self.gap_s - (self.step or 0.0) - self.waited
        timed = spent + (self.cost.tokens_for(left) if left > 0 and self.cost.b is not None else 0)
        return tp.agree(timed if limit is None else min(limit, timed))

    def settle(self, batch) -> list[Sequence]:
        """After the step: this iteration's rider, if the step's forward did not carry it (a tree's
        verify, a forward the compiled graph does not serve), is fed alone now; a carried one's
        target features are kept where a draft head reads them. Then the chunk's other roles are
        fed (after the target's, whose features a head reads). A prompt's last chunk then gives
        its first token and moves its row into `batch`. Returns the sequences that finished."""
        rider, self.rider = self.rider, None
        if rider is None:
            return []
        if rider.completes:
            return self._settle_end(batch, rider)
        part, n = self.partial, rider.ids.shape[1]
        start = time.perf_counter()
        with self.ctx.stats.stage("prefill"):
            if not rider.fed:
                feed(self.ctx, part, "target", rider.ids)
            self._keep_features(part, rider)
            for role in self._after:
                feed(self.ctx, part, role, part.pending(role)[:, :n])
        self.carried += rider.fed
        if not rider.fed:  # a forward of its own (with the other roles', as `_feed` times one)
            self._observe_prefill(n, time.perf_counter() - start)
        return []

    def _settle_end(self, batch, rider: Rider) -> list[Sequence]:
        """A prompt's last chunk after the step: carried, its first token comes from the target's
        last hidden state (its LM head, as `feed` computes it), the other roles are fed and the row
        moves in; not carried, it is prefilled alone as any last chunk."""
        part, self.partial = self.partial, None
        if not rider.fed:
            return self._complete(batch, part, rider.ids.numel())
        self.carried_ends += 1
        self._keep_features(part, rider)
        logits = self.ctx.target.get_output_embeddings()(rider.hidden[:, -1:])
        return self._complete(batch, part, None, self._after, logits)

    def _keep_features(self, part: PaddedBatch, rider: Rider) -> None:
        """A carried rider's target features, kept where the proposer reads them (if it does)."""
        if rider.fed and self.ctx.features is not None:
            self.ctx.features.write(part.seqs, rider.inputs["position_ids"], rider.features)

    def _open(self, batch, seqs: list[Sequence], hit=None) -> PaddedBatch:
        """A padded batch for prompts to be fed apart from the running rows (one prompt in chunks or
        after a cached prefix, or a group riding the step): its caches hold `hit`'s entries of the
        roles fed at admission (one prompt), else nothing."""
        batch.reserve(seqs)
        models = self.ctx.models()
        caches = kv.empty_caches(models)
        fed = {role: models[role] for role in _roles(self.ctx, batch)}
        for seq in seqs:
            seq.status = Status.RUNNING
            if self.prefixes is not None:
                caches |= self.prefixes.take(seq, hit, fed)
        return PaddedBatch(seqs, caches, self.ctx.pad_id, self.ctx.device)

    def _feed(self, batch, limit: int | None) -> tuple[int, list[Sequence]]:
        """Feed the partial prompt one chunk (every role), or finish its prefill and move it in."""
        part = self.partial
        left = part.width - part.cache_width("target")
        # Until FIT_RIDES riding steps are timed, sized as a forward of its own: sized from the prefill fit
        # without its fixed part (a / b tokens more) it gave 1.00-1.18x the throughput but 1.3-1.9x
        # the ITL p99 at 8 clients under --max-itl-steps 2.5 (docs/serving.md); then by `riding`.
        carried = self._carries(batch)
        roles = _roles(self.ctx, batch)
        if limit is not None and left > limit:
            self.chunks += 1
            if carried:  # the target's part rides in the step
                self._ride(part, limit, roles, completes=False)
                return limit, []
            start = time.perf_counter()
            with self.ctx.stats.stage("prefill"):
                for role in roles:
                    feed(self.ctx, part, role, part.pending(role)[:, :limit])
            self._observe_prefill(limit, time.perf_counter() - start)
            return limit, []
        if carried and self.carry_ends and left > 0:  # the last chunk rides too; its first token comes in `settle`
            self._ride(part, left, roles, completes=True)
            return left, []
        self.partial = None
        return left, self._complete(batch, part, left)

    def _ride(self, part: PaddedBatch, n: int, roles: list[str], completes: bool) -> None:
        """Hand `part`'s next n target tokens to the step as its rider; its other roles are fed in
        `settle`, once the target's are (a draft head reads their features)."""
        ids = part.pending("target")[:, :n]
        cost_s = self.rider_b * ids.numel() if self.fitted else None  # the policy learns the step less it
        self.rider = Rider(ids, part.inputs("target", n), completes=completes, cost_s=cost_s)
        self._after = [role for role in roles if role != "target"]

    def _prefill_group(self, batch, group: list[Sequence]) -> list[Sequence]:
        """Prefill whole prompts in length buckets and move them in."""
        for seq in group if self.prefixes is not None else ():
            self.prefixes.take(seq, None, {})  # a lookup that missed
        batch.reserve(group)
        group = sorted(group, key=len)
        finished = []
        for rows in buckets(group):
            for seq in rows:
                seq.status = Status.RUNNING
            caches = kv.empty_caches(self.ctx.models())
            finished += self._complete(
                batch, PaddedBatch(rows, caches, self.ctx.pad_id, self.ctx.device), sum(map(len, rows))
            )
        return finished

    def _complete(self, batch, part: PaddedBatch, tokens: int | None, roles=None, target_logits=None) -> list[Sequence]:
        """Prefill what `part` lacks (first token included) and move its live rows into `batch`.
        `tokens`: the prompt tokens this forward feeds, timed for the cost fit (None: not a forward
        of its own); `roles`, `target_logits`: as `prefill` takes them."""
        start = time.perf_counter()
        finished = prefill(self.ctx, part, _roles(self.ctx, batch) if roles is None else roles, target_logits)
        if tokens is not None:
            self._observe_prefill(tokens, time.perf_counter() - start)
        batch.unreserve(finished)
        if len(part):
            with self.ctx.stats.stage("schedule"):
                if self.prefixes is not None:
                    self._store(part)
                batch.admit(part)
        return finished

    def _store(self, part: PaddedBatch) -> None:
        """Keep the entries of the prefilled rows that a waiting prompt would start from (another
        choice of the same prompt, a shared system prompt) in the prefix cache now; the others are
        kept when their rows leave (a copy costs memory bandwidth: only the ones of use now)."""
        rows = [b for b, seq in enumerate(part.seqs) if any(would_reuse(w, [seq]) for w in self.waiting)]
        if not rows:
            return
        starts = part.pad_left.tolist()
        shares = {role: kv.split(cache, starts) for role, cache in part.caches.items()}
        for b in rows:
            entries = {role: split[b] for role, split in shares.items()}
            self.prefixes.put(part.seqs[b], entries, {role: kv.count(e) for role, e in entries.items()})


def _roles(ctx: Context, batch) -> list[str]:
    """Roles a prompt is fed to at admission: a lazy policy's proposer cache is fed later, by the
    batch (`warm`), if it can."""
    return ctx.admitted_roles() if batch.warms else list(ctx.models())


def _tokens(group: list[Sequence], padded: bool) -> int:
    """A group's prompt tokens, or its padded batch's (rows x the longest) where `padded`."""
    return len(group) * max(map(len, group)) if padded else sum(map(len, group))
