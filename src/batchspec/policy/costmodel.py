"""Step costs measured on the machine in use, for adaptive speculation (speculation.py).

A forward of q new tokens for each of B rows, attending over a span of S cached positions, costs,
for each width q apart,

    t_q(B, S) = a_q + b_q * B + c_q * (B S)        (seconds; a, b, c >= 0)

a fixed part (weights read, launches, Python), a part per row (the matmuls, the LM head), and
attention. One such model for the target's step (its verify forward plus accept, commit and
realign: what a step costs beyond drafting) and one for a proposer forward (q = 1). Fitted by
non-negative least squares on probe forwards taken when a decoder starts (every width, a few batch
shapes: seconds on a CPU for a 135M model; kept per model, dtype and batch shape for the process),
then scaled by bounded factors averaged over the steps actually timed (`StepCost`), so the model
follows the machine's load and the engine's real overheads without extrapolating a fit of the
recent steps' few batch shapes to others.
"""

from __future__ import annotations

import time
import weakref
from collections import deque

import torch

from ..cache import kv, slots
from ..core import diskcache
from ..core.config import EngineConfig
from ..distributed import tp
from ..models import compiled, linears
from ..models.eagle import EagleHead

#: Weight of one timed step in the load factor (every width) and in its width's scale; their bounds
#: (1 / limit .. limit).
LOAD_RATE, LOAD_LIMIT = 0.1, 4.0
SCALE_RATE, SCALE_LIMIT = 0.05, 2.0
#: Rounds of probe forwards (every shape once per round); the fastest of each shape counts.
PROBE_ROUNDS = 2
#: S is in thousands of positions in the features, to keep the normal equations well scaled.
_SPAN_UNIT = 1000.0

Sample = tuple[int, int, int, float]  # (rows B, tokens per row q, span S, seconds)


def features(rows: int, span: int) -> list[float]:
    return [1.0, float(rows), rows * span / _SPAN_UNIT]


class LinearCost:
    """t = coef . features(B, S), coefficients >= 0, fitted to probes or, without probes, to the
    `recent` last observations."""

    def __init__(self, probes: list[tuple[list[float], float]], recent: int = 200):
        self.probes = list(probes)
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
        """Least squares over 3 non-negative coefficients, by trying every active set."""
        self._stale = 0
        data = self.probes or list(self.seen)
        if not data:
            return
        x = torch.tensor([f for f, _ in data], dtype=torch.float64)
        y = torch.tensor([t for _, t in data], dtype=torch.float64)
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
    """Seconds of a forward of q tokens per row: a probe fit per width q, in (B, B x S), times a
    load factor shared by every width and a scale per width,

        t_q(B, S) = fit_q(B, S) x load x scale_q.

    `load` is an exponential average of timed / fitted seconds over every timed step (the engine's
    own per-step work, and the machine's load now); `scale_q` of what it leaves at width q (1 for a
    width never timed). Both are factors, bounded: a correction fitted as a sum of terms in (1, B,
    B x S) over the recent steps, which all share one batch shape, extrapolated wildly when rows
    finished or spans grew (measured: a plain step of 5 rows over 943 slots predicted at 386 ms,
    timed at 50; auto then verified where it lost 10%). Widths are modelled apart because their
    costs are not smooth in q: on the CPU measured here a verify of 2-4 tokens per row over a long
    span can cost more than one of 5 (kernel choices), and the step from 1 to 2 tokens costs more
    than any later one (docs/benchmarks.md). A width with no probe at all (a lookup proposer's
    cost) is fitted, non-negative, on its own timed steps.

    A width's scale is the mean of its timed ratios until it has 1 / SCALE_RATE of them, then
    their exponential average: a width timed rarely (the plain step, while nearly every step
    verifies) is otherwise left at what the load factor, learned from the others, says. Measured
    in a server at 16 rows: the probes put a 2-token verify at 1.03x a plain step, the steps timed
    1.4x (their accept and realign included), the shared load rose to 1.6 and the plain step was
    estimated at 1.6x its fit while it took 1.07x: the policy verified 2 tokens a row in 97% of
    its steps, at 0.89x the server's plain decoding."""

    def __init__(self, probes: list[Sample]):
        by_width: dict[int, list] = {}
        for rows, q, span, seconds in probes:
            by_width.setdefault(q, []).append((features(rows, span), seconds))
        self.widths = {q: LinearCost(points) for q, points in sorted(by_width.items())}
        self.load = 1.0  # timed / fitted seconds, every width
        self.scale: dict[int, float] = {}  # width q -> its timed / (fitted x load), averaged
        self.timed: dict[int, int] = {}  # width q -> steps timed at it

    def __call__(self, rows: int, q: int, span: int) -> float:
        return self._width(q)(rows, span) * self.load * self.scale.get(q, 1.0)  # fits are >= 0

    def fitted(self, rows: int, q: int, span: int) -> float:
        """The probes' fit alone at width q (no load or scale): a yardstick that does not move."""
        return self._width(q)(rows, span)

    def observe(self, rows: int, q: int, span: int, seconds: float) -> None:
        width = self._width(q)
        if not width.probes:  # nothing to scale: learn the cost itself
            width.observe(rows, span, seconds)
            return
        expected = self.load * self.scale.get(q, 1.0)  # one slow step (a pause) moves neither far
        ratio = min(max(seconds / max(width(rows, span), 1e-6), expected / SCALE_LIMIT), expected * SCALE_LIMIT)
        self.load = _bounded(self.load + LOAD_RATE * (ratio - self.load), LOAD_LIMIT)
        scale, n = self.scale.get(q, 1.0), self.timed.get(q, 0) + 1
        self.timed[q] = n
        self.scale[q] = _bounded(scale + max(SCALE_RATE, 1.0 / n) * (ratio / self.load - scale), SCALE_LIMIT)

    def _width(self, q: int) -> LinearCost:
        if q not in self.widths:  # an unprobed width: the nearest one's probes (none: fitted alone)
            near = min(self.widths, key=lambda w: abs(w - q)) if self.widths else None
            self.widths[q] = LinearCost(list(self.widths[near].probes) if near is not None else [])
        return self.widths[q]

    def describe(self) -> dict:
        """{q: {fixed_ms, per_row_ms, per_row_per_1k_span_ms, scale}} of the fits, and the load
        factor, JSON-ready."""
        names = ("fixed_ms", "per_row_ms", "per_row_per_1k_span_ms")
        ms = lambda m: {n: round(1e3 * c, 3) for n, c in zip(names, m.coef)}  # noqa: E731
        widths = {str(q): ms(m) | {"scale": round(self.scale.get(q, 1.0), 3)} for q, m in self.widths.items()}
        return widths | {"load": round(self.load, 3)}


