"""Multi-turn chats against `batchspec serve`, with and without the prefix cache: time to first
token by turn, and whether the answers are the same.

Each chat is a Spec-Bench question's two turns, then follow-ups ("Summarize ...", ...), up to
--turns; every turn resends the whole history (system prompt, questions, answers), as chat
clients do. C clients (the official `openai` client, streaming, greedy) each run whole chats from a
shared list. The server is started twice on a free loopback port, `--no-prefix-cache` first, then
with the cache at its default, one at a time.

Usage: python experiments/multiturn.py [--pair default] [--chats 8] [--clients 4] [--turns 4]
       [--max-tokens 64] [--json OUT]
Prints a table of TTFT p50 by turn for both servers and their ratio; --json writes everything.

Feeds: docs/serving.md, "Prefix caching".
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import threading
import time

import openai

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
from soak import SPEC_BENCH, Server  # noqa: E402

SYSTEM = "You are a helpful assistant. Answer clearly and concisely."
FOLLOW_UPS = [
    "Summarize your answers so far in three sentences.",
    "What is the most important point, and why?",
    "Give one example that illustrates it.",
]


def chats(n: int, every: int = 10) -> list[list[str]]:
    """n chats' user turns: Spec-Bench questions (every `every`-th with two turns), then follow-ups."""
    out = []
    with open(SPEC_BENCH, encoding="utf-8") as f:
        for i, line in enumerate(f):
            turns = json.loads(line)["turns"]
            if i % every == 0 and len(turns) == 2:
                out.append(turns + FOLLOW_UPS)
            if len(out) == n:
                break
    return out


def run_chat(client, model: str, turns: list[str], max_tokens: int) -> list[dict]:
    """One chat, turn by turn: TTFT, total time, prompt tokens and the answer of each turn."""
    messages, out = [{"role": "system", "content": SYSTEM}], []
    for question in turns:
        messages.append({"role": "user", "content": question})
        start, first, text, usage = time.perf_counter(), None, "", None
        stream = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.perf_counter()
                text += chunk.choices[0].delta.content
            usage = chunk.usage or usage
        end = time.perf_counter()
        out.append(
            {
                "ttft_s": (first or end) - start,
                "seconds": end - start,
                "prompt_tokens": usage.prompt_tokens,
                "text": text,
            }
        )
        messages.append({"role": "assistant", "content": text})
    return out


def drive(server: Server, model: str, all_turns: list[list[str]], clients: int, max_tokens: int) -> list:
    """All chats over `clients` threads; results in chat order."""
    work: queue.Queue = queue.Queue()
    for i, turns in enumerate(all_turns):
        work.put((i, turns))
    results: list = [None] * len(all_turns)

    def client_loop():
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            try:
                i, turns = work.get_nowait()
            except queue.Empty:
                return
            results[i] = run_chat(client, model, turns, max_tokens)

    threads = [threading.Thread(target=client_loop) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def by_turn(results: list, key: str) -> list[float]:
    turns = len(results[0])
    return [statistics.median(chat[t][key] for chat in results) for t in range(turns)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="default")
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--json", help="write the measurements here")
    parser.add_argument("--log", default="/tmp/batchspec-multiturn.log", help="the servers' output")
    args = parser.parse_args()
    if not 1 <= args.turns <= 2 + len(FOLLOW_UPS):
        parser.error(f"--turns must be in [1, {2 + len(FOLLOW_UPS)}]")
    all_turns = [turns[: args.turns] for turns in chats(args.chats)]
    runs = {}
    for name, extra in (("no prefix cache", ["--no-prefix-cache"]), ("prefix cache", [])):
        options = argparse.Namespace(
            pair=args.pair, batch_size=args.batch_size, max_queue=256, log=args.log, serve_args=extra
        )
        server = Server(options)
        try:
            model = openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data[0].id
            start = time.perf_counter()
            results = drive(server, model, all_turns, args.clients, args.max_tokens)
            runs[name] = {"wall_s": time.perf_counter() - start, "results": results, "metrics": server.metrics()}
        finally:
            server.stop()
    plain, cached = runs["no prefix cache"]["results"], runs["prefix cache"]["results"]
    same = [[a["text"] == b["text"] for a, b in zip(p, c)] for p, c in zip(plain, cached)]
    summary = {
        "turn": list(range(1, args.turns + 1)),
        "prompt_tokens_p50": by_turn(plain, "prompt_tokens"),
        "ttft_p50_s": {name: by_turn(run["results"], "ttft_s") for name, run in runs.items()},
        "same_answers": sum(map(sum, same)),
        "answers": sum(map(len, same)),
        "wall_s": {name: run["wall_s"] for name, run in runs.items()},
        "hit_tokens": runs["prefix cache"]["metrics"].get("batchspec_prefix_cache_reused_tokens_total"),
    }
    ratio = [c / p for c, p in zip(summary["ttft_p50_s"]["prefix cache"], summary["ttft_p50_s"]["no prefix cache"])]
    summary["ttft_ratio"] = ratio
    print("| turn | prompt tokens (p50) | TTFT p50, no prefix cache | TTFT p50, prefix cache | ratio |")
    print("|---|---|---|---|---|")
    for t in range(args.turns):
        print(
            f"| {t + 1} | {summary['prompt_tokens_p50'][t]:.0f} | "
            f"{summary['ttft_p50_s']['no prefix cache'][t]:.2f} s | {summary['ttft_p50_s']['prefix cache'][t]:.2f} s | "
            f"{ratio[t]:.2f}x |"
        )
    print(f"answers identical: {summary['same_answers']} / {summary['answers']}; wall {summary['wall_s']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "summary": summary, "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
