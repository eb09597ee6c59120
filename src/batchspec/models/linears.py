"""A model's linear layers in the fastest of three equal formulations per row count, chosen by timing.

A decode or verify forward multiplies a few rows (M = B x q) by each weight. On CPUs the BLAS
kernel behind `F.linear(x, W)` (x W^T) depends on M and is poor at small M: on the 2-core machine
of docs/benchmarks.md, one sweep over SmolLM2-135M's 211 float32 weights takes 44 ms at M = 1,
76 ms at M = 2 and 56 ms at M = 5. The same products computed as `(W @ x^T)^T` take 27-29 ms at
M = 1 .. 3 (M = 1 is padded to two rows: as a matrix-vector product it takes the slow path again),
and oneDNN's matmul over a packed (blocked) copy of each weight 23-28 ms at M = 3 .. 8, 41 ms at
M = 20 and 69 ms at M = 40 (F.linear: 72 and 106 ms); 19-30% less than F.linear at M = 64 .. 512
(`python experiments/linear_forms.py --sweep ...`).

`tune_linears(model)` swaps every `nn.Linear` (with or without bias) of a CPU model for a
`TunedLinear` over the same Parameters (tied embeddings stay tied). The model's layers share one
`FormTable` (its LM head has one of its own): the first time a row count M's bucket is seen (each M
up to 4, then 6, 8, 12, 16, 24, 32; an M between takes the next bucket's choice), it times each
formulation over all of the table's weights in turn (as a forward streams them from memory, not from
a warm cache) and keeps the fastest; all M > TUNE_MAX share one choice, measured at LARGE rows. A
decoder measures every bucket its batches can reach before it runs (`prepare`): a measurement takes
a few tenths of a second, which a step that met a new row count would otherwise pay (and auto's cost
model learn). The formulations compute the same dot products (up to the rounding order of their
kernels). oneDNN takes float32 and bfloat16 only, and costs a packed copy of every weight it
multiplies (made on first use, remade if the weight changes in place); where it fails (another
dtype, a build without it) it is not chosen. Products that autograd must differentiate always take
F.linear.

The choices are kept on disk (diskcache.py, "linear-forms"), keyed by the machine and the model:
a later start with the same machine, versions, threads and weights measures nothing.
"""

from __future__ import annotations

import bisect
import time
import weakref

import torch
import torch.nn.functional as F

from ..core import diskcache

#: Row counts measured; one between two takes the choice of the next. Above TUNE_MAX one choice for
#: all, measured at LARGE rows.
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
TUNE_MAX = GRID[-1]
LARGE = 64
#: Timed rounds (a sweep of each formulation) when a row count is first seen (the fastest counts).
TUNE_RUNS = 3


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


#: The formulations by name; "onednn" is a FormTable method (it keeps the packed weights).
FORMS = ("plain", "transposed", "onednn")
FUNCTIONS = {"plain": plain, "transposed": transposed}  # the traceable ones
#: Above TUNE_MAX rows: "transposed" is fast only at multiples of 8 rows there.
LARGE_FORMS = ("plain", "onednn")


