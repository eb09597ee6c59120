"""The default target's LM head (49,152 x 576, float32) at 1, 4, 16 and 48 rows: its TunedLinear
(the form its own FormTable chose), F.linear, x @ W^T and oneDNN over a packed copy; the median ms
of 30 calls each. The head is a fifth of the model's weights and streams from memory at one row.

    python experiments/head_forms.py
"""

from __future__ import annotations

import time

import torch

from batchspec import load_pair


def median_ms(fn, calls: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[calls // 2] * 1e3


@torch.inference_mode()
def main() -> None:
    head = load_pair("default", dtype="float32").target.get_output_embeddings()
    weight = head.weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    for rows in (1, 4, 16, 48):
        x = torch.randn(rows, weight.shape[1])
        forms = {
            "module": lambda x=x: head(x),
            "F.linear": lambda x=x: torch.nn.functional.linear(x, weight),
            "x@wT": lambda x=x: x @ weight.t(),
            "onednn": lambda x=x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        }
        print(rows, {name: round(median_ms(fn), 2) for name, fn in forms.items()}, flush=True)


if __name__ == "__main__":
    main()
