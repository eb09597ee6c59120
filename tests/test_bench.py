"""`batchspec bench` and `batchspec generate` on the tiny pair: every field, the plot, the JSON."""

from __future__ import annotations

import json

import pytest

from batchspec.cli import main


def test_bench_cli_reports_every_field(tmp_path, capsys):
    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(
        [
            "bench",
            "--pair",
            "tiny",
            "--methods",
            "ar,spec1,eqspec,exspec,ragged",
            "--batch-sizes",
            "1,2",
            "--max-new-tokens",
            "8",
            "--quiet",
            "--json",
            str(out),
            "--plot",
            str(png),
            "one prompt",
            "another",
            "third",
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert {"runs", "machine", "models", "costs"} <= set(report)
    runs = {(r["method"], r["batch_size"]) for r in report["runs"]}
    assert runs == {
        ("ar", 1),
        ("ar", 2),
        ("spec1", 1),
        ("eqspec", 1),
        ("eqspec", 2),
        ("exspec", 1),
        ("exspec", 2),
        ("ragged", 1),
        ("ragged", 2),
    }
    for r in report["runs"]:
        for key in (
            "tokens_per_s",
            "decode_tokens_per_s",
            "prefill_s",
            "mean_tokens_per_step",
            "accepted_histogram",
            "time_share",
            "vs_ar",
            "vs_spec1",
            "speed_of_light_tokens_per_s",
            "efficiency",
            "peak_rss_mb",
        ):
            assert key in r, key
        assert set(r["time_share"]) >= {"draft", "verify", "realign", "schedule", "other"}
        assert r["tokens_per_s"] > 0 and 0 < r["efficiency"]
    ar = [r for r in report["runs"] if r["method"] == "ar"]
    assert all(r["vs_ar"] == 1.0 for r in ar)
    assert "group_rate" in next(r for r in report["runs"] if r["method"] == "exspec")
    for r in (r for r in report["runs"] if r["method"] == "ragged"):  # KV slots allocated vs held
        assert 0 < r["kv_peak_held_tokens"] <= r["kv_peak_tokens"] and r["kv_peak_bytes"] > 0, r
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "vs spec1" in capsys.readouterr().out
    assert report["costs"]["draft_ms"], "the proposer's model is timed (ar, run first, has none)"


def test_bench_pairs_runs_of_a_repeat_and_alternates_their_order(tiny32, monkeypatch, capsys):
    """Repeats run the configurations in reverse order every other time; `auto` is compared with
    the best of ar and its fixed k in each repeat, the median reported and printed."""
    from batchspec.core.config import SamplingParams
    from batchspec.tools import bench

    order, run_one = [], bench.run_one
    monkeypatch.setattr(bench, "run_one", lambda *a, **kw: order.append(a[2:6]) or run_one(*a, **kw))
    report = bench.bench(
        tiny32,
        ["a prompt", "another", "x"],
        ["ar", "ragged"],
        [2],
        SamplingParams(max_new_tokens=6),
        k=[2, "auto"],
        repeats=3,
        progress=False,
    )
    timed = order[3:]  # after the warm-up
    configs = [("ar", 2, None, None), ("ragged", 2, 2, 1), ("ragged", 2, "auto", 1)]
    assert timed == configs + configs[::-1] + configs
    rate = {(r["method"], r["k"]): r["tokens_per_s_repeats"] for r in report["runs"]}
    auto = next(r for r in report["runs"] if r["k"] == "auto")
    expected = [a / max(b, c) for a, b, c in zip(rate["ragged", "auto"], rate["ar", None], rate["ragged", 2])]
    assert auto["auto_vs_best_repeats"] == pytest.approx(expected)
    assert auto["auto_vs_best"] == pytest.approx(sorted(expected)[1])
    fixed = next(r for r in report["runs"] if r["k"] == 2)
    ar_rates = rate["ar", None]
    assert fixed["vs_ar_paired"] == pytest.approx(sorted(x / y for x, y in zip(rate["ragged", 2], ar_rates))[1])
    assert "auto_vs_best" not in fixed
    assert "ragged -k auto at B = 2" in bench.table(report)


def test_bench_times_the_draft_head(tmp_path):
    out = tmp_path / "b.json"
    args = ["bench", "--pair", "tiny", "--methods", "ar,ragged", "--batch-sizes", "2", "--proposer", "eagle"]
    assert main([*args, "--max-new-tokens", "6", "--quiet", "--json", str(out), "a prompt", "another one"]) == 0
    report = json.loads(out.read_text())
    assert report["costs"]["draft_ms"]["2"]["1"] > 0
    assert {r["proposer"] for r in report["runs"] if r["method"] == "ragged"} == {"eagle"}


def test_bench_passes_engine_options_to_every_run(tmp_path):
    # --min-group 1 lets EXSPEC run even a single sequence unpadded: more steps become groups.
    out = tmp_path / "b.json"
    base = [
        "bench",
        "--pair",
        "tiny",
        "--methods",
        "exspec",
        "--batch-sizes",
        "3",
        "--max-new-tokens",
        "12",
        "--quiet",
        "--json",
        str(out),
        "a first prompt",
        "the second one, longer",
        "3",
        "four four four",
    ]
    assert main(base) == 0
    default_rate = json.loads(out.read_text())["runs"][0]["group_rate"]
    assert main(base + ["--min-group", "1", "--window-size", "3"]) == 0
    report = json.loads(out.read_text())
    assert report["options"]["min_group"] == 1 and report["options"]["window_size"] == 3
    assert report["runs"][0]["group_rate"] > default_rate


def test_generate_cli_writes_results_in_input_order(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"question_id": i, "category": "c", "turns": [f"prompt number {i}", "x"]}) for i in range(5)
        )
    )
    out = tmp_path / "o.json"
    rc = main(
        [
            "generate",
            "--pair",
            "tiny",
            "--method",
            "exspec",
            "--batch-size",
            "2",
            "--prompts",
            str(prompts),
            "--limit",
            "4",
            "--max-new-tokens",
            "6",
            "--quiet",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert [r["prompt"] for r in data["results"]] == [f"prompt number {i}" for i in range(4)]
    for r in data["results"]:
        assert {"prompt", "text", "token_ids", "finish_reason", "accepted_per_step"} <= set(r)
        assert 1 <= len(r["token_ids"]) <= 6
    assert "group_rate" in data["stats"] and "tokens_per_s" in data["stats"]
    printed = capsys.readouterr().out
    assert "tok/s" in printed and "prompt number 3" in printed


def test_bench_runs_chains_and_trees_side_by_side(tmp_path, capsys):
    """--branches 1,2,3x1 runs every speculative configuration as a chain and as trees in one run;
    the cost table covers a tree's 1 + k * branches columns; verify refuses a list."""
    out = tmp_path / "b.json"
    argv = ["--pair", "tiny", "--methods", "ar,spec1", "--batch-sizes", "1", "-k", "2", "--branches", "1,2,3x1"]
    rc = main(["bench", *argv, "--proposer", "eagle", "--max-new-tokens", "8", "--quiet", "--json", str(out), "a b"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert [(r["method"], r["k"], r["branches"]) for r in report["runs"]] == [
        ("ar", None, None),
        ("spec1", 2, 1),
        ("spec1", 2, 2),
        ("spec1", 2, [3, 1]),
    ]
    assert report["branches"] == [1, 2, [3, 1]] and max(map(int, report["costs"]["target_ms"]["1"])) >= 5
    chain, tree, narrowing = report["runs"][1:]
    assert tree["vs_spec1"] == 1.0 and chain["vs_spec1"] == 1.0  # each against spec1 of its own shape
    assert narrowing["vs_spec1"] == 1.0
    printed = capsys.readouterr().out
    assert " 2/2 " in printed and " 2/3x1 " in printed
    assert main(["verify", *argv, "--quiet", "a b"]) == 2
    assert "one -k, --branches and --batch-invariant value" in capsys.readouterr().err