def onednn_rows(rows: int) -> int:
    """The rows oneDNN multiplies for `rows` (>= rows): up to TUNE_MAX each count, above it the next
    of 8 steps per octave (at most 12.5% more). oneDNN keeps a compiled primitive per shape (a few
    hundred KB each, in an LRU the package raises to 8,192): prefill chunks of every length kept
    adding to it, and to RSS (a server's grew for minutes); these counts bound a weight's shapes to
    88 up to 4,096 rows."""
    if rows <= TUNE_MAX:
        return rows
    step = 1 << (rows.bit_length() - 4)  # rows in [2^n, 2^(n+1)): steps of 2^(n-3)
    return -(-rows // step) * step


def bucket(rows: int) -> int:
    """The row count whose measured choice serves `rows`."""
    return GRID[bisect.bisect_left(GRID, rows)] if rows <= TUNE_MAX else LARGE


class FormTable:
    """Row count M -> the fastest formulation's name, measured over `layers` (a model's
    TunedLinears) the first time M's bucket is asked for."""

    def __init__(self, identity=None):
        self.layers: list[TunedLinear] = []
        self.choice: dict[int, str] = {}
        self.packed: dict[int, tuple] = {}  # id(weight) -> (weight, (version, address), packed copy)
        self.identity = identity  # () -> the model's diskcache.model_identity; None: not kept on disk
        self._recalled = False
        self.fixed = None  # one formulation (x, weight, bias) -> out for every row count (invariant.py), else timed

    def form(self, rows: int):
        if self.fixed is not None:
            return self.fixed
        return self.function(self.form_name(rows))

    def form_name(self, rows: int) -> str:
        """The name of the formulation chosen for `rows` rows (measured now if not yet)."""
        key = bucket(rows)
        name = self.choice.get(key) or self._recall(key)
        if name is None:
            name = self.choice[key] = self._fastest(key)
            diskcache.tally["measured"] += 1
            self._remember()
            if "onednn" not in self.choice.values():
                self.packed.clear()  # the copies its measurement made
        return name

    def _disk_key(self) -> dict | None:
        return None if self.identity is None else {"machine": diskcache.machine(), "model": self.identity()}

    def _recall(self, rows: int) -> str | None:
        """The choice for bucket `rows` from the disk cache (read once per table), or None."""
        if not self._recalled and (key := self._disk_key()) is not None:
            self._recalled = True
            stored = diskcache.read("linear-forms", key)
            stored = stored if isinstance(stored, dict) else {}
            known = {int(b): n for b, n in stored.items() if str(b).isdigit() and n in FORMS}
            self.choice = known | self.choice
        name = self.choice.get(rows)
        if name is not None:
            diskcache.tally["cached"] += 1
        return name

    def _remember(self) -> None:
        if (key := self._disk_key()) is not None:
            diskcache.write("linear-forms", key, {str(b): n for b, n in sorted(self.choice.items())})

    def prepare(self, max_rows: int) -> None:
        """Measure now every bucket of row counts 1 .. max_rows not measured yet."""
        for key in sorted({bucket(rows) for rows in range(1, max_rows + 1)}):
            self.form(key)

    def function(self, name: str):
        """The formulation `name` as a function (x [M, I], weight [O, I], bias) -> [M, O]."""
        return self.onednn if name == "onednn" else FUNCTIONS[name]

    def onednn(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, I], weight [O, I] -> [M, O] by oneDNN's matmul over weight's packed copy, M > TUNE_MAX
        padded with zero rows to `onednn_rows(M)`."""
        rows = x.shape[0]
        padded = onednn_rows(rows)
        if padded != rows:
            x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(x, self._pack(weight), bias, "none", [], "")
        return out if padded == rows else out[:rows]

    def _pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight's packed copy, remade when the weight was changed in place or given new data."""
        entry, state = self.packed.get(id(weight)), (weight._version, weight.data_ptr())
        if entry is None or entry[0] is not weight or entry[1] != state:
            copy = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            entry = self.packed[id(weight)] = (weight, state, copy)
        return entry[2]

    def _fastest(self, rows: int) -> str:
        seconds = self.time_forms(rows, FORMS if rows <= TUNE_MAX else LARGE_FORMS)
        return min(seconds, key=seconds.get)

    @torch.no_grad()
    def time_forms(self, rows: int, names=FORMS) -> dict[str, float]:
        """Seconds of one sweep over every layer's weight with `rows` random input rows, per
        formulation that runs here (the fastest of TUNE_RUNS rounds after a warm-up one)."""
        inputs = {}  # one random input per (width, dtype, device), shared by the layers that take it
        calls = []  # (x, weight, bias) per layer
        for layer in self.layers:
            w = layer.weight
            key = (layer.in_features, w.dtype, w.device)
            if key not in inputs:
                inputs[key] = torch.randn(rows, layer.in_features, dtype=w.dtype, device=w.device)
            calls.append((inputs[key], w, layer.bias))
        forms = {}
        for name in names:  # the warm-up sweep (it packs oneDNN's copies); a form that fails is left out
            try:
                _sweep(form := self.function(name), calls)
                forms[name] = form
            except (RuntimeError, NotImplementedError):  # e.g. oneDNN without this dtype
                continue
        seconds = {name: float("inf") for name in forms}
        for _ in range(TUNE_RUNS):  # the forms alternate, so a slow spell of the machine hits them alike
            for name, form in forms.items():
                seconds[name] = min(seconds[name], _sweep(form, calls))
        return seconds


def _sweep(form, calls) -> float:
    """Seconds of one sweep of form over calls [(x, weight, bias)]."""
    start = time.perf_counter()
    for x, w, b in calls:
        form(x, w, b)
    return time.perf_counter() - start


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
    (F.linear without a table, and where autograd records the product)."""
    rows = x.numel() // weight.shape[1]
    if table is None or rows == 0 or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad)):
        return F.linear(x, weight, bias)
    out = table.form(rows)(x.reshape(rows, weight.shape[1]), weight, bias)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def prepare(model: torch.nn.Module, max_rows: int) -> None:
    """Measure the formulations of `model`'s tuned layers for every row count up to max_rows (a
    no-op for a model without them)."""
    tables = {id(m.table): m.table for m in model.modules() if isinstance(m, TunedLinear)}
    for table in tables.values():
        table.prepare(max_rows)


def tune_linears(model: torch.nn.Module) -> FormTable | None:
    """Swap every nn.Linear of a CPU model for a TunedLinear: the LM head (the output embedding)
    with a FormTable of its own, the others sharing one (returned; None when the model is not on
    a CPU or has no plain linear layer besides the head). The head's shape is unlike every
    other's (the vocabulary's rows: a fifth of a small model's weights), and so is its fastest
    form: at 4 rows the layers' choice took the default target's head 8.3 ms, oneDNN 4.4."""
    first = next(model.parameters(), None)
    if first is None or first.device.type != "cpu":
        return None
    ref, head = weakref.ref(model), _output_embeddings(model)
    tables = {part: FormTable(identity=_identity(ref, part)) for part in ("layers", "head")}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, TunedLinear(child, tables["head" if child is head else "layers"]))
    return tables["layers"] if tables["layers"].layers else None


def _output_embeddings(model: torch.nn.Module) -> torch.nn.Module | None:
    try:
        return model.get_output_embeddings()
    except (AttributeError, NotImplementedError):  # a model without one (a draft head of its own kind)
        return None


def _identity(ref: weakref.ref, part: str):
    """() -> the disk key's model identity of `ref`'s `part` ("layers", or the LM "head")."""
    return lambda: diskcache.model_identity(ref()) | {"part": part}
