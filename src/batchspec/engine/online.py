"""The online engine: one thread owns the models and runs the engine loop (loop.py); requests
enter a thread-safe inbox at any time and get their output through a callback.

That thread is a threads.EngineThread, which (unless `serve --spin off`) also loads the models
and measures the machine before the loop starts; under `--spin auto`, the default, the loop holds
a `threads.Spin` (threads.py says why it matters).

Each iteration takes new requests from the inbox, then `Loop.iterate` (drop cancelled rows, admit
waiting requests into free rows of a ragged batch, one decode step). The output processor
(`Context.observe`, here `_observe`) runs in the engine thread right after each commit: it
detokenises each request's new tokens, cuts stop strings (finishing the row, so the same step
retires it) and hands the request a `Chunk`. It never blocks: `emit` must only enqueue.

Faults: an exception in one request's output processing fails that request only; an exception in
a batched step fails the rows of that step (the batch's caches are then rebuilt) and the engine
keeps serving. `shutdown` stops admission, cancels what is left and joins the thread.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..core import heap
from ..core.detok import TextOutput
from ..core.errors import BatchspecError
from ..core.sequence import Sequence
from ..layouts.ragged import RaggedBatch
from .loop import Loop
from .step import Context
from .threads import EngineThread, Spin


class QueueFull(BatchspecError):
    """The waiting queue holds --max-queue requests."""


class ShuttingDown(BatchspecError):
    """The engine no longer admits requests."""


#: When the loop is idle, a first request waits up to this long for others arriving right behind it
#: (each within ARRIVAL_GAP_S of the last): clients that send together are prefilled together
#: rather than the first alone and the rest after it (docs/serving.md, "The server against its own
#: engine"). A lone request waits ARRIVAL_GAP_S.
ARRIVAL_WINDOW_S = 0.05
ARRIVAL_GAP_S = 0.015
#: Seconds without a request before the policy's slow upkeep (probing step costs again, tens of
#: seconds) may run; a request arriving meanwhile abandons it after the forward under way.
QUIET_S = 5.0
#: Freed heap pages go back to the OS (heap.trim) this often while serving, and once the loop has
#: idled for IDLE_TRIM_S: otherwise RSS keeps the high-water of every mix of KV slab, prefix entry
#: and activation sizes the server has seen (docs/serving.md, "The soak").
TRIM_EVERY_S = 30.0
IDLE_TRIM_S = 1.0


def _report(done: Future) -> None:
    """The engine loop ended by an exception: say so (`fault` then reports the thread dead)."""
    if done.exception() is not None:
        traceback.print_exception(done.exception())


@dataclass
class Chunk:
    """New output of one request: text and the tokens it came from; `finish_reason` on the last."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list | None = None  # one logprobs.TokenLogprob per token of token_ids, when asked


@dataclass(eq=False)
class Request:
    seq: Sequence
    emit: Callable[[Chunk], None]  # called from the engine thread; must not block
    output: TextOutput | None = None  # set by the engine (it knows the tokenizer)


@dataclass
class Counters:
    """Totals for /metrics (written by the engine thread, read by any)."""

    outcomes: dict = field(default_factory=dict)  # finish reason -> requests
    prompt_tokens: int = 0
    generated_tokens: int = 0
    queue_length: int = 0
    running: int = 0
    kv_slots_used: int = 0
    kv_slots_allocated: int = 0
    kv_bytes: int = 0  # KV slabs of every role and the prefix cache's entries, now
    kv_bytes_peak: int = 0  # the most kv_bytes since start (what the allocator keeps)


