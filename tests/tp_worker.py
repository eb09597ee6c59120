"""Run by test_tp.py under torch.distributed.run: every correct method on the tiny pair (float32)
with the target sharded over the ranks. Each rank writes its tokens to OUT/rank<r>.json.

usage: python -m torch.distributed.run --nproc-per-node N tests/tp_worker.py OUT PROMPTS.json
"""

from __future__ import annotations

import json
import os
import sys

from batchspec import SamplingParams, SpecDecoder
from batchspec.core import methods
from batchspec.distributed import tp
from batchspec.models.pair import load_pair

RUNS = {
    "greedy": SamplingParams(max_new_tokens=16),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16),
    "unseeded": SamplingParams(temperature=0.8, max_new_tokens=16),  # ranks agree; no single-process twin
}


def decode_all(pair, prompts: list[list[int]]) -> dict[str, list[list[int]]]:
    """{"method/run": token ids per prompt} for every correct method and every run; speculative
    methods also with `-k auto` ("method@auto/run"), whose timed choices the ranks must agree on."""
    out = {}
    for method in methods.names(include_broken=False):
        for k in (3, "auto") if methods.get(method).speculative else (3,):
            name = method if k == 3 else f"{method}@{k}"
            for run, params in RUNS.items():
                dec = SpecDecoder(pair, method=method, k=k, batch_size=4)
                out[f"{name}/{run}"] = [o.token_ids for o in dec.generate(prompts, params)]
    return out


if __name__ == "__main__":
    folder, prompts_file = sys.argv[1:3]
    tp.init("cpu")
    pair = load_pair("tiny", dtype="float32", tp_size=int(os.environ["WORLD_SIZE"]))
    with open(prompts_file) as f:
        result = decode_all(pair, json.load(f))
    with open(os.path.join(folder, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(result, f)
    tp.finish()
