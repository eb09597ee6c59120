"""`batchspec bench`: every method side by side on the same prompts, models and process.

Methods are interleaved within each repeat, in reverse order every other repeat, so drift of the
machine hits all of them alike; a short warm-up of every method runs first. Per (method, batch
size) we report throughput (prefill included, and decode alone), tokens per step, the accepted
histogram, time shares per stage, peak memory, ratios vs `ar` at the same batch size and vs
`spec1`, and the efficiency against the speed-of-light model of costs.py. Ratios are also paired:
each repeat's run against the other runs of the same repeat (`vs_ar_paired`; for `-k auto`,
`auto_vs_best`: against the best of `ar` and the method's fixed k), the median over repeats, as
runs minutes apart on a shared machine differ more than runs side by side. `spec1` and
`reference` run one sequence at a time, so they are measured once per repeat and listed at batch
size 1.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import threading

import psutil
import torch
import transformers
from tqdm.auto import tqdm

from ..core import methods, tree
from ..core.config import EngineConfig, SamplingParams, model_proposer
from ..decoder import SpecDecoder
from .costs import cost_table, speed_of_light


class PeakMemory:
    """Peak resident memory of this process while the block runs (sampled every 10 ms), and the
    peak CUDA allocation on a GPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.peak_rss = 0

    def __enter__(self):
        self._stop = threading.Event()
        self._proc = psutil.Process(os.getpid())
        self.peak_rss = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        return self

    def _sample(self):
        while not self._stop.wait(0.01):
            self.peak_rss = max(self.peak_rss, self._proc.memory_info().rss)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak_cuda = torch.cuda.max_memory_allocated() if self.cuda else None

    def summary(self) -> dict:
        out = {"peak_rss_mb": self.peak_rss / 2**20}
        if self.cuda:
            out["peak_cuda_mb"] = self.peak_cuda / 2**20
        return out


def combos(
    names: list[str], batch_sizes: list[int], ks: list = (4,), branches: list = (1,), modes: list = (None,)
) -> list[tuple]:
    """(method, batch size, k, branches, batch-invariant mode): one-at-a-time methods at batch 1
    only, k and branches only for speculative ones."""
    out = []
    for m in names:
        spec = methods.get(m)
        for b in batch_sizes if spec.batched else [1]:
            for mode in modes:
                settings = [(k, c) for c in branches for k in ks] if spec.speculative else [(None, None)]
                out += [(m, b, k, c, mode) for k, c in settings]
    return out


def run_one(pair, prompts, method, batch, k, branches, mode, params, proposer, options, decoders=None) -> dict:
    """One run; `decoders` keeps each configuration's decoder across repeats (what `auto` learned
    in the warm-up carries over, as in a long-running engine)."""
    tree = {} if k is None else {"k": k, "branches": branches}
    options = options | {"batch_invariant": mode}
    config = EngineConfig(method=method, batch_size=batch, proposer=proposer, **options, **tree)
    key = (method, batch, k, branches, mode)
    dec = decoders.get(key) if decoders is not None else None
    if dec is None:
        dec = SpecDecoder(pair, config)
        if decoders is not None:
            decoders[key] = dec
    ran = {"proposer": dec.proposer_name}  # before the run: after it `--draft auto` may switch (decoder.py)
    if dec.proposer is not None and "drafter" in dec.startup:
        ran["drafter"] = dec.startup["drafter"]
    with PeakMemory(pair.device) as mem:
        dec.generate(prompts, params)
    return dec.stats.summary() | mem.summary() | ran