class OnlineEngine:
    """Serves requests on a ragged batch of `capacity` rows whose KV cache holds at most `budget`
    tokens across all rows."""

    def __init__(
        self,
        ctx: Context,
        capacity: int,
        budget: int,
        decode,
        max_queue: int = 256,
        prefill_chunk: int | None = None,
        prefix_cache_tokens: int | None = None,
        arrival_window: float = ARRIVAL_WINDOW_S,
        worker: EngineThread | None = None,
        spin_rows: int | None = None,
        max_gap_s: float | None = None,
        gap_steps: float | None = None,
    ):
        """`worker`: the thread to run the loop on (default: a new one). `spin_rows`: let the
        OpenMP workers spin while no other process is busy, and beside one while the batch holds
        at least that many rows and the iteration prefills nothing (threads.Spin; None: leave
        them as they are). `max_gap_s`: the longest gap prefill may open between a running row's
        steps (admission.py; None: no bound); `gap_steps`: at most that many decode steps (None:
        no relative bound)."""
        self.ctx, self.capacity, self.budget, self.decode = ctx, capacity, budget, decode
        self.max_queue, self.arrival_window = max_queue, arrival_window
        ctx.observe = self._observe
        if ctx.speculation is not None:
            ctx.speculation.defer = True  # its slow upkeep waits for a moment without requests
        self.loop = Loop(ctx, self._new_batch(), prefill_chunk, prefix_cache_tokens, max_gap_s, gap_steps)
        self.loop.admission.progress = self._beat  # a long prefill is progress, not a stall
        self.prefixes = self.loop.prefixes  # the prefix cache (prefixes.py), or None
        self.requests: dict[int, Request] = {}  # id(seq) -> request, engine thread only
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.lock = threading.Lock()
        self.queued = 0  # inbox + waiting; guarded by `lock`
        self.stopping = False
        self.counters = Counters()
        self.beat = time.monotonic()  # when the engine thread last began an iteration
        self.worker = worker if worker is not None else EngineThread()
        self.thread = self.worker.thread
        self.spin_rows = spin_rows
        self.spin: Spin | None = None  # made by the loop (threads.Spin)

    def _new_batch(self) -> RaggedBatch:
        return RaggedBatch(
            self.ctx.models(), self.capacity, self.budget, self.ctx.slots, self.ctx.pad_id, self.ctx.device
        )

    def start(self) -> OnlineEngine:
        """Run the loop on the engine thread (which ends with it)."""
        self.worker.submit(self._main).add_done_callback(_report)
        self.worker.close()
        return self

    def submit(self, request: Request) -> None:
        """Queue a request (any thread). Raises QueueFull or ShuttingDown at once."""
        with self.lock:
            if self.stopping:
                raise ShuttingDown("the server is shutting down")
            if self.queued >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting); retry later")
            self.queued += 1
            self.inbox.put(request)

    def cancel(self, request: Request) -> None:
        """Cancel a request (any thread); its row leaves the batch before the next step."""
        request.seq.cancelled = True

    def fault(self, stall_s: float) -> str | None:
        """Why the engine cannot serve (health checks), or None: its thread is dead, or has neither
        begun an iteration nor finished a prefill forward for `stall_s` seconds (an idle engine
        still iterates every 50 ms)."""
        if not self.thread.is_alive():
            return "the engine thread is not running"
        late = time.monotonic() - self.beat
        return f"the engine loop has not iterated for {late:.0f} s" if late > stall_s else None

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop admitting, cancel queued and running requests, and join the engine thread."""
        with self.lock:
            self.stopping = True
        self.worker.close()  # never started: the thread ends after what it ran
        if self.thread.is_alive():
            self.thread.join(timeout)

    # --- the engine thread --------------------------------------------------------------------
    def _main(self) -> None:
        torch.set_grad_enabled(False)
        self.spin = Spin(self.spin_rows) if self.spin_rows is not None else None
        try:
            self._serve()
        finally:
            if self.spin is not None:
                self.spin.close()

    def _serve(self) -> None:
        with torch.inference_mode():
            last_work = trimmed = time.monotonic()
            while not self._stopped():
                self.beat = time.monotonic()
                if self.loop.busy or not self._quiet():
                    last_work = self.beat
                lull = last_work > trimmed and self.beat - last_work >= IDLE_TRIM_S
                if self.beat - trimmed >= TRIM_EVERY_S or lull:
                    heap.trim()  # every TRIM_EVERY_S, and once each time the loop idles
                    trimmed = self.beat = time.monotonic()
                if self.beat - last_work >= QUIET_S and self.ctx.speculation is not None:
                    self.ctx.speculation.idle(stop=self._arrived)  # slow upkeep in a lull
                    self.beat = last_work = time.monotonic()
                self._take_inbox(block=not self.loop.busy)
                if self.spin is not None:
                    self.spin.follow(len(self.loop.batch), self.loop.admission.will_prefill(self.loop.batch))
                try:
                    finished = self.loop.iterate()
                except Exception as err:  # noqa: BLE001 - a batched step failed: fail its rows, keep serving
                    traceback.print_exc()
                    self._fail_batch(err)
                    finished = []
                for seq in finished:
                    self._retire(seq)
                self._update_gauges()

    def _beat(self) -> None:
        self.beat = time.monotonic()

    def _quiet(self) -> bool:
        """No request has arrived (the loop is idle)."""
        return self.inbox.empty()

    def _arrived(self) -> bool:
        """A request has arrived or the server is stopping (what abandons the policy's upkeep)."""
        with self.lock:
            stopping = self.stopping
        return stopping or not self.inbox.empty()

    def _stopped(self) -> bool:
        """When stopping: cancel everything still queued or running; stop once nothing is left."""
        with self.lock:
            stopping = self.stopping
        if stopping:
            self._take_inbox(block=False)
            for seq in self.loop.sequences():
                seq.cancelled = True
        return stopping and not self.loop.busy

    def _take_inbox(self, block: bool) -> None:
        for request in self._drain(block):
            self._register(request)

    def _drain(self, block: bool) -> list[Request]:
        """The requests in the inbox. When `block` (the loop is idle): wait up to 50 ms for a first
        one, then up to `arrival_window` seconds for those right behind it (each within
        ARRIVAL_GAP_S of the last), so that requests sent together are prefilled together."""
        taken = []
        try:
            if block:
                taken.append(self.inbox.get(timeout=0.05))
                until = time.monotonic() + self.arrival_window
                while len(taken) < self.capacity and (left := until - time.monotonic()) > 0:
                    taken.append(self.inbox.get(timeout=min(ARRIVAL_GAP_S, left)))
            while True:
                taken.append(self.inbox.get_nowait())
        except queue.Empty:
            return taken

    def _register(self, request: Request) -> None:
        """Take a request into the loop (engine thread)."""
        request.output = TextOutput(self.decode, request.seq.params.stop)
        self.requests[id(request.seq)] = request
        self.counters.prompt_tokens += request.seq.prompt_len
        self.loop.add(request.seq)

    def _observe(self, seqs: list[Sequence]) -> None:
        """Output processor: each request's new tokens -> text chunk; stop strings finish rows.
        The queue length is brought up to date first: a client that has its first tokens must
        no longer count as waiting."""
        self._update_queue()
        for seq in seqs:
            request = self.requests.get(id(seq))
            if request is None or seq.cancelled:
                continue
            try:
                request.emit(self._chunk(seq, request.output))
            except Exception as err:  # noqa: BLE001 - fail this request only
                traceback.print_exc()
                seq.finish("error")
                request.emit(Chunk("", [], "error", f"{type(err).__name__}: {err}"))

    def _chunk(self, seq: Sequence, out: TextOutput) -> Chunk:
        before = out.num_tokens
        if out.feed(seq.token_ids[seq.prompt_len + before :]):
            seq.finish("stop", generated=out.num_tokens)
        elif seq.finished:
            out.finish()
        tokens = seq.token_ids[seq.prompt_len + before : seq.prompt_len + out.num_tokens]
        self.counters.generated_tokens += len(tokens)
        logprobs = None if seq.logprobs is None else seq.logprobs[before : out.num_tokens]
        return Chunk(
            out.take(final=seq.finished), tokens, seq.finish_reason if seq.finished else None, logprobs=logprobs
        )

    def _retire(self, seq: Sequence) -> None:
        request = self.requests.pop(id(seq), None)
        reason = seq.finish_reason or "abort"
        self.counters.outcomes[reason] = self.counters.outcomes.get(reason, 0) + 1
        if request is not None and reason == "abort":
            request.emit(Chunk("", [], "abort"))

    def _fail_batch(self, err: Exception) -> None:
        """A step (or a prefill) raised: every request not waiting fails ("error"); the batch
        starts afresh."""
        waiting = {id(s) for s in self.loop.waiting}
        for key in [key for key in self.requests if key not in waiting]:
            request = self.requests.pop(key)
            request.seq.finish("error")
            self.counters.outcomes["error"] = self.counters.outcomes.get("error", 0) + 1
            request.emit(Chunk("", [], "error", f"{type(err).__name__}: {err}"))
        self.loop.reset(self._new_batch())

    def _update_queue(self) -> None:
        with self.lock:
            self.queued = self.inbox.qsize() + len(self.loop.waiting)
            self.counters.queue_length = self.queued

    def _update_gauges(self) -> None:
        self._update_queue()
        self.counters.running = len(self.loop.batch)
        self.counters.kv_slots_used = self.loop.batch.tokens_held()
        self.counters.kv_slots_allocated = self.loop.batch.caches["target"].allocated
        held = self.prefixes.held_bytes if self.prefixes is not None else 0
        self.counters.kv_bytes = self.loop.batch.allocated_bytes() + held
        peak = max(self.counters.kv_bytes, self.loop.batch.peak_bytes)  # the slabs peak within a step
        self.counters.kv_bytes_peak = max(self.counters.kv_bytes_peak, peak)
