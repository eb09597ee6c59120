"""`Store`: per-sequence cache slices kept between steps, outside any batch.

A sequence's slice is, per role, a `kv.SeqKV` holding its real cache entries (oldest first).
`park` copies a padded batch's live rows out; `stack` builds a padded batch back from slices
(without padding when the rows contribute equally many entries). EXSPEC keeps its pool here,
and static batches use it to prefill in length buckets and stack the results.
"""

from __future__ import annotations

from ..cache import kv
from ..core.sequence import Sequence
from ..engine.step import Context, start
from ..layouts.padded import PaddedBatch


class Store:
    """Per-sequence cache slices: store.slices[index][role] is a SeqKV of that sequence's entries."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.slices: dict[int, dict[str, kv.SeqKV]] = {}

    def stack(self, seqs: list[Sequence]) -> PaddedBatch:
        """A padded batch over these sequences' slices; each role's lag is the largest needed,
        rows with more cached entries than that contribute only the first ones."""
        caches = {}
        for role, model in self.ctx.models().items():
            parts = [self.slices[s.index][role] for s in seqs]
            counts = [kv.count(p) for p in parts]
            lag = max(len(s) - n for s, n in zip(seqs, counts))
            # A row shorter than the lag contributes nothing: its pending tokens are left-padded
            # (a negative take would slice `[:n]` from the end and keep entries).
            caches[role] = kv.stack(model.config, parts, [max(len(s) - lag, 0) for s in seqs])
        return PaddedBatch(seqs, caches, self.ctx.pad_id, self.ctx.device)

    def park(self, batch: PaddedBatch | None) -> None:
        """Copy each live row's real entries out of the batch (nothing for None or an empty batch)."""
        if batch is None or not len(batch):
            return
        starts = batch.pad_left.tolist()
        for role, cache in batch.caches.items():
            for seq, layers in zip(batch.seqs, kv.split(cache, starts)):
                self.slices.setdefault(seq.index, {})[role] = [(k.clone(), v.clone()) for k, v in layers]

    def drop(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self.slices.pop(s.index, None)

    def prefill(self, seqs: list[Sequence]) -> PaddedBatch:
        """Prefill `seqs` together and park the rows that did not finish; returns their batch."""
        batch = start(self.ctx, seqs)
        with self.ctx.stats.stage("realign"):
            self.park(batch)
        return batch
