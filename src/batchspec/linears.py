"""A model's linear layers in the faster of two equal formulations per row count, chosen by timing.

A decode or verify forward multiplies a few rows (M = B x q) by each weight. On CPUs the BLAS
kernel behind `F.linear(x, W)` (x W^T) depends on M and is poor at small M: on the 2-core machine
of docs/benchmarks.md, SmolLM2-135M's 211 float32 weights take 34 ms at M = 1, 50 ms at M = 2 and
45 ms at M = 4, while the same products computed as `(W @ x^T)^T` take 15-24 ms at M = 2 .. 4
(M = 1 is padded to two rows: as a matrix-vector product it takes the slow path again).

`tune_linears(model)` swaps every `nn.Linear` (with or without bias) of a CPU model for a
`TunedLinear` over the same Parameters (tied embeddings stay tied). The model's layers share one
`FormTable`: the first time a row count M <= TUNE_MAX is seen, it times each formulation over all
of the model's weights in turn (as a forward streams them from memory, not from a warm cache) and
keeps the fastest; larger M use `F.linear`. Both formulations compute the same dot products (up to
the rounding order of two BLAS kernels).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

#: Row counts above this use F.linear unmeasured (the kernels converge by M ~ 40 here).
TUNE_MAX = 32
#: Timed sweeps of each formulation when a row count is first seen (the fastest counts).
TUNE_RUNS = 2


def plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, I], weight [O, I] -> [M, O] as F.linear."""
    return F.linear(x, weight, bias)


def transposed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, I], weight [O, I] -> [M, O] computed as (weight @ x^T)^T, one row padded to two."""
    rows = x.shape[0]
    if rows == 1:
        x = torch.cat([x, x])
    out = (weight @ x.T).T[:rows]
    return (out if bias is None else out + bias).contiguous()


FORMS = {"plain": plain, "transposed": transposed}


class FormTable:
    """Row count M -> the fastest formulation's name, measured over `layers` (a model's
    TunedLinears) the first time M is asked for."""

    def __init__(self):
        self.layers: list[TunedLinear] = []
        self.choice: dict[int, str] = {}

    def form(self, rows: int):
        name = self.choice.get(rows)
        if name is None:
            name = self.choice[rows] = self._fastest(rows)
        return FORMS[name]

    @torch.no_grad()
    def _fastest(self, rows: int) -> str:
        inputs = {}  # one random input per (width, dtype, device), shared by the layers that take it
        calls = []  # (x, weight, bias) per layer
        for layer in self.layers:
            w = layer.weight
            key = (layer.in_features, w.dtype, w.device)
            if key not in inputs:
                inputs[key] = torch.randn(rows, layer.in_features, dtype=w.dtype, device=w.device)
            calls.append((inputs[key], w, layer.bias))
        seconds = {}
        for name, form in FORMS.items():
            runs = []
            for _ in range(TUNE_RUNS + 1):  # the first sweep warms up
                start = time.perf_counter()
                for x, w, b in calls:
                    form(x, w, b)
                runs.append(time.perf_counter() - start)
            seconds[name] = min(runs[1:])
        return min(seconds, key=seconds.get)


class TunedLinear(torch.nn.Module):
    """nn.Linear's computation [.., I] -> [.., O] in the formulation its FormTable picks per
    row count. `weight` [O, I] and `bias` [O] are the original layer's Parameters."""

    def __init__(self, layer: torch.nn.Linear, table: FormTable):
        super().__init__()
        self.weight, self.bias, self.table = layer.weight, layer.bias, table
        self.in_features, self.out_features = layer.in_features, layer.out_features
        table.layers.append(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias, self.table)


def project(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, table: FormTable | None = None
) -> torch.Tensor:
    """x [.., I] @ weight [O, I]^T (+ bias) -> [.., O], in `table`'s form for x's row count
    (F.linear without a table or above TUNE_MAX rows)."""
    rows = x.numel() // weight.shape[1]
    if table is None or rows == 0 or rows > TUNE_MAX:
        return F.linear(x, weight, bias)
    out = table.form(rows)(x.reshape(rows, weight.shape[1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def tune_linears(model: torch.nn.Module) -> FormTable | None:
    """Swap every nn.Linear of a CPU model for a TunedLinear sharing one FormTable (returned; None
    when the model is not on a CPU or has no plain linear layer)."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return None
    table = FormTable()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, TunedLinear(child, table))
    return table if table.layers else None
