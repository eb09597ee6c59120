"""scripts/serve_report.py's plot: each server one colour in every panel, a legend on each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "serve_report.py"


def test_each_server_keeps_its_colour_in_every_panel_with_a_legend_on_each(tmp_path):
    spec = importlib.util.spec_from_file_location("serve_report", SCRIPT)
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    row = {"tok/s": 10.0, "TTFT p50 ms": 100.0, "ITL p99 ms": 50.0}
    table = {}
    for workload in ("specbench", "synthetic"):
        for server in ("batchspec", "nospec", "transformers"):
            for c in (1, 4):
                table[(workload, server, c)] = dict(row)
    table[("specbench", "batchspec", 1)]["TTFT p50 ms"] = None  # a missing point shifts no colour
    del table[("synthetic", "nospec", 1)], table[("synthetic", "nospec", 4)]  # a server absent from a row
    fig = report.plot(table, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
    colours: dict[str, set] = {}
    for ax in fig.axes:
        assert ax.get_legend() is not None
        for line in ax.get_lines():
            colours.setdefault(line.get_label(), set()).add(line.get_color())
    assert set(colours) == {"batchspec", "nospec", "transformers"}
    assert all(len(c) == 1 for c in colours.values()) and len({next(iter(c)) for c in colours.values()}) == 3
