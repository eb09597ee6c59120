"""The thread a server's engine loop runs on, and whether the CPU's OpenMP workers spin.

PyTorch's CPU build parallelises with OpenMP (libgomp), which keeps a team of worker threads for
every thread that has run a parallel region. While the teams' threads outnumber the cores, libgomp
throttles their spinning: an idle worker soon sleeps, and every small product pays a wake-up. With
one team on cores it has to itself the workers spin between products, which made the engine loop
15% faster in process; but when another process wants a core they wait on each other at every
barrier (one spinning, the other parked by the scheduler): beside the load generator on 2 cores
the server lost half its throughput at 1 to 8 clients (docs/serving.md, "One OpenMP team or two").

With `--spin on` the engine thread also loads the models and measures the machine (every torch
call on one thread): one team, spinning. `--spin auto` (the default) is that one team, with a
`Ballast` (a parked thread holding a second team, so that libgomp throttles) held only while the
machine is shared (another process keeps BUSY_CORES busy, measured every CHECK_S by a watchdog
that applies the rule at once, mid-iteration too) and the iteration's products are small: a decode
step's have as many rows as the batch, and beside a busy process spinning pays from SPIN_ROWS rows
up; a prefill forward, though large, collapsed beside one (a 1.8 s first token at 4 clients,
against 0.44 s throttled). On a machine the server has to itself the workers always spin: a wave of
16 prompts was prefilled in 3.5 s against 4.4-4.6 s throttled, and the server at 16 clients made
1.00x the offline engine's speed (docs/serving.md, "Spinning while no one else computes"). With
`--spin off` a server loads its models on the main thread and runs the loop on an `EngineThread`
of its own: two teams, always throttled.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import psutil
import torch

#: `--spin` choices: off (two teams, throttled), on (one team, spinning), auto (one team, spinning
#: unless another process is busy and the iteration's products are small: `Spin`).
SPIN_MODES = ("off", "on", "auto")
SPIN_ROWS = 12
#: Cores other processes keep busy from which the machine counts as shared (a load client that
#: busy-waits takes ~0.9 of a core; one waiting for its answers, under 0.01).
BUSY_CORES = 0.25
#: Seconds between measurements of the other processes' load (each over the time since the last).
CHECK_S = 0.2
#: Seconds the machine must have been quiet since it was last shared before the workers spin again.
QUIET_S = 1.0


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
    """A parked thread that has run one OpenMP parallel region, so its team exists (and counts
    towards libgomp's threads) while it is held; `release` ends the thread and its team with it."""

    def __init__(self):
        self._go, ready = threading.Event(), threading.Event()

        def park() -> None:
            torch.ones(1 << 18).add_(1)  # above ATen's grain size: a parallel region, so a team
            ready.set()
            self._go.wait()

        self.thread = threading.Thread(target=park, name="batchspec-ballast", daemon=True)
        self.thread.start()
        ready.wait()

    def release(self) -> None:
        self._go.set()
        self.thread.join()


class OtherLoad:
    """Cores that processes other than this one kept busy since the last call (psutil: the
    machine's busy CPU time, steal included, less this process's)."""

    def __init__(self):
        self.process = psutil.Process()
        self.last = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        """(monotonic seconds, the machine's busy CPU seconds, this process's CPU seconds)."""
        t = psutil.cpu_times()
        busy = t.user + t.nice + t.system
        busy += getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)
        own = self.process.cpu_times()
        return time.monotonic(), busy, own.user + own.system

    def __call__(self) -> float:
        now, last = self._sample(), self.last
        self.last = now
        return max(0.0, (now[1] - last[1]) - (now[2] - last[2])) / max(now[0] - last[0], 1e-3)


class Spin:
    """Whether the engine thread's OpenMP workers spin, under `--spin auto`. A watchdog thread
    measures the other processes' load (`load()`, every `check_s`); the machine is shared while it
    is at least BUSY_CORES, and until it has been under that for QUIET_S. A `Ballast` is held
    while the machine is shared and the batch has fewer than `rows` rows or the iteration runs a
    prefill forward. `follow(rows, prefill)` before each iteration; the watchdog applies the same
    rule after each measurement, mid-iteration too (a wave's prefill lasts seconds): it takes the
    ballast as the machine turns shared and lets it go after QUIET_S of quiet; `close` at the end.
    (Under on and off the server does not make one.)"""

    def __init__(self, rows: int = SPIN_ROWS, load: Callable[[], float] | None = None, check_s: float = CHECK_S):
        self.rows, self.check_s = rows, check_s
        self.load = load if load is not None else OtherLoad()
        self.lock = threading.Lock()  # the ballast and `large` (engine thread and watchdog)
        self.ballast: Ballast | None = Ballast()  # nothing measured yet: throttled
        self.large = False  # the last `follow` had large products (spinning whatever the load)
        self.measured = False  # the watchdog has measured the load once (before: shared)
        self.shared_at: float | None = None  # when the load was last at BUSY_CORES (None: never)
        self.switches = 0  # times the ballast was taken or let go
        self._closed = threading.Event()
        self.watchdog = threading.Thread(target=self._watch, name="batchspec-spin", daemon=True)
        self.watchdog.start()

    @property
    def spinning(self) -> bool:
        return self.ballast is None

    @property
    def shared(self) -> bool:
        """Another process is busy, or was less than QUIET_S ago (or nothing is measured yet)."""
        at = self.shared_at
        return not self.measured or (at is not None and time.monotonic() - at < QUIET_S)

    def follow(self, rows: int, prefill: bool = False) -> None:
        """Spin from here on iff the machine is not shared, or the batch's `rows` reach the
        threshold and the coming iteration runs no `prefill` forward."""
        with self.lock:
            self.large = rows >= self.rows and not prefill
            self._set(self.large or not self.shared)

    def close(self) -> None:
        self._closed.set()
        self.watchdog.join()
        with self.lock:
            self._set(True)

    def _watch(self) -> None:
        while not self._closed.wait(self.check_s):
            if self.load() >= BUSY_CORES:
                self.shared_at = time.monotonic()
            self.measured = True
            with self.lock:
                self._set(self.large or not self.shared)

    def _set(self, spin: bool) -> None:
        """Take or let go of the ballast (under `lock`)."""
        if spin == self.spinning:
            return
        if self.ballast is not None:
            self.ballast.release()
            self.ballast = None
        else:
            self.ballast = Ballast()
        self.switches += 1
