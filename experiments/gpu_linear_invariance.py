"""On a GPU: which products give a row the same bits whatever else shares the call (cuBLAS).

    python experiments/gpu_linear_invariance.py        # needs a CUDA device; writes $OUT/gpu_probe.json

For each dtype: `F.linear` of SmolLM2's weight shapes (and 4096 x 4096), each row count M against
M = 2,048 and against the rows computed alone; `bmm` of a fixed shape over batch counts, and with
rows or columns varying; `P @ V` with trailing zero columns. Lists what differs.

Feeds: docs/batch-invariance.md (Where it does not run), docs/bench/gpu_batch_invariance_probe.json.
"""

import json
import os

import torch
import torch.nn.functional as F


def main() -> None:
    torch.manual_seed(0)
    dev = "cuda"
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for o, i in ((576, 576), (1536, 576), (576, 1536), (49152, 576), (4096, 4096)):
            w = (torch.randn(o, i, device=dev) * 0.05).to(dtype)
            x = torch.randn(2048, i, device=dev).to(dtype)
            full = F.linear(x, w)
            alone = torch.cat([F.linear(x[j : j + 1], w) for j in range(64)])
            rows = [*range(1, 65), 100, 128, 257, 512, 1024]
            out[f"linear {name} {i}->{o}"] = {
                "M differing from M=2048": [m for m in rows if not torch.equal(F.linear(x[:m], w), full[:m])],
                "M differing from rows alone": [
                    m for m in range(2, 65) if not torch.equal(F.linear(x[:m], w), alone[:m])
                ],
            }
        a = torch.randn(300, 16, 64, device=dev).to(dtype)
        b = torch.randn(300, 64, 64, device=dev).to(dtype)
        full = torch.bmm(a, b)
        counts = (1, 2, 3, 7, 64, 100, 299)
        out[f"bmm {name} batch count"] = [n for n in counts if not torch.equal(torch.bmm(a[:n], b[:n]), full[:n])]
        a2 = torch.randn(8, 700, 64, device=dev).to(dtype)
        full2 = torch.bmm(a2, b[:8])
        rows = [*range(1, 40), 64, 128, 512]
        out[f"bmm {name} rows"] = [m for m in rows if not torch.equal(torch.bmm(a2[:, :m], b[:8]), full2[:, :m])]
        b3 = torch.randn(8, 64, 2048, device=dev).to(dtype)
        full3 = torch.bmm(a[:8], b3)
        cols = [*range(1, 40), 64, 128, 512, 1000]
        out[f"bmm {name} columns"] = [
            c for c in cols if not torch.equal(torch.bmm(a[:8], b3[:, :, :c]), full3[:, :, :c])
        ]
        p = torch.rand(16, 2048, device=dev).to(dtype)
        v = torch.randn(2048, 64, device=dev).to(dtype)
        zeros = {}
        for span in (7, 64, 300, 1000):
            exact = p[:, :span] @ v[:span]
            widths = (span + 1, 64 * ((span + 63) // 64) + 64, 2048)
            zeros[span] = [
                width
                for width in widths
                if not torch.equal(torch.cat([p[:, :span], p.new_zeros(16, width - span)], 1) @ v[:width], exact)
            ]
        out[f"p@v {name} trailing zeros differ at"] = zeros
    print(json.dumps(out, indent=1))
    folder = os.environ.get("OUT", ".")
    with open(os.path.join(folder, "gpu_probe.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
