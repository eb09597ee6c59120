"""How long `serve --replicas 2` takes to replace a replica whose process dies.

Starts `batchspec serve --replicas 2 --replica-cpus 1` (Ray Serve) on a free loopback port, waits
until both replicas have answered `/health`, then --kills times: SIGKILL one replica's process
and poll `/health` every 0.1 s until a replica that was not there before answers. Reports, per
kill, the seconds from the kill to that first answer. Extra options after `--` go to `serve`.

Usage: python experiments/replica_restart.py [--pair default] [--kills 3] [--json OUT] [-- OPTIONS]

Feeds: README.md, "Start-up".
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from soak import free_port  # noqa: E402


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read()) if r.status == 200 else None
    except OSError:
        return None


def wait_for(url: str, known: set[str], want: int, deadline_s: float) -> dict[str, int]:
    """Poll /health until `want` replicas not in `known` have answered -> {replica: pid}."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + deadline_s
    while len(seen) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(seen)} of {want} new replicas answered in {deadline_s:.0f} s")
        body = health(url)
        if body and body.get("replica") and body["replica"] not in known:
            seen[body["replica"]] = body["pid"]
        time.sleep(0.1)
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="default")
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--json", help="write the timings here")
    p.add_argument("serve_args", nargs="*", help="more `serve` options (after --)")
    args = p.parse_args(argv)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "batchspec.cli", "serve", "--pair", args.pair, "--dtype", "float32"]
    cmd += ["--replicas", "2", "--replica-cpus", "1", "--host", "127.0.0.1", "--port", str(port), *args.serve_args]
    log = tempfile.NamedTemporaryFile("w+", prefix="replica-restart-", suffix=".log", delete=False)
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        alive = wait_for(url, set(), 2, 600)
        ready = time.monotonic() - start
        print(f"both replicas up after {ready:.1f} s: {sorted(alive)}", flush=True)
        known, restarts = set(alive), []
        for _ in range(args.kills):
            victim = next(iter(alive))
            killed = time.monotonic()
            os.kill(alive.pop(victim), signal.SIGKILL)
            new = wait_for(url, known, 1, 300)
            restarts.append(round(time.monotonic() - killed, 2))
            print(f"killed {victim}: a new replica answered after {restarts[-1]:.2f} s", flush=True)
            known |= set(new)
            alive |= new
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
    summary = {"serve_args": args.serve_args, "ready_s": round(ready, 2), "restart_s": restarts, "log": log.name}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
