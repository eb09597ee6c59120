"""The thread a server's engine loop runs on, and whether the CPU's OpenMP workers spin.

PyTorch's CPU build parallelises with OpenMP (libgomp), which keeps a team of worker threads for
every thread that has run a parallel region. While the teams' threads outnumber the cores, libgomp
throttles their spinning: an idle worker soon sleeps, and every small product pays a wake-up. With
one team on cores it has to itself the workers spin between products, which made the engine loop
15% faster in process; but when another process wants a core they wait on each other at every
barrier (one spinning, the other parked by the scheduler): beside the load generator on 2 cores
the server lost half its throughput at 1 to 8 clients (docs/serving.md, "One OpenMP team or two").

So by default a server loads its models on the main thread and runs the loop on an
`EngineThread` of its own: two teams, throttled. With `serve --spin` the engine thread also loads
the models and measures the machine (every torch call on one thread): one team, spinning.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


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
