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
  seconds; Serve then replaces the replica.
- `num_cpus` per replica = --replica-cpus (fractions allowed); torch's threads set to match (Ray
  sets OMP_NUM_THREADS from it; torch must agree).

Streaming and cancellation are the app's own: when a client goes away, the proxy cancels the
replica's handler, and the handler frees the request's row. Every response carries the replica's
name in an `x-batchspec-replica` header (and /health its process id).

A Serve config file can deploy the same application (`serve deploy config.yaml`); its builder is
`batchspec.replicas:app` with `args: {argv: "<batchspec serve options>"}` (docs/scale-out.md).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import signal
import sys
import threading
import time

import torch
from ray import serve

from .server import STALL_S, build_service, create_app

APP_NAME = "batchspec"


@serve.deployment(name="batchspec")
@serve.ingress()
class Replica:
    """One replica: a Service (models, engine) and its HTTP app, named after Serve's replica id."""

    def __init__(self, options: dict):
        args = argparse.Namespace(**options)
        torch.set_num_threads(threads(args.replica_cpus))
        self.name = serve.get_replica_context().replica_tag
        self.service = build_service(args)

    def __serve_build_asgi_app__(self):
        return create_app(self.service, replica=self.name)

    def check_health(self) -> None:
        fault = self.service.engine.fault(STALL_S)
        if fault is not None:
            raise RuntimeError(fault)


def threads(cpus: float) -> int:
    """torch threads for a replica granted `cpus` CPUs (at least one)."""
    return max(1, math.floor(cpus))


def deployment(args: argparse.Namespace):
    """The bound Serve application for `batchspec serve` options."""
    options = {k: v for k, v in vars(args).items() if not callable(v)}
    return Replica.options(
        num_replicas=args.replicas,
        max_ongoing_requests=args.batch_size,
        max_queued_requests=args.max_queue,
        ray_actor_options={"num_cpus": args.replica_cpus},
        graceful_shutdown_timeout_s=args.graceful_timeout,
    ).bind(options)


def app(builder_args: dict):
    """Application builder for Serve config files: `args: {argv: "--pair tiny --replicas 2"}`."""
    from .cli import build_parser, check_serve_options

    args = build_parser().parse_args(["serve", *shlex.split(str(builder_args.get("argv", "")))])
    check_serve_options(args)
    return deployment(args)


def run_cli(args: argparse.Namespace) -> int:
    """Start (or join, with --ray-address) Ray, deploy the replicas, serve until SIGTERM/SIGINT."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage reports from a local instance
    ray.init(address=args.ray_address, include_dashboard=False, logging_level="warning")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(deployment(args), name=APP_NAME, route_prefix="/")
        print(
            f"batchspec: serving on http://{args.host}:{args.port} with {args.replicas} replicas "
            f"(Ray Serve; {args.batch_size} rows and num_cpus {args.replica_cpus:g} each)",
            file=sys.stderr,
            flush=True,
        )
        started = time.monotonic()
        stop.wait()
        print(f"batchspec: stopping after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        if args.ray_address is None:
            serve.shutdown()  # and the local Ray instance with it
        else:
            serve.delete(APP_NAME)  # a shared cluster keeps running
        ray.shutdown()
    return 0
