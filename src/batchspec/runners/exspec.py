"""EXSPEC: cross-batch scheduling from a sliding pool of sequences.

Each sequence keeps its own slice of the target and draft caches between steps (`store.Store`). Each
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

from ..core.sequence import Sequence
from ..engine.step import Context, decode_step
from ..layouts.padded import PaddedBatch
from .scheduler import Scheduler
from .store import Store


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
                store.park(current)
                current = None
            store.prefill(chosen)
            finished = [s for s in chosen if s.finished]
        else:
            if current is None or [s.index for s in current.seqs] != list(decision.ids):
                with ctx.stats.stage("realign"):
                    store.park(current)
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
