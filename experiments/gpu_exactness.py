"""Exactness on a CUDA device: every batched method against the target alone, on the tiny pairs.

The test suite runs on CPUs; this runs its core property on a GPU (random token prompts, every
method, draft / lookup-first / head / the target's own copy as drafters, batch sizes, k): each
row's tokens against the one-prompt greedy reference on the same device. float32 is expected
exact; in bfloat16 a batched forward rounds differently from a one-row one, so a row may diverge at
a near-tie (reported, not promised). Also checks that the options that need a CPU refuse clearly
there (`--batch-invariant`, `--draft-quant int8`).

    python experiments/gpu_exactness.py [--json out.json] [--budget-s 300]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time

import torch

from batchspec import BatchspecError, SamplingParams, SpecDecoder, load_pair


def prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randint(1, 60))] for _ in range(n)]


def refusals(device: str) -> dict:
    """What the CPU-only options say on this device."""
    out = {}
    pair = load_pair("tiny", device=device)
    try:
        SpecDecoder(pair, method="ragged", batch_invariant=True).generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))
        out["batch_invariant"] = "ran"
    except BatchspecError as err:
        out["batch_invariant"] = f"refused: {err}"
    try:
        load_pair("tiny", device=device, draft="self", draft_quant="int8")
        out["draft_quant_int8"] = "ran"
    except BatchspecError as err:
        out["draft_quant_int8"] = f"refused: {err}"
    try:  # does PyTorch's int8 weight-only kernel exist on this device at all?
        x = torch.randn(2, 64, dtype=torch.bfloat16, device=device)
        w = torch.randint(-127, 127, (32, 64), dtype=torch.int8, device=device)
        torch.ops.aten._weight_int8pack_mm(x, w, torch.ones(32, dtype=torch.bfloat16, device=device))
        out["int8pack_kernel"] = "available"
    except (RuntimeError, NotImplementedError) as err:
        out["int8pack_kernel"] = f"unavailable: {str(err).splitlines()[0][:160]}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    ap.add_argument("--budget-s", type=float, default=300.0, help="stop starting new cases after this")
    args = ap.parse_args()
    started = time.perf_counter()
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
        "torch": torch.__version__,
    }
    report["refusals"] = refusals(args.device)
    print(json.dumps(report["refusals"], indent=1), flush=True)
    cases = []
    params = SamplingParams(max_new_tokens=24)
    plan = [("float32", m, b, k) for m in ("eqspec", "exspec", "ragged") for b in (1, 8) for k in (3, "auto")]
    plan += [("bfloat16", "ragged", b, k) for b in (1, 8) for k in (3, "auto")]
    for (name, draft), (dtype, method, batch, k) in itertools.product(
        [("tiny", None), ("tiny-sliding", None), ("tiny", "self")], plan
    ):
        if time.perf_counter() - started > args.budget_s:
            break
        pair = load_pair(name, dtype=dtype, device=args.device, draft=draft)
        rows = prompts(len(cases), 16)
        reference = SpecDecoder(pair, method="reference")
        want = [reference.generate([p], params)[0].token_ids for p in rows]
        drafters = ["draft"] if draft else ["draft", "ngram+draft"] + (["eagle"] if pair.head is not None else [])
        for proposer in drafters:
            dec = SpecDecoder(pair, method=method, proposer=proposer, k=k, batch_size=batch)
            got = [o.token_ids for o in dec.generate(rows, params)]
            same = sum(g == w for g, w in zip(got, want))
            case = {
                "pair": name + (" + self" if draft else ""),
                "dtype": dtype,
                "method": method,
                "proposer": proposer,
                "batch": batch,
                "k": k,
                "rows": len(rows),
                "exact_rows": same,
                "tokens_per_step": round(dec.stats.summary()["mean_tokens_per_step"], 2),
            }
            cases.append(case)
            print(json.dumps(case), flush=True)
    report["cases"] = cases
    fp32 = [c for c in cases if c["dtype"] == "float32"]
    report["float32_exact"] = f"{sum(c['exact_rows'] for c in fp32)} of {sum(c['rows'] for c in fp32)} rows"
    bf16 = [c for c in cases if c["dtype"] == "bfloat16"]
    report["bfloat16_exact"] = f"{sum(c['exact_rows'] for c in bf16)} of {sum(c['rows'] for c in bf16)} rows"
    report["seconds"] = round(time.perf_counter() - started, 1)
    print(report["float32_exact"], "float32;", report["bfloat16_exact"], "bfloat16;", report["seconds"], "s")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
