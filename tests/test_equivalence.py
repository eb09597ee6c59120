"""The verifier: it explains planted divergences correctly, catches the broken baselines, and
finds none for the correct methods in float32."""

from __future__ import annotations

import json

import torch
from helpers import random_prompts

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.cli import main
from batchspec.tools.equivalence import classify, first_divergence, tolerance, verify


def test_first_divergence():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2


def test_planted_corruption_is_unexplained(tiny32):
    prompt = random_prompts(40, 1, 10, 10)[0]
    ref = (
        SpecDecoder(tiny32, method="reference")
        .generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
        .token_ids
    )
    logits = tiny32.target(input_ids=torch.tensor([prompt + ref[:7]])).logits[0, -1]
    bad = ref[:7] + [int(logits.argmin())] + ref[8:]
    d = classify(tiny32.target, prompt, ref, bad, prompt=0)
    assert d.position == 7 and d.kind == "unexplained" and d.gap > 1.0


def test_planted_near_tie_swap_is_a_near_tie():
    pair = tiny_pair(dtype=torch.float32)
    prompt = random_prompts(41, 1, 12, 12)[0]
    ref0 = (
        SpecDecoder(pair, method="reference")
        .generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
        .token_ids
    )
    y = ref0[5]
    x = next(t for t in range(200) if t not in ref0 and t != y)
    with torch.no_grad():  # token x's output row = token y's, shrunk by 1e-7: a near-tie wherever y wins
        pair.target.lm_head.weight[x] = pair.target.lm_head.weight[y] * (1 - 1e-7)
    ref = (
        SpecDecoder(pair, method="reference")
        .generate([prompt], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
        .token_ids
    )
    t = ref.index(y)
    swapped = ref[:t] + [x] + ref[t + 1 :]
    d = classify(pair.target, prompt, ref, swapped, prompt=0)
    assert d.kind == "near_tie" and 0 <= d.gap <= d.tolerance


def test_tolerance_scales_with_dtype():
    assert tolerance(torch.float32, 30.0) < 1e-3 < tolerance(torch.bfloat16, 30.0)


def test_broken_baselines_are_caught_and_correct_methods_are_exact(tiny32):
    prompts = random_prompts(42, 10, 1, 64)
    report = verify(
        tiny32,
        prompts,
        ["eqspec", "exspec", "ragged", "bsp", "dsd"],
        [1, 4],
        SamplingParams(max_new_tokens=32),
        k=4,
        progress=False,
    )
    by = {(r["method"], r["batch_size"]): r for r in report["runs"]}
    for b in (1, 4):
        for m in ("eqspec", "exspec", "ragged"):
            assert by[m, b]["exact_match"] == 1.0 and by[m, b]["unexplained"] == 0
        for m in ("bsp", "dsd"):
            assert by[m, b]["unexplained"] > 0, f"{m} should show unexplained divergences"
            assert by[m, b]["divergences"] == by[m, b]["near_ties"] + by[m, b]["unexplained"]


def test_verify_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = main(
        [
            "verify",
            "--pair",
            "tiny",
            "--max-new-tokens",
            "12",
            "--methods",
            "eqspec,bsp",
            "--batch-sizes",
            "1,2",
            "--quiet",
            "--json",
            str(out),
            "hello there",
            "a second prompt",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    keys = {
        "method",
        "batch_size",
        "dtype",
        "n_prompts",
        "exact_match",
        "prefix_match",
        "divergences",
        "near_ties",
        "unexplained",
    }
    assert len(report["runs"]) == 4 and all(keys <= set(r) for r in report["runs"])
    assert report["startup"]["forward"].startswith("eager")  # which forward the target ran, as the stats line says
    assert "exact" in capsys.readouterr().out


def test_verify_hands_over_each_finished_cell(tiny32):
    """A long verify leaves its finished cells behind: `on_run` sees the report after each one."""
    seen = []
    report = verify(
        tiny32,
        random_prompts(43, 3, 4, 12),
        ["eqspec", "ragged"],
        [1, 2],
        SamplingParams(max_new_tokens=8, ignore_eos=True),
        progress=False,
        on_run=lambda partial: seen.append([(r["method"], r["batch_size"]) for r in partial["runs"]]),
    )
    cells = [(r["method"], r["batch_size"]) for r in report["runs"]]
    assert seen == [cells[: i + 1] for i in range(4)]
    assert all(r["seconds"] >= 0 for r in report["runs"])
