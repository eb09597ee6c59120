"""How long one small product takes under each OpenMP wait setting, alone and beside a process that
wants part of a core (a load client or a proxy on the server's machine).

PyTorch's CPU build runs its products on libgomp's worker threads. Between two parallel regions an
idle worker spins `GOMP_SPINCOUNT` times (300,000 by default), then sleeps; while the teams'
threads outnumber the cores libgomp spins only 100 times (a server whose main thread has a team of
its own besides the engine thread's: "two teams"). A sleeping worker costs a wake-up per product;
a spinning one holds its core while its partner may be waiting for one. This measures the middle
ground: one team with a bounded spin.

Each setting runs in a fresh process (libgomp reads its environment once, when it loads):
`--iters` products [m x 576] x [576 x 1536] (a decoder layer's projection), each followed by
`--gap-us` of serial work on the calling thread (the small operations between two products).
The competitor is another process that is busy `share` of every 10 ms.

    python experiments/omp_spin.py --json docs/bench/omp_spin.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import sys, threading, time, torch
mode, m, iters, gap = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]) * 1e-6
x, w = torch.randn(m, 576), torch.randn(1536, 576)

def run():
    for i in range(iters // 5 + 20):  # warm-up
        torch.nn.functional.linear(x, w)
    start = time.perf_counter()
    for i in range(iters):
        torch.nn.functional.linear(x, w)
        end = time.perf_counter() + gap
        while time.perf_counter() < end:
            pass
    return (time.perf_counter() - start) / iters

if mode == "two-teams":  # the main thread's team exists, parked, as when a server loads its models there
    torch.nn.functional.linear(x, w)
    out = []
    t = threading.Thread(target=lambda: out.append(run()))
    t.start()
    t.join()
    print(out[0])
else:
    print(run())
"""

COMPETITOR = r"""
import sys, time
share = float(sys.argv[1])
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < 0.010 * share:
        pass
    time.sleep(0.010 * (1 - share))
"""


def settings(spins: list[int]) -> dict[str, tuple[str, dict]]:
    """Name -> (mode, environment changes)."""
    out = {"two teams (throttled)": ("two-teams", {}), "one team, default spin": ("one-team", {})}
    for s in spins:
        out[f"one team, GOMP_SPINCOUNT={s}"] = ("one-team", {"GOMP_SPINCOUNT": str(s)})
    return out


def measure(mode: str, env: dict, m: int, iters: int, gap_us: float, share: float) -> float:
    """Seconds per product (and its gap) in a fresh process, beside a competitor busy `share`."""
    competitor = None
    if share > 0:
        competitor = subprocess.Popen([sys.executable, "-c", COMPETITOR, str(share)])
        time.sleep(0.2)
    try:
        child_env = {k: v for k, v in os.environ.items() if not k.startswith(("GOMP_", "OMP_WAIT"))} | env
        out = subprocess.run(
            [sys.executable, "-c", CHILD, mode, str(m), str(iters), str(gap_us)],
            env=child_env,
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.strip().splitlines()[-1])
    finally:
        if competitor is not None:
            competitor.kill()
            competitor.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,16", help="m, the rows of each product")
    p.add_argument("--shares", default="0,0.25,0.7", help="the competitor's share of a core")
    p.add_argument("--spins", default="0,1000,3000,10000,30000", help="GOMP_SPINCOUNT values, one team")
    p.add_argument("--iters", type=int, default=1500)
    p.add_argument("--gap-us", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=2, help="each setting this many times, interleaved")
    p.add_argument("--json")
    args = p.parse_args()
    rows = [int(v) for v in args.rows.split(",")]
    shares = [float(v) for v in args.shares.split(",")]
    table = settings([int(v) for v in args.spins.split(",")])
    results = []
    for m in rows:
        for share in shares:
            for r in range(args.repeats):
                names = list(table) if r % 2 == 0 else list(reversed(table))
                for name in names:
                    mode, env = table[name]
                    us = 1e6 * measure(mode, env, m, args.iters, args.gap_us, share)
                    results.append({"setting": name, "rows": m, "share": share, "repeat": r, "us_per_product": us})
                    print(f"m={m:>2} competitor {share:.2f}  {name:34s} {us:8.1f} us", flush=True)
    print("\nmedian microseconds per product (and its gap), by competitor share")
    for m in rows:
        print(f"\nm = {m}: " + " | ".join(f"share {s}" for s in shares))
        for name in table:
            cells = []
            for s in shares:
                key = (name, m, s)
                v = sorted(x["us_per_product"] for x in results if (x["setting"], x["rows"], x["share"]) == key)
                cells.append(f"{v[len(v) // 2]:8.1f}")
            print(f"  {name:34s} " + " | ".join(cells))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "gap_us": args.gap_us, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