def _bounded(x: float, limit: float) -> float:
    return min(limit, max(1 / limit, x))


def time_forward(model, rows: int, q: int, span: int, repeats: int = 1, warmup: bool = True) -> float:
    """Median seconds of one forward of q tokens for `rows` rows over `span` cached slots."""
    return time_rows(model, [span] * rows, q, repeats, warmup=warmup)


@torch.inference_mode()
def time_rows(model, lengths: list[int], q: int, repeats: int = 1, classes: bool = True, warmup: bool = True) -> float:
    """Median seconds of one forward of q tokens per row after each row's `lengths` cached slots,
    fed as the ragged layout feeds it (in size classes, or one slab if not `classes`; the slots'
    contents are irrelevant to the time, so nothing is prefilled), after an untimed run if `warmup`."""
    device, rows = next(model.parameters()).device, len(lengths)
    cache = slots.SlotCache(model.config, kv.entry_dtype(model), device, rows, classes)
    positions = torch.tensor(lengths, device=device)[:, None] + torch.arange(q, device=device)[None, :]
    mask = (torch.arange(max(lengths) + q, device=device)[None, None, :] <= positions[:, :, None])[:, None]
    ids = torch.zeros(rows, q, dtype=torch.long, device=device)
    extra = {}
    if isinstance(model, EagleHead):  # a draft head (eagle.py) also reads features
        extra["features"] = torch.zeros(rows, q, model.feature_size, dtype=model.dtype, device=device)
    times = []
    for _ in range(repeats + warmup):
        cache.prepare(rows, positions)
        sync(device)
        start = time.perf_counter()
        model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, **extra)
        sync(device)
        times.append(time.perf_counter() - start)
    times = times[1:] if warmup else times
    return sorted(times)[len(times) // 2]


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


#: Forwards timed (the median counts) to put a model's cached costs at this machine's speed now.
NOW_REPEATS = 3
_NOW: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(rows, span): factor}


def now(model, rows: int, columns: int, cost: StepCost, span: int) -> float:
    """The factor that puts `model`'s probe fit (`cost`, probed at `rows` rows and `columns` widths)
    at this machine's speed now: 1 where the probes were taken in this process; where they came
    from the tuning cache (the fastest ever timed there, maybe on a quieter day: this VM's speed
    drifts by up to 2x between days), a one-token forward of `rows` rows over `span` slots timed
    now over the fit's, within 1 / LOAD_LIMIT .. LOAD_LIMIT. Once per model, rows and span in a
    process; tensor-parallel ranks time it together and take rank 0's."""
    if not tp.agree(from_disk(model, rows, columns)):
        return 1.0
    known = _NOW.setdefault(model, {})
    if (rows, span) not in known:
        seconds = time_forward(model, rows, 1, span, repeats=NOW_REPEATS)
        known[rows, span] = tp.agree(_bounded(seconds / max(cost(rows, 1, span), 1e-9), LOAD_LIMIT))
    return known[rows, span]


