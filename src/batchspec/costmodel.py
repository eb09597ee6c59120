"""Step costs measured on the machine in use, for adaptive speculation (speculation.py).

A forward of q new tokens for each of B rows, attending over a span of S cached positions, costs,
for each width q apart,

    t_q(B, S) = a_q + b_q * B + c_q * (B S)        (seconds; a, b, c >= 0)

a fixed part (weights read, launches, Python), a part per row (the matmuls, the LM head), and
attention. One such model for the target's step (its verify forward plus accept, commit and
realign: what a step costs beyond drafting) and one for a proposer forward (q = 1). Fitted by
non-negative least squares on probe forwards taken when a decoder starts (every width, a few batch
shapes: seconds on a CPU for a 135M model; kept per model, dtype and batch shape for the process)
and on the steps actually timed; the recent steps weigh most, so the model follows the machine's
load and the engine's real overheads.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from . import kv

#: A probe counts as a quarter of a timed step: the steps actually run soon dominate the fit.
PROBE_WEIGHT = 0.25
#: Weight of one timed step in its width's scale, and the scale's bounds (1 / limit .. limit).
SCALE_RATE, SCALE_LIMIT = 0.05, 2.0
#: S is in thousands of positions in the features, to keep the normal equations well scaled.
_SPAN_UNIT = 1000.0

Sample = tuple[int, int, int, float]  # (rows B, tokens per row q, span S, seconds)


def features(rows: int, span: int) -> list[float]:
    return [1.0, float(rows), rows * span / _SPAN_UNIT]


class LinearCost:
    """t = coef . features(B, S), fitted to probes (kept, down-weighted) and the `recent` last
    observations; coefficients >= 0 unless `signed` (a correction may be negative)."""

    def __init__(self, probes: list[tuple[list[float], float]], recent: int = 200, signed: bool = False):
        self.probes, self.signed = list(probes), signed
        self.seen: deque[tuple[list[float], float]] = deque(maxlen=recent)
        self.coef = [0.0, 0.0, 0.0]
        self._stale = 0
        self._fit()

    def __call__(self, rows: int, span: int) -> float:
        return sum(c * v for c, v in zip(self.coef, features(rows, span)))

    def observe(self, rows: int, span: int, seconds: float) -> None:
        self.seen.append((features(rows, span), seconds))
        self._stale += 1
        if self._stale >= 8 or len(self.seen) < 8:
            self._fit()

    def _fit(self) -> None:
        """Weighted least squares over 3 coefficients; non-negative ones by trying every active set."""
        self._stale = 0
        data = self.probes + list(self.seen)
        if not data:
            return
        weight = torch.tensor([PROBE_WEIGHT] * len(self.probes) + [1.0] * len(self.seen), dtype=torch.float64)
        x = torch.tensor([f for f, _ in data], dtype=torch.float64) * weight.sqrt()[:, None]
        y = torch.tensor([t for _, t in data], dtype=torch.float64) * weight.sqrt()
        if self.signed:
            self.coef = torch.linalg.lstsq(x, y[:, None], driver="gelsd").solution[:, 0].tolist()
            return
        best, best_err = [0.0, 0.0, 0.0], float("inf")
        for mask in range(1, 8):
            cols = [i for i in range(3) if mask >> i & 1]
            sol = torch.linalg.lstsq(x[:, cols], y[:, None]).solution[:, 0]
            if bool((sol < 0).any()):
                continue
            coef = [0.0, 0.0, 0.0]
            for i, v in zip(cols, sol.tolist()):
                coef[i] = v
            err = float(((x @ torch.tensor(coef, dtype=torch.float64)) - y).square().sum())
            if err < best_err:
                best, best_err = coef, err
        self.coef = best


class StepCost:
    """Seconds of a forward of q tokens per row: a probe fit per width q, in (B, B x S), plus one
    correction for every width, in (B, B x S), fitted on what the timed steps cost beyond the probe
    fits (the engine's own per-step work, and the machine's load now).

    Widths are modelled apart because their costs are not smooth in q: on the CPU measured here a
    verify of 2-4 tokens per row over a long span can cost more than one of 5 (kernel choices), and
    the step from 1 to 2 tokens costs more than any later one (docs/benchmarks.md). The correction
    is shared so that a width rarely chosen is not judged by its bare forward while the others
    carry the engine's overheads; what it leaves per width (measured: a plain step overestimated by
    17% while wide verifies were by 7-10%, which biased the choice towards verifying) is a scale
    per width, an exponential average of timed / modelled seconds (1 for a width never timed)."""

    def __init__(self, probes: list[Sample]):
        by_width: dict[int, list] = {}
        for rows, q, span, seconds in probes:
            by_width.setdefault(q, []).append((features(rows, span), seconds))
        self.widths = {q: LinearCost(points) for q, points in sorted(by_width.items())}
        self.correction = LinearCost([], signed=True)
        self.scale: dict[int, float] = {}  # width q -> its timed steps / (fit + correction), averaged

    def __call__(self, rows: int, q: int, span: int) -> float:
        return self._base(rows, q, span) * self.scale.get(q, 1.0)

    def observe(self, rows: int, q: int, span: int, seconds: float) -> None:
        self.correction.observe(rows, span, seconds - self._width(q)(rows, span))
        ratio = seconds / max(self._base(rows, q, span), 1e-6)  # what the shared correction leaves
        scale = self.scale.get(q, 1.0)
        self.scale[q] = min(SCALE_LIMIT, max(1 / SCALE_LIMIT, scale + SCALE_RATE * (ratio - scale)))

    def _base(self, rows: int, q: int, span: int) -> float:
        return max(0.0, self._width(q)(rows, span) + self.correction(rows, span))

    def _width(self, q: int) -> LinearCost:
        if q not in self.widths:  # an unprobed width (none probed: 0, the correction learns it all)
            near = min(self.widths, key=lambda w: abs(w - q)) if self.widths else None
            self.widths[q] = LinearCost(list(self.widths[near].probes) if near is not None else [])
        return self.widths[q]

    def describe(self) -> dict:
        """{q: {fixed_ms, per_row_ms, per_row_per_1k_span_ms, scale}} of the probe fits, and the
        correction, JSON-ready."""
        names = ("fixed_ms", "per_row_ms", "per_row_per_1k_span_ms")
        ms = lambda m: {n: round(1e3 * c, 3) for n, c in zip(names, m.coef)}  # noqa: E731
        widths = {str(q): ms(m) | {"scale": round(self.scale.get(q, 1.0), 3)} for q, m in self.widths.items()}
        return widths | {"correction": ms(self.correction)}


def time_forward(model, rows: int, q: int, span: int, repeats: int = 1) -> float:
    """Median seconds of one forward of q tokens for `rows` rows over `span` cached slots."""
    return time_rows(model, [span] * rows, q, repeats)


@torch.inference_mode()
def time_rows(model, lengths: list[int], q: int, repeats: int = 1, classes: bool = True) -> float:
    """Median seconds of one forward of q tokens per row after each row's `lengths` cached slots,
    fed as the ragged layout feeds it (in size classes, or one slab if not `classes`; the slots'
    contents are irrelevant to the time, so nothing is prefilled)."""
    device, rows = next(model.parameters()).device, len(lengths)
    cache = kv.SlotCache(model.config, next(model.parameters()).dtype, device, rows, classes)
    positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(q, device=device)[None, :]
    mask = (torch.arange(max(lengths) + q, device=device)[None, None, :] <= positions[:, :, None])[:, None]
    ids = torch.zeros(rows, q, dtype=torch.long, device=device)
    extra = {}
    if getattr(model, "needs_features", False):  # a draft head (eagle.py) also reads features
        extra["features"] = torch.zeros(rows, q, model.config.hidden_size, dtype=model.dtype, device=device)
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        cache.prepare(rows, positions)
        sync(device)
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, **extra)
        sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def probe(model, rows: int, q_max: int, spans: tuple[int, int] = (64, 768)) -> list[Sample]:
    """Timed forwards at every width 1..q_max: one row over a mid span, `rows` rows over a short
    and a long span (cached per model and shape for the process)."""
    key = (rows, q_max, spans, next(model.parameters()).dtype)
    per_model = _PROBES.setdefault(model, {})
    if key not in per_model:
        mid = sum(spans) // 2
        points = [
            (b, q, s) for q in range(1, q_max + 1) for b, s in sorted({(1, mid), (rows, spans[0]), (rows, spans[1])})
        ]
        per_model[key] = [(b, q, s, time_forward(model, b, q, s)) for b, q, s in points]
    return per_model[key]
