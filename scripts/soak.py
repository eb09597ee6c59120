"""A bounded soak of `batchspec serve` on loopback: it starts the server, loads it for a few minutes
the way real clients do, then checks what must hold after a long run, and stops by itself.

Load (the official `openai` client, C closed-loop clients, token-id prompts of mixed lengths):
  - greedy requests, seeded sampled requests (temperature 0.8, top_p 0.95), streamed or not;
  - ~10% of streams dropped by the client after a chunk or two;
  - every --burst-every seconds, a burst of short requests past the queue bound (expects 429s).
Checks (each named in the report; the exit status is 1 if any fails):
  - greedy answers equal the target alone (`reference`, run in this process after the soak);
  - seeded answers equal the same request sent again, alone, once the soak is over;
  - no 5xx and no transport error (dropped streams aside); bursts are shed with 429 (so is any
    request that finds the queue full otherwise: counted, not an error);
  - once idle: 0 running rows, 0 queued requests, 0 KV slots in use (/metrics);
  - the server's RSS stays flat after warm-up (last minute vs the first minute after warm-up),
    but for what a new peak of KV bytes explains: the KV slabs grow and shrink as rows come and
    go, and the prefix cache fills up to its budget; the allocator keeps the pages of their peak.
    So RSS may grow by as much as /metrics' `batchspec_kv_bytes_peak` grew meanwhile (plus 5% or
    64 MiB); growth beyond that is memory no KV byte accounts for. The report samples the KV
    slots, the prefix cache's tokens and the KV bytes every 10 s.

Usage: python scripts/soak.py [--pair default|tiny] [--duration 240] [--clients 10] [--json OUT]
       (the whole run, checks included, stays under 10 minutes; tests/test_soak_script.py runs it briefly)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import openai

WARMUP_SHARE = 0.25  # the first quarter of the soak is warm-up for the memory check
RSS_SLACK = 0.05  # RSS may grow this much (or 64 MiB) after warm-up
MAX_DURATION = 420.0  # with the checks after it, a run stays under 10 minutes
SPEC_BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../shared/data/spec_bench/question.jsonl")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`batchspec serve` in a child process on a free loopback port."""

    def __init__(self, args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "batchspec.cli", "serve", "--pair", args.pair, "--dtype", "float32"]
        cmd += ["--batch-size", str(args.batch_size), "--max-queue", str(args.max_queue)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *args.serve_args]
        self.log = open(args.log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                sys.exit(f"soak: the server did not start; see {args.log}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return urllib.request.urlopen(self.url + "/health", timeout=2).status == 200
        except OSError:
            return False

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=5).read().decode()
        return {m[1]: float(m[2]) for m in re.finditer(r"^(batchspec_\w+) ([0-9.e+-]+)$", text, re.M)}

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status", encoding="ascii") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kb / 1024

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def make_prompts(tokenizer, path: str | None, rng: random.Random, longest: int) -> list[list[int]]:
    """Token-id prompts from 8 to `longest` (at most 1,500) tokens: Spec-Bench questions where
    given, joined for long ones."""
    texts = ["Why is the sky blue?", "Write a haiku about the sea.", "List three prime numbers and explain why."]
    if path and os.path.exists(path):
        texts = [json.loads(line)["turns"][0] for line in open(path, encoding="utf-8") if line.strip()][::7]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][: min(400, longest)] for t in texts]
    ids = [p for p in ids if len(p) >= 8]
    longs = [sum(rng.sample(ids, min(len(ids), 8)), [])[: min(1500, longest)] for _ in range(4)]
    return ids + longs