def bench(
    pair,
    prompts,
    names,
    batch_sizes,
    params: SamplingParams,
    k=("auto",),
    proposer=None,
    repeats=1,
    progress=True,
    branches=(1,),
    batch_invariant=None,
    **options,
) -> dict:
    """Run everything; returns the JSON-ready report. `k`, `branches`, `batch_invariant`: a value
    or a list of them, each pair run with every speculative method (every method, for the modes).
    `options`: further EngineConfig fields (window_size, min_group, kv_budget_tokens, ...) for
    every run."""
    ks = list(k) if isinstance(k, (list, tuple)) else [k]
    brs = list(branches) if isinstance(branches, (list, tuple)) else [branches]
    modes = list(batch_invariant) if isinstance(batch_invariant, (list, tuple)) else [batch_invariant]
    runs = combos(names, batch_sizes, ks, brs, modes)
    decoders: dict = {}
    for c in tqdm(runs, desc="warm-up", disable=not progress, leave=False):
        run_one(pair, prompts[:2], *c, SamplingParams(max_new_tokens=8), proposer, options, decoders)
    samples: dict = {c: [] for c in runs}
    total = len(runs) * repeats
    with tqdm(total=total, desc="bench", disable=not progress, leave=False) as bar:
        for rep in range(repeats):
            for c in runs if rep % 2 == 0 else runs[::-1]:
                bar.set_postfix_str(f"{c[0]} b={c[1]} k={setting({'k': c[2], 'branches': c[3]})}")
                samples[c].append(run_one(pair, prompts, *c, params, proposer, options, decoders))
                bar.update(1)
    name = next((s[0]["proposer"] for s in samples.values() if s[0]["proposer"]), None)  # ar has none
    drafter = {"draft": pair.draft, "eagle": pair.head}.get(model_proposer(name))  # a model to time
    has_draft = drafter is not None
    context = int(statistics.mean(len(p) for p in _encoded(pair, prompts)) + params.max_new_tokens / 2)
    widths = max(
        (tree.columns(br, EngineConfig(method=m, k=kk).k_max) for m, _, kk, br, _ in runs if kk is not None), default=0
    )
    costs = cost_table(pair.target, drafter, sorted({c[1] for c in runs}), widths, context)
    report_runs = [_summarise(*c, samples[c], costs, has_draft) for c in runs]
    _ratios(report_runs)
    _paired(report_runs, samples)
    return {
        "runs": report_runs,
        "costs": _json_costs(costs),
        "machine": machine(pair),
        "models": pair.describe(),
        "k": ks,
        "branches": brs,
        "batch_invariant": modes,
        "max_new_tokens": params.max_new_tokens,
        "n_prompts": len(prompts),
        "repeats": repeats,
        "options": {key: v for key, v in options.items() if v is not None},
    }


def _encoded(pair, prompts):
    return [pair.encode(p) for p in prompts]


