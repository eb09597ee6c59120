"""`Features`: the target's features of each running sequence, by position, kept for a draft head
(proposers/eagle.py) that reads them; every target forward of a step writes them (engine/verify.py)."""

from __future__ import annotations

import weakref

import torch


class Features:
    """The target's features of each sequence by position: what the head reads as f(t - 1).

    `write` after every target forward (prefill chunks, verification): column c of row b holds
    position positions[b, c]; left-pad columns (repeated position 0 before a row's real tokens) are
    skipped. Rejected drafts' features stay until the target feeds those positions again, which it
    does before the head can read them: the head reads f(t - 1) only for t <= the last committed
    token, whose predecessor the target has always fed. Kept per sequence, freed with it."""

    def __init__(self, size: int, aux_layers: tuple[int, ...] = ()):
        self.size, self.aux_layers = size, tuple(aux_layers)
        self.rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> [capacity, F]

    def write(self, seqs: list, positions: torch.Tensor, hidden: torch.Tensor) -> None:
        """positions [B, q] (a forward's position ids), hidden [B, q, F] (`decoder_features`)."""
        pos = positions.tolist()
        for b, seq in enumerate(seqs):
            row = pos[b]
            first = len(row) - 1
            while first > 0 and row[first - 1] == row[first] - 1:  # the real columns: a run of +1 steps
                first -= 1
            start, end = row[first], row[-1] + 1
            buf = self.rows.get(seq)
            if buf is None or buf.shape[0] < end:
                grown = hidden.new_zeros(max(end, 2 * (0 if buf is None else buf.shape[0]), 64), self.size)
                if buf is not None:
                    grown[: buf.shape[0]] = buf
                self.rows[seq] = buf = grown
            buf[start:end] = hidden[b, first:]

    def read(self, seqs: list, positions: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The head's feature inputs [B, q, F] for tokens at positions [B, q]: f(position - 1),
        zeros at position 0 (and for positions the target has not fed: left-pad columns)."""
        out = torch.zeros(*positions.shape, self.size, dtype=dtype, device=positions.device)
        prev = (positions - 1).tolist()
        for b, seq in enumerate(seqs):
            buf = self.rows.get(seq)
            row = prev[b]
            first = next((c for c, p in enumerate(row) if p >= 0), len(row))
            if buf is None or first == len(row):
                continue
            out[b, first:] = buf[row[first] : row[-1] + 1].to(dtype)
        return out