def probe(
    model, rows: int, q_max: int, spans: tuple[int, int] = (64, 768), fresh: bool = False, stop=None
) -> list[Sample] | None:
    """Timed forwards at every width 1..q_max: one row over a mid span, `rows` rows over a short
    and a long span; each the fastest of PROBE_ROUNDS rounds over all of them, so that a slow spell
    of the machine does not skew one width against the others. Kept per model and shape for the
    process, and on disk (diskcache.py, "step-probes") for later starts on the same machine;
    `fresh` measures again: this process takes the new times, the disk keeps each point's faster
    of the stored and the new (other work on the machine only ever adds time, so a probe taken
    while it was busy never replaces a faster record). `stop` (a callable, checked between
    forwards) may abandon a measurement: None is returned and nothing kept."""
    key = _probe_id(model, rows, q_max, spans)
    per_model = _PROBES.setdefault(model, {})
    if key in per_model and not fresh:
        return per_model[key][0]
    disk = probe_key(model, rows, q_max, spans)
    # Tensor-parallel ranks probe together (the forwards all-reduce) or not at all: rank 0's record.
    stored = tp.agree(None if fresh else diskcache.read("step-probes", disk))
    if _valid_samples(stored):
        per_model[key] = ([tuple(s) for s in stored], True)
        diskcache.tally["cached"] += 1
        return per_model[key][0]
    samples = _measure(model, rows, q_max, spans, stop)
    if samples is None:
        return None
    per_model[key] = (samples, False)
    diskcache.tally["measured"] += 1
    record = _fastest(samples, tp.agree(diskcache.read("step-probes", disk)) if fresh else None)
    diskcache.write("step-probes", disk, record)
    return per_model[key][0]


def _fastest(samples: list[Sample], stored) -> list[Sample]:
    """`samples` with each point's time the lower of its own and `stored`'s (a record of the same
    points, else ignored)."""
    if not _valid_samples(stored) or [tuple(s[:3]) for s in stored] != [tuple(s[:3]) for s in samples]:
        return samples
    return [(*s[:3], min(s[3], old[3])) for s, old in zip(samples, stored)]


def from_disk(model, rows: int, q_max: int, spans: tuple[int, int] = (64, 768)) -> bool:
    """Whether `probe(model, rows, q_max, spans)` came from the disk cache (not measured here)."""
    found = _PROBES.get(model, {}).get(_probe_id(model, rows, q_max, spans))
    return bool(found and found[1])


def _probe_id(model, rows: int, q_max: int, spans: tuple[int, int]) -> tuple:
    """A probe's key in this process: its shape, the entries' dtype, the attention (the
    batch-invariant mode's costs are its own)."""
    return (rows, q_max, spans, kv.entry_dtype(model), model.config._attn_implementation)


def probe_key(model, rows: int, q_max: int, spans: tuple[int, int]) -> dict:
    """What a probe's timings depend on: the machine, the model and how its forward runs (eager,
    the compiled graph, the tuned packages), the shapes."""
    shape = {"rows": rows, "q_max": q_max, "spans": list(spans), "rounds": PROBE_ROUNDS}
    model_key = {"model": diskcache.model_identity(model), "forward": compiled.form(model)}
    return {"machine": diskcache.machine()} | model_key | shape


def _valid_samples(stored) -> bool:
    return (
        isinstance(stored, list)
        and bool(stored)
        and all(isinstance(s, list) and len(s) == 4 and all(isinstance(v, (int, float)) for v in s) for s in stored)
    )


def _measure(model, rows: int, q_max: int, spans: tuple[int, int], stop=None) -> list[Sample] | None:
    mid = sum(spans) // 2
    shapes = sorted({(1, mid), (rows, spans[0]), (rows, spans[1])})
    points = [(b, q, s) for q in range(1, q_max + 1) for b, s in shapes]
    time_forward(model, rows, q_max, spans[1], warmup=False)  # allocations, first-call paths
    best = {p: float("inf") for p in points}
    for _ in range(PROBE_ROUNDS):
        for p in points:
            if stop is not None and stop():
                return None
            best[p] = min(best[p], time_forward(model, *p, warmup=False))
    return [(b, q, s, best[(b, q, s)]) for b, q, s in points]


def prepare_linears(config: EngineConfig, target, draft) -> None:
    """The models' linear layers measure every row count a step can feed them (linears.py) before
    any forward is timed: the target's prefill chunks reach the largest bucket."""
    rows = config.batch_size * (config.k_max + 1)
    for model, most in ((target, max(rows, linears.LARGE)), (draft, rows)):
        if model is not None:
            linears.prepare(model, most)