class Soak:
    def __init__(self, server: Server, prompts: list[list[int]], args):
        self.server, self.prompts, self.args = server, prompts, args
        self.client = openai.OpenAI(base_url=server.url + "/v1", api_key="soak", max_retries=0, timeout=600)
        self.lock = threading.Lock()
        self.done: list[dict] = []  # completed requests: kind, prompt, params, token_ids, finish
        self.counts = {"ok": 0, "dropped": 0, "shed": 0, "shed_outside_burst": 0, "5xx": 0, "errors": 0}
        self.error_samples: list[str] = []
        self.bursting = threading.Event()
        self.rss: list[tuple[float, float]] = []
        self.held: list[tuple] = []  # (s, target KV slots allocated, prefix cache tokens, KV MB, peak KV MB)

    def count(self, key: str, sample: str | None = None) -> None:
        with self.lock:
            self.counts[key] += 1
            if sample and len(self.error_samples) < 10:
                self.error_samples.append(sample)

    def request(self, rng: random.Random, kind: str, prompt: list[int], max_tokens: int, stream: bool) -> None:
        params = {"max_tokens": max_tokens, "temperature": 0.0}
        if kind == "seeded":
            params = {"max_tokens": max_tokens, "temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**31)}
        try:
            ids, finish = self.complete(prompt, params, stream, drop=kind == "dropped")
        except openai.RateLimitError:
            self.count("shed" if self.bursting.is_set() else "shed_outside_burst")
            time.sleep(0.2)  # a client told to retry later does not retry at once
            return
        except openai.APIStatusError as err:
            self.count("5xx" if err.status_code >= 500 else "errors", f"{kind}: {err.status_code} {err.message}")
            return
        except (openai.APIConnectionError, openai.APITimeoutError) as err:
            self.count("errors", f"{kind}: {type(err).__name__}: {err}")
            return
        if kind == "dropped":
            self.count("dropped")
            return
        self.count("ok")
        with self.lock:
            self.done.append({"kind": kind, "prompt": prompt, "params": params, "ids": ids, "finish": finish})

    def complete(self, prompt, params, stream: bool, drop: bool = False) -> tuple[list[int], str | None]:
        """Token ids and finish reason of one completion (a dropped stream closes after 1-2 chunks)."""
        if not stream and not drop:
            out = self.client.completions.create(model=self.args.pair, prompt=prompt, **params)
            return out.model_extra["batchspec"]["token_ids"], out.choices[0].finish_reason
        ids, finish = [], None
        chunks = self.client.completions.create(model=self.args.pair, prompt=prompt, stream=True, **params)
        for n, chunk in enumerate(chunks):
            ids += (chunk.model_extra.get("batchspec") or {}).get("token_ids", [])
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if drop and n >= 1:
                chunks.response.close()
                break
        return ids, finish

    def client_loop(self, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.monotonic() < deadline:
            roll = rng.random()
            kind = "dropped" if roll < 0.1 else "seeded" if roll < 0.4 else "greedy"
            self.request(rng, kind, rng.choice(self.prompts), rng.randint(8, 64), stream=rng.random() < 0.7)

    def burst_loop(self, deadline: float) -> None:
        """Bursts of short requests past the queue bound, every --burst-every seconds."""
        rng = random.Random(1)
        size = self.args.max_queue + self.args.batch_size + 8
        while time.monotonic() + self.args.burst_every < deadline:
            time.sleep(self.args.burst_every)
            self.bursting.set()
            threads = [
                threading.Thread(target=self.request, args=(rng, "greedy", rng.choice(self.prompts[:20]), 4, False))
                for _ in range(size)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.bursting.clear()

    def watch(self, deadline: float) -> None:
        start, tick = time.monotonic(), 0
        while time.monotonic() < deadline:
            self.rss.append((time.monotonic() - start, self.server.rss_mb()))
            if tick % 10 == 0:  # the KV slabs and the prefix cache grow RSS up to their budgets
                m = self.server.metrics()
                kv = (m.get("batchspec_kv_slots_allocated"), m.get("batchspec_prefix_cache_held_tokens"))
                mb = (m.get("batchspec_kv_bytes", 0) / 2**20, m.get("batchspec_kv_bytes_peak", 0) / 2**20)
                self.held.append((time.monotonic() - start, *kv, *mb))
            tick += 1
            time.sleep(1.0)

    def run(self, duration: float) -> None:
        deadline = time.monotonic() + duration
        threads = [threading.Thread(target=self.client_loop, args=(i, deadline)) for i in range(self.args.clients)]
        threads += [threading.Thread(target=self.burst_loop, args=(deadline,))]
        threads += [threading.Thread(target=self.watch, args=(deadline,), daemon=True)]
        for t in threads:
            t.start()
        for t in threads[:-1]:
            t.join()


def check_idle(server: Server, timeout: float = 30.0) -> dict:
    """Running rows, queue and KV slots in use, once they reach 0 (or after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        gauges = {k: m.get(f"batchspec_{k}") for k in ("running_rows", "queue_length", "kv_slots_used")}
        if not any(gauges.values()) or time.monotonic() > deadline:
            return {"ok": not any(gauges.values()), **gauges}
        time.sleep(0.5)


def check_rss(rss: list[tuple[float, float]], held: list[tuple], duration: float) -> dict:
    """RSS at the end (last minute's median) against just after warm-up (the first minute's), less
    the growth of the KV bytes' peak from the end of warm-up to the end."""
    after = [mb for t, mb in rss if t >= WARMUP_SHARE * duration]
    if len(after) < 20 or not held:
        return {"ok": False, "why": "too few samples"}
    window = min(60, len(after) // 3)
    first, last = statistics.median(after[:window]), statistics.median(after[-window:])
    warm = [h[-1] for h in held if h[0] <= WARMUP_SHARE * duration + window] or [0.0]
    kv_growth = held[-1][-1] - warm[-1]
    allowed = first * RSS_SLACK + 64 + kv_growth
    return {
        "ok": last - first <= allowed,
        "after_warmup_mb": round(first),
        "end_mb": round(last),
        "kv_peak_growth_mb": round(kv_growth),
        "allowed_growth_mb": round(allowed),
    }


def check_seeded(soak: Soak, limit: int) -> dict:
    """Seeded answers again, each alone: the same tokens."""
    seeded = [d for d in soak.done if d["kind"] == "seeded"][:limit]
    bad = [d for d in seeded if soak.complete(d["prompt"], d["params"], stream=False)[0] != d["ids"]]
    return {"ok": bool(seeded) and not bad, "checked": len(seeded), "mismatches": len(bad)}


def check_greedy(pair_name: str, done: list[dict], limit: int) -> dict:
    """Greedy answers against the target alone, in this process (the server has stopped)."""
    from batchspec import SamplingParams, SpecDecoder, load_pair

    greedy = [d for d in done if d["kind"] == "greedy" and d["params"]["max_tokens"] > 4][:limit]
    reference = SpecDecoder(load_pair(pair_name, dtype="float32"), method="reference")
    bad = 0
    for d in greedy:
        want = reference.generate([d["prompt"]], SamplingParams(max_new_tokens=d["params"]["max_tokens"]))[0]
        bad += want.token_ids != d["ids"]
    return {"ok": bool(greedy) and not bad, "checked": len(greedy), "mismatches": bad}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", default="default", choices=["default", "tiny"])
    p.add_argument("--duration", type=float, default=240.0, help=f"seconds of load (at most {MAX_DURATION:.0f})")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-queue", type=int, default=16)
    p.add_argument(
        "--prompts", default=os.path.join(os.path.dirname(__file__), "../../shared/data/spec_bench/question.jsonl")
    )
    p.add_argument("--burst-every", type=float, default=30.0, help="seconds between bursts")
    p.add_argument("--check", type=int, default=24, help="greedy and seeded answers checked, each")
    p.add_argument("--log", default="soak-server.log")
    p.add_argument("--json", metavar="OUT")
    p.add_argument("serve_args", nargs="*", help="more `batchspec serve` options (after --)")
    args = p.parse_args(argv)
    if not 10 <= args.duration <= MAX_DURATION:
        p.error(f"--duration must be in [10, {MAX_DURATION:.0f}] seconds")
    from batchspec import load_pair

    pair = load_pair(args.pair, dtype="float32")
    prompts = make_prompts(pair.tokenizer, args.prompts, random.Random(0), pair.context_len - 65)
    del pair
    server = Server(args)
    try:
        soak = Soak(server, prompts, args)
        started = time.monotonic()
        soak.run(args.duration)
        checks = {"idle": check_idle(server), "rss": check_rss(soak.rss, soak.held, args.duration)}
        checks["seeded"] = check_seeded(soak, args.check)
        checks["idle_again"] = check_idle(server)
        metrics = server.metrics()
    finally:
        server.stop()
    checks["greedy"] = check_greedy(args.pair, soak.done, args.check)
    c = soak.counts
    checks["no_5xx"] = {"ok": c["5xx"] == 0 and c["errors"] == 0, "5xx": c["5xx"], "errors": c["errors"]}
    checks["shedding"] = {"ok": c["shed"] > 0, "shed_in_bursts": c["shed"], "shed_otherwise": c["shed_outside_burst"]}
    report = {
        "pair": args.pair,
        "duration_s": args.duration,
        "wall_s": round(time.monotonic() - started, 1),
        "clients": args.clients,
        "batch_size": args.batch_size,
        "max_queue": args.max_queue,
        "requests": c,
        "generated_tokens": metrics.get("batchspec_generation_tokens_total"),
        "rss_mb": [round(mb) for _, mb in soak.rss[:: max(1, len(soak.rss) // 20)]],
        "kv_slots_allocated": [h[1] for h in soak.held],
        "prefix_cache_held_tokens": [h[2] for h in soak.held],
        "kv_mb": [round(h[3]) for h in soak.held],
        "kv_peak_mb": [round(h[4]) for h in soak.held],
        "checks": checks,
        "error_samples": soak.error_samples,
        "ok": all(v["ok"] for v in checks.values()),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
