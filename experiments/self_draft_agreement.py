"""How often the target's own quantized copy picks the target's token, with all its layers or some
skipped (a self-speculative draft that skips layers is cheaper per step, if it still agrees).

Teacher-forced along the float32 target's own greedy continuations of Spec-Bench prompts: at each
generated position, is the draft's argmax the target's token?

    python experiments/self_draft_agreement.py [--quant int8] [--prompts N] [--every 60] [--new-tokens 48]
        [--group 32] [--int4-head] [--all-layers-only] [--time]

The draft's LM head is its full one (`draft_vocab="full"`: the quantization alone is measured);
`--group` sets int4's inputs per group (quant.GROUP), `--int4-head` makes the head int4 as well
(it stays int8 by default), `--all-layers-only` skips the layer-skipping sets, `--time` also times
one forward of the draft (all its layers) at one row over 400 cached slots (median of 21).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from batchspec import load_pair
from batchspec.models import quant
from batchspec.policy.costmodel import time_forward

PROMPTS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "spec_bench", "question.jsonl")


def layer_sets(n: int) -> dict[str, list[int]]:
    return {
        "all": list(range(n)),
        "drop every 4th": [i for i in range(n) if i % 4 != 3],
        "drop every 3rd": [i for i in range(n) if i % 3 != 2],
        "drop every 2nd": [i for i in range(n) if i % 2 == 0 or i == n - 1],
        "drop 8 of the last 10": [i for i in range(n) if not n - 10 <= i < n - 2],
    }


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quant", default="int8", choices=["none", "int8", "int4"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--every", type=int, default=60, help="take every N-th Spec-Bench prompt")
    ap.add_argument("--group", type=int, default=quant.GROUP, help="int4: inputs per group")
    ap.add_argument("--int4-head", action="store_true", help="int4: the LM head int4 too")
    ap.add_argument("--all-layers-only", action="store_true")
    ap.add_argument("--time", action="store_true", help="time one forward at one row (ms)")
    ap.add_argument("--json")
    args = ap.parse_args()
    quant.GROUP = args.group
    pair = load_pair("default", dtype="float32", draft="self", draft_quant=args.quant, draft_vocab="full")
    if args.int4_head:
        pair.draft.lm_head = quant.QuantLinear(pair.target.lm_head.weight, None, "int4")
    with open(PROMPTS, encoding="utf-8") as f:
        texts = [json.loads(line)["turns"][0] for line in f][:: args.every][: args.prompts]
    runs = []
    for text in texts:
        ids = torch.tensor([pair.encode(text)])
        out = pair.target.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)
        runs.append((ids.shape[1], out))
    forward_ms = round(time_forward(pair.draft, 1, 1, 400, repeats=21) * 1e3, 1) if args.time else None
    if forward_ms is not None:
        print(f"one forward, 1 row over 400 slots: {forward_ms} ms")
    layers = list(pair.draft.model.layers)
    result = {}
    sets = layer_sets(len(layers))
    if args.all_layers_only:
        sets = {"all": sets["all"]}
    for name, keep in sets.items():
        pair.draft.model.layers = torch.nn.ModuleList([layers[i] for i in keep])
        agree = total = 0
        for start, out in runs:
            picks = pair.draft(input_ids=out, use_cache=False).logits[0, start - 1 : -1].argmax(-1)
            agree += int((picks == out[0, start:]).sum())
            total += out.shape[1] - start
        result[name] = {"layers": len(keep), "agreement": round(agree / total, 3), "positions": total}
        print(f"{name:24s} {len(keep):3d} layers  agreement {agree / total:.3f} ({total} positions)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            config = {"quant": args.quant, "group": args.group, "int4_head": args.int4_head, "every": args.every}
            json.dump(config | {"prompts": len(texts), "forward_ms": forward_ms, "sets": result}, f, indent=1)


if __name__ == "__main__":
    main()
