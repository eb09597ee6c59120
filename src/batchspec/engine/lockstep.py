"""The online engine on tensor-parallel ranks (`batchspec serve --tp N`): rank 0 serves HTTP and
leads, the other ranks follow it iteration for iteration.

Every rank runs a `LockstepEngine` over its shard of the target. Each iteration begins with one
broadcast from rank 0 (`tp.agree`) of what happened since the last one: the new requests (prompt,
limits, sampling parameters, seed), the cancelled ones and whether to stop. A follower
rebuilds the same Sequences and applies the same cancellations at the same point of the loop, so
every rank admits, steps, cuts stop strings and retires alike; only rank 0's requests have a
client to emit to. Cancellations from clients (any thread on rank 0) are queued and take effect
at the next iteration's broadcast, never between two ranks' steps.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

from ..core.config import SamplingParams
from ..core.sequence import Sequence
from ..distributed import tp
from .online import OnlineEngine, Request


@dataclass(frozen=True)
class NewRequest:
    """What a follower needs to rebuild a request's Sequence."""

    prompt_ids: list[int]
    max_len: int
    eos_ids: frozenset[int]
    params: SamplingParams
    seed: int | None  # the noise's seed; None for greedy requests

    @classmethod
    def of(cls, seq: Sequence) -> NewRequest:
        return cls(list(seq.prompt_ids), seq.max_len, seq.eos_ids, seq.params, seq.seed)

    def sequence(self, matcher_of=None) -> Sequence:
        """The request's Sequence on a follower; `matcher_of(params)` gives a constrained
        request's grammar state (each rank keeps its own, advanced by the same committed tokens)."""
        matcher = None if self.params.constraint is None else matcher_of(self.params)
        return Sequence(0, self.prompt_ids, self.max_len, self.eos_ids, self.seed, self.params, matcher=matcher)


class LockstepEngine(OnlineEngine):
    """An OnlineEngine whose inputs (requests, cancellations, stop) are rank 0's on every rank.
    Requests are numbered in the order the loop takes them, which is the same on every rank."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.cancels: queue.Queue[Request] = queue.Queue()  # rank 0, from any thread
        self.unsent: list[Request] = []  # cancelled while still in the inbox
        self.numbers: dict[int, int] = {}  # id(request) -> its number (running or waiting)
        self.by_number: dict[int, Request] = {}
        self.taken = 0
        self.agreed_stop = False
        #: params -> a constrained request's grammar state on this rank (the server sets it: ModelPair.matcher)
        self.matcher_of = None

    def cancel(self, request: Request) -> None:
        self.cancels.put(request)

    def follow(self) -> None:
        """A follower rank: run the loop in this thread until rank 0 stops."""
        self._main()

    def _stopped(self) -> bool:
        if self.agreed_stop:
            for seq in self.loop.sequences():
                seq.cancelled = True
        return self.agreed_stop and not self.loop.busy

    def _quiet(self) -> bool:
        """Rank 0's inbox is empty (every rank decides alike: an idle loop is idle on every rank)."""
        return tp.agree(self.inbox.empty() if tp.is_leader() else None)

    def _take_inbox(self, block: bool) -> None:
        leader = tp.is_leader()
        new = self._drain(block) if leader else []
        payloads, cancelled, stop = tp.agree(self._news(new) if leader else None)
        if not leader:
            new = [Request(p.sequence(self.matcher_of), lambda chunk: None) for p in payloads]
        for request in new:
            self.numbers[id(request)], self.by_number[self.taken] = self.taken, request
            self.taken += 1
            self._register(request)
        for number in cancelled:
            if number in self.by_number:  # (not retired meanwhile; the same on every rank)
                self.by_number[number].seq.cancelled = True
        self.agreed_stop = stop

    def _news(self, new: list[Request]) -> tuple[list[NewRequest], list[int], bool]:
        """Rank 0: the new requests, the numbers of the cancelled ones, and whether to stop."""
        pending, self.unsent = self.unsent, []
        while True:
            try:
                pending.append(self.cancels.get_nowait())
            except queue.Empty:
                break
        upcoming = {id(r): self.taken + i for i, r in enumerate(new)}
        cancelled = []
        for request in pending:
            number = self.numbers.get(id(request), upcoming.get(id(request)))
            if number is None:
                self.unsent.append(request)  # still in the inbox: next iteration
            else:
                cancelled.append(number)
        with self.lock:
            stop = self.stopping
        return [NewRequest.of(r.seq) for r in new], cancelled, stop

    def _retire(self, seq: Sequence) -> None:
        request = self.requests.get(id(seq))
        if request is not None:
            self.by_number.pop(self.numbers.pop(id(request), -1), None)
        super()._retire(seq)
