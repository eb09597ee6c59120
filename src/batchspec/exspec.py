"""EXSPEC: cross-batch scheduling from a sliding pool of sequences.

Each sequence keeps its own slice of the target and draft caches between steps (`Store`). Each
step the scheduler picks a batch (scheduler.py); its slices are stacked into a `PaddedBatch` -
without padding when the batch is a same-length group, left-padded otherwise (the EQSPEC
fallback) - stepped, and split back. If the next batch is the same set of sequences, the batch is
kept as it is (no split, no stack). Finished sequences leave; waiting ones are admitted and
prefilled. Results keep the input order (each Sequence carries its input index).

Cost model, stated honestly: stacking copies the batch's slices once per step (unless the batch
is reused), and splitting copies them back so a parked sequence does not pin its old batch's
memory. Same-length groups save the padding and the realignment gather, not these copies;
`ragged.py` removes them.
"""

from __future__ import annotations

from . import kv
from .batch import PaddedBatch
from .scheduler import Scheduler
from .sequence import Sequence
from .step import Context, decode_step, start


class Store:
    """Per-sequence cache slices: store[id][role] is a SeqKV of that sequence's real entries."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.slices: dict[int, dict[str, kv.SeqKV]] = {}

    def stack(self, seqs: list[Sequence]) -> PaddedBatch:
        """A padded batch over these sequences' slices; each role's lag is the largest needed,
        rows with more cached entries than that contribute only the first ones."""
        caches = {}
        for role, model in self.ctx.models().items():
            parts = [self.slices[s.index][role] for s in seqs]
            counts = [_count(p) for p in parts]
            lag = max(len(s) - n for s, n in zip(seqs, counts))
            caches[role] = kv.stack(model.config, parts, [len(s) - lag for s in seqs])
        return PaddedBatch(seqs, caches, self.ctx.pad_id, self.ctx.device)

    def park(self, batch: PaddedBatch) -> None:
        """Copy each live row's real entries out of the batch."""
        starts = batch.pad_left.tolist()
        for role, cache in batch.caches.items():
            for seq, layers in zip(batch.seqs, kv.split(cache, starts)):
                self.slices.setdefault(seq.index, {})[role] = [(k.clone(), v.clone()) for k, v in layers]

    def drop(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.slices.pop(s.index, None)


def _count(layers: kv.SeqKV) -> int:
    return layers[0][0].shape[2] if layers else 0


def run(ctx: Context, seqs: list[Sequence], config) -> None:
    """Decode `seqs` in place with EXSPEC scheduling."""
    sched = Scheduler([len(s) for s in seqs], config.batch_size, config.window, config.group_min)
    store = Store(ctx)
    current: PaddedBatch | None = None
    decode_steps = unpadded_steps = group_decisions = 0
    while not sched.done():
        with ctx.stats.stage("schedule"):
            decision = sched.next()
            chosen = [seqs[i] for i in decision.ids]
        if decision.kind == "prefill":
            with ctx.stats.stage("realign"):
                current = _park(store, current)
            _prefill(ctx, store, chosen)
            finished = [s for s in chosen if s.finished]
        else:
            if current is None or [s.index for s in current.seqs] != list(decision.ids):
                with ctx.stats.stage("realign"):
                    _park(store, current)
                    current = store.stack(chosen)
            decode_steps += 1
            unpadded_steps += int(len({len(s) for s in chosen}) == 1)
            group_decisions += int(decision.kind == "group")
            finished = decode_step(ctx, current)
            current = current if len(current) else None
        with ctx.stats.stage("schedule"):
            store.drop(finished)
            sched.ran(decision.ids, {s.index: len(s) for s in chosen}, {s.index for s in finished})
    ctx.stats.extra.update(
        group_rate=unpadded_steps / decode_steps if decode_steps else 0.0,
        group_decisions=group_decisions,
        decode_steps=decode_steps,
    )


def _park(store: Store, batch: PaddedBatch | None) -> None:
    """Move a batch's live rows back to the store; returns None (no current batch)."""
    if batch is not None and len(batch):
        store.park(batch)
    return None


def _prefill(ctx: Context, store: Store, chosen: list[Sequence]) -> PaddedBatch:
    """Prefill `chosen` together and park the rows that did not finish in `store`; returns the
    batch they were prefilled in."""
    batch = start(ctx, chosen)
    with ctx.stats.stage("realign"):
        _park(store, batch)
    return batch


def length_buckets(lengths: list[int], slack: float = 1.25) -> list[int]:
    """Sizes of consecutive buckets of ascending `lengths` such that each bucket, left-padded to its
    longest row, holds at most `slack` x its real tokens (a row that breaks the bound starts a new
    bucket). sum(result) == len(lengths)."""
    sizes: list[int] = []
    n = tokens = 0
    for length in lengths:
        if n and (n + 1) * length > slack * (tokens + length):
            sizes.append(n)
            n = tokens = 0
        n, tokens = n + 1, tokens + length
    return sizes + [n] if n else sizes


def start_bucketed(ctx: Context, seqs: list[Sequence]) -> PaddedBatch:
    """`start` for a static batch, prefilled in length buckets (little padding: one long prompt
    does not pad every row of the batch to its length), then stacked into one padded batch."""
    seqs = sorted(seqs, key=len)
    sizes = length_buckets([len(s) for s in seqs])
    if len(sizes) == 1:
        return start(ctx, seqs)
    store, first = Store(ctx), 0
    for size in sizes:
        batch = _prefill(ctx, store, seqs[first : first + size])
        first += size
    live = [s for s in seqs if not s.finished]
    if not live:
        return batch  # empty: every row finished at its first token
    with ctx.stats.stage("realign"):
        batch = store.stack(live)
    if ctx.check is not None:
        ctx.check(batch)
    return batch
