"""The threads a server's torch work runs on, and whether the CPU's OpenMP workers spin.

PyTorch's CPU build parallelises with OpenMP (libgomp), which keeps a team of worker threads for
every thread that has run a parallel region. While the teams' threads outnumber the cores, libgomp
throttles their spinning: an idle worker soon sleeps, and every small product then pays a wake-up.
With one team on cores it has to itself, its workers spin between products: measured on 2 cores,
the online engine made 0.92x of its offline speed with one team against 0.80x with two
(docs/serving.md, "One OpenMP team or two"). But spinning workers collapse when another process
wants a core at small batches (one client beside a busy load generator: 8-9 against 20 tok/s),
because at every barrier one waits, spinning, for the other the scheduler parked.

- `EngineThread` runs a server's loading, measuring and engine loop on one thread: one team.
- `Ballast` is a parked thread that holds a second team, so that libgomp throttles; the engine
  holds it while its batch has few rows (`Spin`) and lets it go while the batch is large.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

#: `--spin` choices: auto (spin while the batch holds at least SPIN_ROWS rows), on, off.
SPIN_MODES = ("auto", "on", "off")
SPIN_ROWS = 4


class EngineThread:
    """One daemon thread that runs the calls given to it, in order, until `close`: a server's
    loading, warm-up and engine loop, so that all of them run on the same thread."""

    def __init__(self, name: str = "batchspec-engine"):
        self.tasks: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def submit(self, fn: Callable, *args) -> Future:
        """Run fn(*args) on the thread after what was submitted before; its result in the future."""
        done: Future = Future()
        self.tasks.put((fn, args, done))
        if self.thread.ident is None:  # started by the first call
            self.thread.start()
        return done

    def call(self, fn: Callable, *args):
        """fn(*args) on the thread, waited for (its exception raised here)."""
        return self.submit(fn, *args).result()

    def close(self) -> None:
        """The thread ends once what was submitted has run."""
        self.tasks.put(None)

    def _run(self) -> None:
        while (task := self.tasks.get()) is not None:
            fn, args, done = task
            if done.set_running_or_notify_cancel():
                try:
                    done.set_result(fn(*args))
                except BaseException as err:  # noqa: BLE001 - handed to the caller
                    done.set_exception(err)


class Ballast:
    """A parked thread that has run one OpenMP parallel region, so its team exists (and counts)
    while it is held; `release` ends the thread and its team with it."""

    def __init__(self):
        self._go, ready = threading.Event(), threading.Event()

        def park():
            torch.ones(1 << 18).add_(1)  # above ATen's grain size: a parallel region, a team
            ready.set()
            self._go.wait()

        self.thread = threading.Thread(target=park, name="batchspec-ballast", daemon=True)
        self.thread.start()
        ready.wait()

    def release(self) -> None:
        self._go.set()
        self.thread.join()


class Spin:
    """Whether the engine's OpenMP workers spin: `mode` on (never a ballast), off (always one), or
    auto (a ballast while the batch has fewer than `rows` rows). `follow(rows)` after each step."""

    def __init__(self, mode: str = "auto", rows: int = SPIN_ROWS):
        if mode not in SPIN_MODES:
            raise ValueError(f"spin mode must be one of {SPIN_MODES}, got {mode!r}")
        self.mode, self.rows = mode, rows
        self.ballast: Ballast | None = None
        self.switches = 0  # times the ballast was taken or let go

    @property
    def spinning(self) -> bool:
        return self.ballast is None

    def follow(self, rows: int) -> None:
        want = self.mode == "on" or (self.mode == "auto" and rows >= self.rows)
        if want == self.spinning:
            return
        if want:
            self.ballast.release()
            self.ballast = None
        else:
            self.ballast = Ballast()
        self.switches += 1

    def close(self) -> None:
        if self.ballast is not None:
            self.ballast.release()
            self.ballast = None
