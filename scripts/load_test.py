"""Closed-loop load generator for `batchspec serve` (loopback only).

C concurrent clients each send a Spec-Bench prompt (chat completions, streamed, greedy), wait for
the whole answer, then send the next, until N requests are done or the time limit is reached.
Reports throughput (generated tokens/s over the run's wall time), TTFT (time to the first token)
and ITL (time between successive streamed chunks; a speculative step's tokens arrive in one chunk)
and TPOT ((latency - TTFT) / (tokens - 1)), p50 and p99, as JSON.

    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 4 --requests 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from urllib.parse import urlparse

import httpx

from batchspec.tools.prompts import read_prompts

DEFAULT_PROMPTS = "/work/shared/data/spec_bench/question.jsonl"


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """Stream one chat completion; returns its timings and token count."""
    body = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            return {"error": response.status_code}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            n = len((chunk.get("batchspec") or {}).get("token_ids", []))
            if chunk.get("choices") and n:
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    if not arrivals:
        return {"error": "no tokens"}
    ttft = arrivals[0] - start
    return {
        "ttft": ttft,
        "itl": [b - a for a, b in itertools.pairwise(arrivals)],
        "tokens": tokens,
        "tpot": (end - start - ttft) / (tokens - 1) if tokens > 1 else None,
        "latency": end - start,
    }


async def run(url: str, prompts: list[str], concurrency: int, max_tokens: int, time_limit: float) -> dict:
    """C closed-loop clients over the prompt list; stops taking new requests at the time limit."""
    todo = list(reversed(prompts))
    results: list[dict] = []
    deadline = time.perf_counter() + time_limit

    async def client_loop(client):
        while todo and time.perf_counter() < deadline:
            results.append(await one_request(client, url, todo.pop(), max_tokens))

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(time_limit + 60)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))
    return summarize(results, time.perf_counter() - start, concurrency, max_tokens)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


def summarize(results: list[dict], wall: float, concurrency: int, max_tokens: int) -> dict:
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    ms = lambda v: None if v is None else round(1000 * v, 1)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "max_tokens": max_tokens,
        "wall_s": round(wall, 2),
        "generated_tokens": tokens,
        "throughput_tok_s": round(tokens / wall, 2) if wall else None,
        "ttft_ms": {"p50": ms(_pct(ttft, 50)), "p99": ms(_pct(ttft, 99))},
        "itl_ms": {"p50": ms(_pct(itl, 50)), "p99": ms(_pct(itl, 99))},
        "tpot_ms": {
            "p50": ms(_pct(tpot, 50)),
            "p99": ms(_pct(tpot, 99)),
            "mean": ms(statistics.mean(tpot)) if tpot else None,
        },
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--requests", type=int, default=16, help="requests in all (bounded)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts", default=DEFAULT_PROMPTS, help="Spec-Bench question.jsonl")
    p.add_argument("--every", type=int, default=5, help="take every N-th prompt (spreads the categories)")
    p.add_argument("--time-limit", type=float, default=600, help="send no new request after this many seconds")
    p.add_argument("--json", metavar="OUT", help="also write the result here")
    args = p.parse_args(argv)
    if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        print("load_test: error: only loopback servers (127.0.0.1, localhost)", file=sys.stderr)
        return 2
    prompts = [q.text for q in read_prompts(args.prompts, args.requests, args.every)]
    report = asyncio.run(run(args.url.rstrip("/"), prompts, args.concurrency, args.max_tokens, args.time_limit))
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
