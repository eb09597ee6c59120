"""How much a long prompt's arrival slows the rows already decoding in a `ragged` batch.

8 short Spec-Bench prompts decode; after a few steps the longest Spec-Bench prompt arrives. Each
engine iteration (admission work + one decode step) is timed. With chunked prefill the running
rows' iterations grow by at most one chunk's cost; without it (one chunk = the whole prompt) one
iteration pays the entire prefill. Both are run in the same process, on the same prompts.

    python experiments/admission_stall.py [--prompts ../shared/data/spec_bench/question.jsonl] [--dtype float32]
        [--pair default|tiny] [--json OUT.json]

Feeds: docs/serving.md, "Admission: how much prefill an iteration takes"; docs/benchmarks.md, "Size-class slabs".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from batchspec import EngineConfig, SamplingParams, SpecDecoder, load_pair
from batchspec.engine.admission import Admission
from batchspec.engine.step import Context, decode_step
from batchspec.layouts.ragged import RaggedBatch


def timeline(dec: SpecDecoder, short: list, long: list, chunk: int | None, arrive_at: int = 4) -> list[dict]:
    """Per-iteration seconds and what the iteration did, for 8 short rows and one late arrival."""
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    seqs = dec.make_sequences(short + [long], params, chat_template=False)
    ctx = Context(dec.pair.target, dec.proposer, dec.config.k_max, dec.pair.pad_id, dec.pair.device)
    budget = 16 * 2048
    batch = RaggedBatch(ctx.models(), len(seqs), budget, ctx.k, ctx.pad_id, ctx.device)
    admission = Admission(ctx, fixed_chunk=chunk)
    for seq in seqs[:-1]:
        admission.add(seq)
    rows, step = [], 0
    with torch.inference_mode():
        while admission.busy or len(batch):
            if step == arrive_at:
                admission.add(seqs[-1])
            start = time.perf_counter()
            chunks_before = admission.chunks
            admission.admit(batch)
            admitted = time.perf_counter()
            if len(batch):
                decode_step(ctx, batch)
                admission.observe_step(time.perf_counter() - admitted)
            rows.append(
                {
                    "step": step,
                    "seconds": time.perf_counter() - start,
                    "prefill_seconds": admitted - start,
                    "rows": len(batch),
                    "chunked": admission.chunks > chunks_before,
                }
            )
            step += 1
    return rows


def summary(rows: list[dict], arrive_at: int = 4) -> dict:
    before = [r["seconds"] for r in rows[1:arrive_at]]
    after = rows[arrive_at:]
    worst = max(after, key=lambda r: r["seconds"])
    return {
        "steady_step_s": statistics.median(before),
        "worst_step_s": worst["seconds"],
        "worst_step_prefill_s": worst["prefill_seconds"],
        "growth_s": worst["seconds"] - statistics.median(before),
        "iterations_with_prefill_work": sum(r["prefill_seconds"] > 0.002 for r in after),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="../shared/data/spec_bench/question.jsonl")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pair", default="default", help="built-in pair (tiny: a quick check of the script)")
    ap.add_argument("--json", help="write the timelines and summaries here")
    args = ap.parse_args()
    from batchspec.tools.prompts import read_prompts

    pair = load_pair(args.pair, dtype=args.dtype)
    texts = [p.text for p in read_prompts(args.prompts)]
    encoded = sorted((pair.encode(t) for t in texts), key=len)
    short, long = encoded[:8], encoded[-1]
    dec = SpecDecoder(pair, EngineConfig(method="ragged", k=4, batch_size=9))
    report = {"long_prompt_tokens": len(long), "short_prompt_tokens": [len(s) for s in short]}
    timeline(dec, short, long, chunk=64)  # warm-up
    runs = (("whole prompt at once", 10**6), ("measured chunk", None), ("chunk 2048", 2048), ("chunk 128", 128))
    for name, chunk in runs:
        rows = timeline(dec, short, long, chunk)
        report[name] = {"summary": summary(rows), "timeline": rows}
        s = report[name]["summary"]
        print(
            f"{name:<22} steady step {s['steady_step_s'] * 1000:6.0f} ms  "
            f"worst step {s['worst_step_s'] * 1000:6.0f} ms "
            f"(prefill in it {s['worst_step_prefill_s'] * 1000:6.0f} ms, growth {s['growth_s'] * 1000:6.0f} ms)   "
            f"iterations with prefill work {s['iterations_with_prefill_work']}"
        )
    print(f"long prompt: {len(long)} tokens; short prompts: {report['short_prompt_tokens']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
