"""The default target's LM head (49,152 x 576, float32) at 1, 4, 16 and 48 rows: its TunedLinear
(the form its own FormTable chose), F.linear, x @ W^T and oneDNN over a packed copy; the median ms
of 30 calls each. The head is a fifth of the model's weights and streams from memory at one row.

    python experiments/head_forms.py
"""

import torch, time
from batchspec import load_pair
pair = load_pair("default", dtype="float32")
head = pair.target.get_output_embeddings()
w = head.weight.detach()
wp = torch.ops.mkldnn._reorder_linear_weight(w, batch_size=16)
def med(f, n=30):
    for _ in range(3): f()
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return sorted(ts)[n//2]*1e3
with torch.inference_mode():
  for M in (1, 4, 16, 48):
    x = torch.randn(M, 576)
    r = {"module": med(lambda: head(x)), "F.linear": med(lambda: torch.nn.functional.linear(x, w)),
         "x@wT": med(lambda: x @ w.t()), "mkldnn": med(lambda: torch.ops.mkldnn._linear_pointwise(x, wp, None, "none", [], ""))}
    print(M, {k: round(v, 2) for k, v in r.items()}, flush=True)
