"""`batchspec serve --replicas N`: the server app (server.py) as N replicas behind Ray Serve.

Ray Serve (the `ray` extra) runs each replica as an actor that holds its own models and engine
(`server.build_service`) and hosts the same FastAPI app (`server.create_app`, through
`@serve.ingress`). Serve's proxy routes requests (power of two choices), health-checks replicas,
restarts dead ones and sheds load; batchspec adds no router of its own. What it sets:

- `max_ongoing_requests` = the engine's rows (--batch-size): Serve's default (5) would starve a
  batch of 8, and more would queue inside one replica, where the router can no longer send them
  to a replica with a free row. Waiting requests wait in Serve's queue instead.
- `max_queued_requests` = --max-queue: beyond it Serve answers 503 at once.
- `check_health` fails when the engine thread is dead or has not iterated for `server.STALL_S`
  seconds; Serve then replaces the replica. Serve calls it every `HEALTH_CHECK_S` (its default,
  10 s, is also how long a replica whose process died can go unnoticed: Serve learns of the death
  from the pending check); the check reads two fields, so calling it every second costs nothing.
- `num_cpus` per replica = --replica-cpus (fractions allowed); torch's threads set to match (Ray
  sets OMP_NUM_THREADS from it; torch must agree).

Streaming and cancellation are the app's own: when a client goes away, the proxy cancels the
replica's handler, and the handler frees the request's row. Every response carries the replica's
name in an `x-batchspec-replica` header (and /health its process id).

A Serve config file can deploy the same application (`serve deploy config.yaml`); its builder is
`batchspec.replicas:app` (replicas.py at the package's root, which parses them as the command
line does) with `args: {argv: "<batchspec serve options>"}` (docs/scale-out.md).
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time

import torch
from ray import serve

from .config import ServeConfig
from .server import STALL_S, build_service, create_app

APP_NAME = "batchspec"
#: Seconds between Serve's health checks of a replica (the most a dead replica goes unnoticed).
HEALTH_CHECK_S = 1.0


@serve.deployment(name="batchspec")
@serve.ingress()
class Replica:
    """One replica: a Service (models, engine) and its HTTP app, named after Serve's replica id."""

    def __init__(self, config: ServeConfig):
        torch.set_num_threads(threads(config.replica_cpus))
        self.name = serve.get_replica_context().replica_tag
        self.service = build_service(config)

    def __serve_build_asgi_app__(self):
        return create_app(self.service, replica=self.name)

    def check_health(self) -> None:
        fault = self.service.engine.fault(STALL_S)
        if fault is not None:
            raise RuntimeError(fault)


def threads(cpus: float) -> int:
    """torch threads for a replica granted `cpus` CPUs (at least one)."""
    return max(1, math.floor(cpus))


def deployment(config: ServeConfig):
    """The bound Serve application of a `ServeConfig`."""
    return Replica.options(
        num_replicas=config.replicas,
        max_ongoing_requests=config.engine.batch_size,
        max_queued_requests=config.max_queue,
        ray_actor_options={"num_cpus": config.replica_cpus},
        graceful_shutdown_timeout_s=config.graceful_timeout,
        health_check_period_s=HEALTH_CHECK_S,
    ).bind(config)


def run_cli(config: ServeConfig) -> int:
    """Start (or join, with --ray-address) Ray, deploy the replicas, serve until SIGTERM/SIGINT."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a local instance
    ray.init(address=config.ray_address, include_dashboard=False, logging_level="warning")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(deployment(config), name=APP_NAME, route_prefix="/")
        print(
            f"batchspec: serving on http://{config.host}:{config.port} with {config.replicas} replicas "
            f"(Ray Serve; {config.engine.batch_size} rows and num_cpus {config.replica_cpus:g} each)",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        stop.wait()
        print(f"batchspec: stopping after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        if config.ray_address is None:
            serve.shutdown()  # and the local Ray instance with it
        else:
            serve.delete(APP_NAME)  # a shared cluster keeps running
        ray.shutdown()
    return 0