def _summarise(method, batch, k, branches, mode, samples, costs, has_draft) -> dict:
    """Median over repeats of throughput; the rest from the median run."""
    ordered = sorted(samples, key=lambda s: s["tokens_per_s"])
    mid = ordered[len(ordered) // 2]
    chosen = {int(n): c for n, c in mid["chosen_k_histogram"].items()}
    sol = speed_of_light(costs, method, batch, chosen, mid["mean_tokens_per_step"], has_draft, branches or 1)
    keys = (
        "tokens_per_s",
        "decode_tokens_per_s",
        "prefill_s",
        "wall_s",
        "tokens",
        "mean_tokens_per_step",
        "mean_accepted",
        "mean_batch_occupancy",
        "accepted_histogram",
        "chosen_k_histogram",
        "time_share",
        "peak_rss_mb",
        "peak_cuda_mb",
        "kv_budget_tokens",
        "kv_peak_tokens",
        "kv_peak_held_tokens",
        "kv_peak_bytes",
        "group_rate",
        "proposer",
        "drafter",
        "speculation",
    )
    return (
        {"method": method, "batch_size": batch, "k": k, "branches": branches, "batch_invariant": mode}
        | {key: mid[key] for key in keys if key in mid}
        | {
            "tokens_per_s_repeats": [s["tokens_per_s"] for s in samples],
            "speed_of_light_tokens_per_s": sol,
            "efficiency": mid["decode_tokens_per_s"] / sol,
        }
    )


def _ratios(runs: list[dict]) -> None:
    """vs_ar and vs_spec1, each against the run in the same batch-invariant mode."""
    plain = [r for r in runs if r["method"] == methods.PLAIN_BASELINE]
    ar = {(r["batch_size"], r["batch_invariant"]): r["tokens_per_s"] for r in plain}
    spec1 = {
        (r["k"], r["branches"], r["batch_invariant"]): r["tokens_per_s"]
        for r in runs
        if r["method"] == methods.SPEC_BASELINE
    }
    for r in runs:
        mode = r["batch_invariant"]
        r["vs_ar"] = r["tokens_per_s"] / ar[r["batch_size"], mode] if (r["batch_size"], mode) in ar else None
        base = spec1.get((r["k"], r["branches"], mode)) or next(iter(spec1.values()), None)  # same k and branches
        r["vs_spec1"] = r["tokens_per_s"] / base if base else None


def _paired(runs: list[dict], samples: dict) -> None:
    """Per-repeat ratios (runs of one repeat ran side by side), their median: `vs_ar_paired`, and
    for a k = "auto" run `auto_vs_best` (and each repeat's, `auto_vs_best_repeats`), against the
    best of `ar` and the same method's fixed ks (any branches) at the same batch size."""
    rates = {c: [s["tokens_per_s"] for s in v] for c, v in samples.items()}
    for r in runs:
        mode, batch = r["batch_invariant"], r["batch_size"]
        mine = rates[(r["method"], batch, r["k"], r["branches"], mode)]
        ar = rates.get((methods.PLAIN_BASELINE, batch, None, None, mode))
        r["vs_ar_paired"] = statistics.median(_ratios_per_repeat(mine, [ar])) if ar else None
        if mode:  # what the mode costs: against the same run with plain kernels, repeat by repeat
            off = rates.get((r["method"], batch, r["k"], r["branches"], False))
            each = _ratios_per_repeat(mine, [off]) if off else None
            r["vs_mode_off_paired"] = statistics.median(each) if each else None
            r["vs_mode_off_repeats"] = each
        if r["k"] == "auto":
            rivals = [
                v
                for (m, b, k, _, md), v in rates.items()
                if b == batch and md == mode and k != "auto" and m in (methods.PLAIN_BASELINE, r["method"])
            ]
            each = _ratios_per_repeat(mine, rivals) if rivals else None
            r["auto_vs_best"] = statistics.median(each) if each else None
            r["auto_vs_best_repeats"] = each


def _ratios_per_repeat(mine: list[float], rivals: list[list[float]]) -> list[float]:
    """mine[i] / the best rival's rate in repeat i."""
    return [x / max(v[i] for v in rivals) for i, x in enumerate(mine)]


def _json_costs(costs: dict) -> dict:
    ms = lambda d: {str(b): {str(q): 1000 * s for q, s in row.items()} for b, row in d.items()}
    return {"context_tokens": costs["context"], "target_ms": ms(costs["target"]), "draft_ms": ms(costs["draft"])}


def machine(pair) -> dict:
    device = pair.device
    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def table(report: dict) -> str:
    head = (
        f"{'method':<9}{'B':>4}{'k':>7}{'tok/s':>9}{'decode':>9}{'tok/step':>9}{'vs ar':>7}{'vs spec1':>9}"
        f"{'SoL':>8}{'eff':>6}"
        f"{'draft':>7}{'verify':>7}{'realign':>8}{'sched':>7}{'prefill':>8}{'other':>7}"
    )
    lines = [head, "-" * len(head)]
    fmt = lambda x, f: format("-", f.split(".")[0]) if x is None else format(x, f)  # noqa: E731
    for r in report["runs"]:
        sh = r["time_share"]
        lines.append(
            f"{r['method'] + ('*' if r.get('batch_invariant') else ''):<9}{r['batch_size']:>4}{setting(r):>7}"
            f"{r['tokens_per_s']:>9.1f}{r['decode_tokens_per_s']:>9.1f}"
            f"{r['mean_tokens_per_step']:>9.2f}{fmt(r['vs_ar'], '>7.2f')}{fmt(r['vs_spec1'], '>9.2f')}"
            f"{r['speed_of_light_tokens_per_s']:>8.1f}{r['efficiency']:>6.2f}"
            + "".join(
                f"{sh.get(s, 0.0):>{w}.0%}"
                for s, w in (("draft", 7), ("verify", 7), ("realign", 8), ("schedule", 7), ("prefill", 8), ("other", 7))
            )
        )
    if any(r.get("batch_invariant") for r in report["runs"]):
        lines.append("* = under --batch-invariant")
    lines += _ratio_lines(
        report["runs"], "vs_mode_off_paired", "vs_mode_off_repeats", "x the same run with plain kernels"
    )
    lines += _ratio_lines(report["runs"], "auto_vs_best", "auto_vs_best_repeats", "x the best of ar and its fixed k")
    return "\n".join(lines)


def _ratio_lines(runs: list[dict], key: str, repeats: str, against: str) -> list[str]:
    """One line per run that has the paired ratio `key`: the median, then each repeat's."""
    lines = []
    for r in runs:
        if r.get(key) is not None:
            mode = " (--batch-invariant)" if r.get("batch_invariant") else ""
            each = ", ".join(f"{x:.2f}" for x in r[repeats])
            lines.append(
                f"{r['method']} -k {setting(r)} at B = {r['batch_size']}{mode}: {r[key]:.2f} {against} "
                f"(median over repeats of side-by-side ratios: {each})"
            )
    return lines


def setting(run: dict) -> str:
    """A run's k, then "/C" for a draft tree of C branches, "/C1xC2x.." for widths per depth ("-"
    for plain decoding)."""
    if run["k"] is None:
        return "-"
    branches = run.get("branches") or 1
    if isinstance(branches, (list, tuple)):
        return f"{run['k']}/" + "x".join(map(str, branches))
    return f"{run['k']}" + (f"/{branches}" if branches > 1 else "")


def plot(report: dict, path: str) -> None:
    """Throughput vs batch size per method, and the stage breakdown of every run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["runs"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for method, k in dict.fromkeys((r["method"], setting(r)) for r in runs):
        rs = [r for r in runs if (r["method"], setting(r)) == (method, k)]
        name = method if k == "-" else f"{method} k={k}"
        if not methods.get(method).batched:
            left.axhline(rs[0]["tokens_per_s"], linestyle="--", color="gray", label=f"{name} (one at a time)")
        else:
            left.plot([r["batch_size"] for r in rs], [r["tokens_per_s"] for r in rs], marker="o", label=name)
    left.set_xscale("log", base=2)
    left.set_xticks(sorted({r["batch_size"] for r in runs}))
    left.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    left.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    left.set(xlabel="batch size", ylabel="tokens/s (prefill included)", title="Throughput", ylim=(0, None))
    left.legend(fontsize=8, loc="best")
    stages = ("prefill", "draft", "verify", "accept", "realign", "schedule", "other")
    labels = [f"{r['method']}\nB={r['batch_size']}" + ("" if r["k"] is None else f" k={setting(r)}") for r in runs]
    bottom = [0.0] * len(runs)
    for stage in stages:
        vals = [r["time_share"].get(stage, 0.0) for r in runs]
        right.bar(range(len(runs)), vals, bottom=bottom, label=stage)
        bottom = [b + v for b, v in zip(bottom, vals)]
    right.set_xticks(range(len(runs)), labels, fontsize=7, rotation=90)
    right.set(ylabel="share of wall time", title="Where the time goes")
    right.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(
        f"{report['models']['pair']} ({report['models']['dtype']}), k={','.join(map(str, report['k']))}, "
        f"{report['n_prompts']} prompts x {report['max_new_tokens']} new tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
