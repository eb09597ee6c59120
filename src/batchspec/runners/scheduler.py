"""EXSPEC's scheduler: a sliding window over the request pool, and the choice of each step's
batch. Plain Python, no tensors, so its properties are tested without models.

Each call to `next()` returns one `Decision`:
- "prefill": admitted sequences that have no cache yet; equal prompt lengths together (no
  padding), the remaining singletons padded together, shortest first.
- "group": the largest set of sequences of equal current length, if it has at least `min_group`
  members: it runs without padding or realignment.
- "fallback": otherwise the `batch_size` sequences that have waited longest, as a padded batch.
Fairness: a sequence that has waited more than `patience` steps forces a fallback batch of the
longest-waiting sequences, so no sequence waits more than `patience + 1` steps in the window.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass


@dataclass
class Entry:
    id: int
    length: int
    admitted: int  # admission order
    prefilled: bool = False
    last_run: int = -1  # the step at which it last ran (or was admitted)


@dataclass(frozen=True)
class Decision:
    kind: str  # "prefill" | "group" | "fallback"
    ids: tuple[int, ...]  # in admission order


class Scheduler:
    def __init__(
        self, prompt_lengths: list[int], batch_size: int, window: int, min_group: int, patience: int | None = None
    ):
        self.batch_size, self.window_size, self.min_group = batch_size, window, min_group
        self.patience = patience if patience is not None else 2 * -(-window // batch_size)
        self.lengths = list(prompt_lengths)
        self.waiting = deque(range(len(prompt_lengths)))
        self.window: dict[int, Entry] = {}
        self.step = 0
        self._admitted = 0

    def done(self) -> bool:
        return not self.waiting and not self.window

    def next(self) -> Decision:
        """The batch to run now (admits waiting sequences into free window places first)."""
        self._admit()
        fresh = [e for e in self.window.values() if not e.prefilled]
        return self._prefill(fresh) if fresh else self._decode()

    def ran(self, ids, lengths: dict[int, int], finished: set[int]) -> None:
        """Report a run: the sequences' new lengths; finished ones leave the window."""
        for i in ids:
            if i in finished:
                del self.window[i]
                continue
            entry = self.window[i]
            entry.length, entry.prefilled, entry.last_run = lengths[i], True, self.step
        self.step += 1

    def _admit(self) -> None:
        while self.waiting and len(self.window) < self.window_size:
            i = self.waiting.popleft()
            self.window[i] = Entry(i, self.lengths[i], self._admitted, last_run=self.step)
            self._admitted += 1

    def _prefill(self, fresh: list[Entry]) -> Decision:
        groups = _by_length(fresh)
        best = max(groups.values(), key=len)
        if len(best) >= 2:
            return Decision("prefill", _ordered(best[: self.batch_size]))
        shortest = sorted(fresh, key=lambda e: (e.length, e.admitted))[: self.batch_size]
        return Decision("prefill", _ordered(shortest))

    def _decode(self) -> Decision:
        entries = list(self.window.values())
        by_wait = sorted(entries, key=lambda e: (e.last_run, e.admitted))
        if self.step - by_wait[0].last_run <= self.patience:
            groups = _by_length(entries).values()
            best = max(groups, key=lambda g: (len(g), -min(e.last_run for e in g)))
            if len(best) >= self.min_group:
                best = sorted(best, key=lambda e: (e.last_run, e.admitted))[: self.batch_size]
                return Decision("group", _ordered(best))
        return Decision("fallback", _ordered(by_wait[: self.batch_size]))


def _by_length(entries: list[Entry]) -> dict[int, list[Entry]]:
    groups: dict[int, list[Entry]] = defaultdict(list)
    for e in entries:
        groups[e.length].append(e)
    return groups


def _ordered(entries: list[Entry]) -> tuple[int, ...]:
    return tuple(e.id for e in sorted(entries, key=lambda e: e.admitted))
