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
`Ballast` (a parked thread holding a second team, so that libgomp throttles) held while the batch
has fewer than SPIN_ROWS rows and the iteration runs no prefill forward: a step's smallest products
have as many rows as the batch, a prefill's as many as its prompt tokens, and only small products
lose by spinning beside a busy process (docs/serving.md, "The wait policies in isolation"). An
idle server that throttled through the prefill of a wave of 16 prompts took 4.4-4.6 s over it
against 3.5 s spinning; spinning through it, the server at 16 clients made 1.00x the offline
engine's speed (docs/serving.md, "Spinning through prefill"). With `--spin off` a
server loads its models on the main thread and runs the loop on an `EngineThread` of its own: two
teams, always throttled.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

#: `--spin` choices: off (two teams, throttled), on (one team, spinning), auto (one team, spinning
#: while the batch holds at least SPIN_ROWS rows).
SPIN_MODES = ("off", "on", "auto")
SPIN_ROWS = 12


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


class Spin:
    """Whether the engine thread's OpenMP workers spin, under `--spin auto`: a `Ballast` is held
    while the batch has fewer than `rows` rows. `follow(rows)` after each iteration; `close` at the
    end. (Under on and off the server does not make one.)"""

    def __init__(self, rows: int = SPIN_ROWS):
        self.rows = rows
        self.ballast: Ballast | None = Ballast()  # an idle server does not spin
        self.switches = 0  # times the ballast was taken or let go

    @property
    def spinning(self) -> bool:
        return self.ballast is None

    def follow(self, rows: int, prefill: bool = False) -> None:
        """Spin from here on iff `rows` (the batch's rows now) reaches the threshold, or the next
        iteration runs a `prefill` forward (its products have a row per prompt token)."""
        if (rows >= self.rows or prefill) == self.spinning:
            return
        if self.ballast is not None:
            self.ballast.release()
            self.ballast = None
        else:
            self.ballast = Ballast()
        self.switches += 1

    def close(self) -> None:
        if self.ballast is not None:
            self.ballast.release()
            self.ballast = None
