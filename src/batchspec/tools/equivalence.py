"""`batchspec verify`: compare any method with the reference (the target alone, batch 1, greedy)
and explain each divergence.

A divergence is the first generated position t where a method's token differs from the
reference's. It is a **near-tie** when, in the reference's own logits at t, the method's token
trails the reference's top-1 token by at most `tolerance(dtype, scale)`; anything else is
**unexplained** (a synchronization bug or a wrong acceptance rule).

The tolerance. Batched, padded, multi-token forwards compute the same logits as the one-token
reference up to rounding. Measured on SmolLM2-135M (Spec-Bench prompts, a padded batch of 4
verifying 8 tokens vs one-token steps), the largest logit error was 19 ulps of the logit scale in
float32 (6.7e-5 at |logit| ~ 28) and 3.8 in bfloat16 (0.78). A flip needs the gap to be at most
the two tokens' errors combined, so we take tolerance = 2 x a conservative error bound:
64 x eps x scale in float32 and float64, 12 x eps x scale in bfloat16/float16, where eps is the
dtype's machine epsilon and scale the largest |logit| at t.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

from ..core.config import EngineConfig, SamplingParams
from ..core.errors import BatchspecError
from ..decoder import SpecDecoder

SHOW = 4  # divergences printed per run
ULPS = {torch.float64: 64, torch.float32: 64, torch.bfloat16: 12, torch.float16: 12}


def tolerance(dtype: torch.dtype, scale: float) -> float:
    """Largest logit gap that rounding alone can flip, for logits of magnitude `scale`."""
    return ULPS.get(dtype, 12) * torch.finfo(dtype).eps * max(scale, 1.0)


@dataclass
class Divergence:
    prompt: int  # index of the prompt
    position: int  # index in the generated tokens
    reference_token: int | None
    method_token: int | None  # None: the method stopped here
    gap: float | None  # reference logit of its own token minus that of the method's token
    tolerance: float
    kind: str  # "near_tie" | "unexplained"


def first_divergence(reference: list[int], got: list[int]) -> int | None:
    """First index where the two token lists differ (a missing token counts), or None."""
    for t, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return t
    return None if len(reference) == len(got) else min(len(reference), len(got))


@torch.inference_mode()
def classify(target, prompt_ids: list[int], reference: list[int], got: list[int], prompt: int) -> Divergence | None:
    """The first divergence of `got` from `reference`, explained with the reference's logits."""
    t = first_divergence(reference, got)
    if t is None:
        return None
    ref_tok = reference[t] if t < len(reference) else None
    got_tok = got[t] if t < len(got) else None
    ids = torch.tensor([prompt_ids + reference[:t]], device=target.device)
    logits = target(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    tol = tolerance(next(target.parameters()).dtype, logits.abs().max().item())
    if ref_tok is None or got_tok is None:
        return Divergence(prompt, t, ref_tok, got_tok, None, tol, "unexplained")
    gap = (logits[ref_tok] - logits[got_tok]).item()
    return Divergence(prompt, t, ref_tok, got_tok, gap, tol, "near_tie" if gap <= tol else "unexplained")


def compare(target, prompt_ids, references, outputs) -> tuple[dict, list[Divergence]]:
    """Per-run metrics for one method and batch size, and its divergences."""
    divergences, prefix = [], []
    for i, (p, ref, got) in enumerate(zip(prompt_ids, references, outputs)):
        d = classify(target, p, ref, got, i)
        prefix.append(1.0 if d is None else d.position / max(len(ref), 1))
        if d is not None:
            divergences.append(d)
    n = len(references)
    metrics = {
        "n_prompts": n,
        "exact_match": (n - len(divergences)) / n,
        "prefix_match": sum(prefix) / n,
        "divergences": len(divergences),
        "near_ties": sum(d.kind == "near_tie" for d in divergences),
        "unexplained": sum(d.kind == "unexplained" for d in divergences),
    }
    return metrics, divergences


def verify(
    pair,
    prompts,
    methods,
    batch_sizes,
    params: SamplingParams,
    k=4,
    proposer=None,
    chat_template=True,
    progress=True,
    on_run=None,
    **options,
) -> dict:
    """Run the reference once, every method at every batch size, and compare (greedy only).
    `options`: further EngineConfig fields (window_size, min_group, ...) for every method.
    `on_run(report)`, if given, sees the report so far after each (method, batch size): a long run
    leaves its finished cells behind."""
    if not params.greedy:
        raise BatchspecError("verify compares greedy outputs; use --temperature 0")
    params = replace(params, logprobs=params.logprobs or 0)  # each token's logprob: its logits row, compared
    mode = options.get("batch_invariant")
    ref_dec = SpecDecoder(pair, EngineConfig(method="reference", progress=progress, batch_invariant=mode))
    ref_outs = ref_dec.generate(prompts, params, chat_template)
    prompt_ids = [o.prompt_token_ids for o in ref_outs]
    references = [o.token_ids for o in ref_outs]
    runs = []
    header = {"models": pair.describe(), "startup": dict(pair.startup), "k": k, "max_new_tokens": params.max_new_tokens}
    combos = [(m, b) for m in methods for b in batch_sizes]
    for method, batch in tqdm(combos, desc="verify", disable=not progress, leave=False):
        dec = SpecDecoder(
            pair, EngineConfig(method=method, batch_size=batch, k=k, proposer=proposer, progress=progress, **options)
        )
        start = time.perf_counter()
        outs = dec.generate(prompt_ids, params)
        seconds = time.perf_counter() - start
        metrics, divs = compare(pair.target, prompt_ids, references, [o.token_ids for o in outs])
        runs.append(
            {
                "method": method,
                "batch_size": batch,
                "dtype": str(pair.dtype).removeprefix("torch."),
                "batch_invariant": bool(mode),
                **metrics,
                "max_logprob_diff": logprob_gap(ref_outs, outs),
                "seconds": round(seconds, 1),
                "divergence_list": [asdict(d) | _texts(pair, d) for d in divs],
            }
        )
        if on_run is not None:
            on_run({"runs": runs} | header)
    return {"runs": runs} | header


def logprob_gap(references, outputs) -> float:
    """The largest |logprob difference| of a token both emitted at the same position (before any
    divergence): 0.0 when every committed token's logits row equals the reference's (a log-softmax
    of equal rows is equal)."""
    gap = 0.0
    for ref, got in zip(references, outputs):
        for a, b, ta, tb in zip(ref.logprobs, got.logprobs, ref.token_ids, got.token_ids):
            if ta != tb:
                break
            gap = max(gap, abs(a.logprob - b.logprob))
    return gap


def _texts(pair, d: Divergence) -> dict:
    show = lambda t: None if t is None or pair.tokenizer is None else pair.tokenizer.decode([t])
    return {"reference_text": show(d.reference_token), "method_text": show(d.method_token)}


def table(report: dict) -> str:
    head = (
        f"{'method':<10}{'batch':>6}{'dtype':>10}{'prompts':>9}{'exact':>8}{'prefix':>8}"
        f"{'diverged':>10}{'near-tie':>10}{'unexplained':>13}{'max |dlogp|':>13}"
    )
    lines = [head, "-" * len(head)]
    for r in report["runs"]:
        lines.append(
            f"{r['method']:<10}{r['batch_size']:>6}{r['dtype']:>10}{r['n_prompts']:>9}{r['exact_match']:>8.3f}"
            f"{r['prefix_match']:>8.3f}{r['divergences']:>10}{r['near_ties']:>10}{r['unexplained']:>13}"
            f"{r['max_logprob_diff']:>13.2e}"
        )
    return "\n".join(lines)


def divergence_lines(report: dict) -> list[str]:
    """The first few divergences of every run, one line each (all of them are in the report)."""
    lines = []
    for r in report["runs"]:
        shown = r["divergence_list"][:SHOW]
        where = f"{r['method']} b={r['batch_size']}"
        for d in shown:
            gap = "stopped" if d["gap"] is None else f"gap {d['gap']:.3g} (tol {d['tolerance']:.3g})"
            lines.append(
                f"  {where} prompt {d['prompt']} token {d['position']}: {d['reference_token']} "
                f"{d['reference_text']!r} -> {d['method_token']} {d['method_text']!r}, {gap}: {d['kind']}"
            )
        if len(r["divergence_list"]) > len(shown):
            lines.append(f"  {where}: {len(r['divergence_list']) - len(shown)} more (all in --json)")
    return lines
