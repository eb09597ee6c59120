"""The default pair (or --target T, no draft) with its target compiled (models/compiled.py) beside
the same pair eager (or two other ways of running the target: --variants), in one process: `ar` and the defaults
(`ragged`, `-k auto`, the pair's proposer) at each batch size, on the same Spec-Bench prompts, the
two pairs alternating (which goes first alternates by round); tok/s per run, the median ratio of
the first variant to the second, and whether both gave the same tokens.

    python experiments/compiled_step.py PROMPTS.jsonl [--batch-sizes 1,8,16] [--n 16] [--every N]
        [--max-new-tokens 64] [--rounds 2] [--dtype float32] [--target T]
        [--variants compiled,eager|max-autotune,compiled] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchspec import SamplingParams, SpecDecoder, load_pair
from batchspec.tools.prompts import read_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompts")
    parser.add_argument("--batch-sizes", default="1,8,16")
    parser.add_argument("--methods", default="ar,ragged")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--every", type=int, help="every N-th prompt (default: 480 // n)")
    parser.add_argument("--target", help="a model directory or GGUF file, no draft (default: the default pair)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--variants", default="compiled,eager", help="two of compiled, eager, max-autotune")
    parser.add_argument("--json")
    args = parser.parse_args()
    flags = {"compiled": True, "eager": False, "max-autotune": "max-autotune"}
    first, second = args.variants.split(",")
    every = args.every or max(1, 480 // args.n)
    prompts = [p.text for p in read_prompts(args.prompts, limit=args.n, every=every)]
    source = {"target": args.target} if args.target else {"pair": "default"}
    pairs = {}
    for name, flag in ((first, flags[first]), (second, flags[second])):
        started = time.perf_counter()
        pairs[name] = load_pair(**source, dtype=args.dtype, compile=flag)
        print(name, "loaded in", round(time.perf_counter() - started, 1), "s", pairs[name].startup, flush=True)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    rows = []
    for b in (int(v) for v in args.batch_sizes.split(",")):
        for method in args.methods.split(","):
            decoders = {name: SpecDecoder(pair, method=method, batch_size=b) for name, pair in pairs.items()}
            for dec in decoders.values():
                dec.prepare()
            speed: dict[str, list[float]] = {name: [] for name in pairs}
            tokens: dict[str, list] = {}
            for r in range(args.rounds):
                order = list(decoders) if r % 2 == 0 else list(decoders)[::-1]
                for name in order:
                    outs = decoders[name].generate(prompts, params)
                    speed[name].append(decoders[name].stats.summary()["tokens_per_s"])
                    tokens.setdefault(name, [o.token_ids for o in outs])
            ratios = [x / y for x, y in zip(speed[first], speed[second])]
            row = {"batch_size": b, "method": method, "tok_s": speed}
            row["ratio_median"] = round(statistics.median(ratios), 3)
            row["same_tokens"] = sum(x == y for x, y in zip(tokens[first], tokens[second]))
            row["mean_tokens_per_step"] = decoders[first].stats.summary()["mean_tokens_per_step"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "args": vars(args)}
        info["startup"] = {name: pair.startup for name, pair in pairs.items()}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(info | {"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
