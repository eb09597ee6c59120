"""Chat logprobs from `batchspec serve` speculating (its defaults) and with `--no-spec`: are they the
same, bit for bit?

The official `openai` client sends C concurrent greedy chats (Spec-Bench first turns, every
--every-th) with `logprobs=True, top_logprobs=2` to one server, then to the other (one at a time,
the same float32 weights), and compares every token, logprob and alternative. Under
`--batch-invariant` (the default here) they are identical; with `--no-mode` they differ by ~1e-5
(a forward over k + 1 tokens or many rows rounds differently from a one-token one).

Usage: python experiments/served_logprobs.py [--pair default] [--prompts 8] [--every 60]
       [--max-tokens 48] [--no-mode] [--json OUT]

Feeds: docs/serving.md, "Logprobs".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from soak import SPEC_BENCH, Server  # noqa: E402


def questions(n: int, every: int) -> list[str]:
    with open(SPEC_BENCH, encoding="utf-8") as f:
        return [json.loads(line)["turns"][0] for line in f][::every][:n]


async def ask_all(url: str, model: str, prompts: list[str], max_tokens: int) -> list[list]:
    """Every prompt at once -> per prompt, [(token, logprob, [(alt, logprob), ...]), ...]."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", timeout=900, max_retries=0)

    async def one(text):
        out = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )
        content = out.choices[0].logprobs.content
        return [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in content]

    return await asyncio.gather(*(one(p) for p in prompts))


def serve_and_ask(args, extra: list[str], prompts: list[str]) -> tuple[list, float]:
    mode = [] if args.no_mode else ["--batch-invariant"]
    server_args = argparse.Namespace(
        pair=args.pair,
        batch_size=len(prompts),
        max_queue=len(prompts),
        log=args.log,
        serve_args=mode + extra,
    )
    server = Server(server_args)
    try:
        start = time.perf_counter()
        answers = asyncio.run(ask_all(server.url, args.pair, prompts, args.max_tokens))
        return answers, time.perf_counter() - start
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pair", default="default")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--every", type=int, default=60)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--no-mode", action="store_true", help="without --batch-invariant")
    p.add_argument("--log", default="served_logprobs.log", help="the servers' output")
    p.add_argument("--json", help="write the summary here")
    args = p.parse_args(argv)
    prompts = questions(args.prompts, args.every)
    spec, spec_s = serve_and_ask(args, [], prompts)
    plain, plain_s = serve_and_ask(args, ["--no-spec"], prompts)
    pairs = [(a, b) for x, y in zip(spec, plain) for a, b in zip(x, y)]
    summary = {
        "batch_invariant": not args.no_mode,
        "prompts": len(prompts),
        "tokens": sum(map(len, spec)),
        "same_tokens": [[e[0] for e in x] for x in spec] == [[e[0] for e in y] for y in plain],
        "identical": spec == plain,
        "bit_equal_logprobs": sum(a[1] == b[1] for a, b in pairs),
        "max_abs_logprob_diff": max((abs(a[1] - b[1]) for a, b in pairs), default=0.0),
        "greedy_token_leads_its_top": all(e[2][0] == (e[0], e[1]) for x in spec for e in x),
        "seconds": {"defaults": round(spec_s, 1), "no_spec": round(plain_s, 1)},
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0 if summary["identical"] or args.no_mode else 1


if __name__ == "__main__":
    sys.exit(main())
