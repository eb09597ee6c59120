"""Tables and a plot from a `scripts/serve_compare.sh` run.

Usage: python scripts/serve_report.py OUT   (writes OUT/report.md, OUT/summary.json, OUT/serve_compare.png)

Per (workload, server, C): output throughput (the offline engine's too, where it ran: prefill
included, as a client's wall clock counts it), TTFT p50/p99, ITL p50/p99 (the gap between streamed
chunks, as a client sees it: aiperf's inter-chunk latency) and TPOT p50/p99 (a request's decode time
per token: what aiperf calls its inter-token latency, where a speculative chunk's tokens count one by
one), each the median over rounds. Ratios to the peer (`transformers`), to the offline engine and to
`--no-spec` are taken within a round, then the median over rounds, since one server's speed alone
drifts between runs on a shared machine.
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

PEER = "transformers"
METRICS = {  # column: (aiperf metric, statistic)
    "tok/s": ("output_token_throughput", "avg"),
    "TTFT p50 ms": ("time_to_first_token", "p50"),
    "TTFT p99 ms": ("time_to_first_token", "p99"),
    "ITL p50 ms": ("inter_chunk_latency", "p50"),
    "ITL p99 ms": ("inter_chunk_latency", "p99"),
    "TPOT p50 ms": ("inter_token_latency", "p50"),
    "TPOT p99 ms": ("inter_token_latency", "p99"),
}


def load(out: Path) -> dict:
    """{(round, server, workload, C): {column: value, "errors": n}} from aiperf's JSON exports."""
    runs = {}
    for path in sorted(out.glob("r*/*/*/c*/profile_export_aiperf.json")):
        rnd, server, workload, c = path.parts[-5:-1]
        data = json.loads(path.read_text())
        row = {col: data.get(name, {}).get(stat) for col, (name, stat) in METRICS.items()}
        row["errors"] = sum(e.get("count", 1) for e in data.get("error_summary") or [])
        runs[(int(rnd[1:]), server, workload, int(c[1:]))] = row
    for path in sorted(out.glob("r*/offline/*/c*/offline.json")):  # the offline engine: throughput only
        rnd, server, workload, c = path.parts[-5:-1]
        row = dict.fromkeys(METRICS)
        row["tok/s"], row["errors"] = json.loads(path.read_text())["runs"][0]["tokens_per_s"], 0
        runs[(int(rnd[1:]), server, workload, int(c[1:]))] = row
    return runs


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarise(runs: dict) -> dict:
    """{(workload, server, C): {column: median, "vs peer": median ratio, "TTFT vs peer": ...}}."""
    groups = defaultdict(list)
    for (rnd, server, workload, c), row in runs.items():
        groups[(workload, server, c)].append((rnd, row))
    table = {}
    for (workload, server, c), rows in groups.items():
        entry = {col: median(r[col] for _, r in rows) for col in METRICS}
        entry["errors"] = sum(r["errors"] for _, r in rows)
        ratios, ttft = [], []
        for rnd, row in rows:
            peer = runs.get((rnd, PEER, workload, c))
            if peer and peer["tok/s"] and row["tok/s"]:
                ratios.append(row["tok/s"] / peer["tok/s"])
            if peer and peer["TTFT p50 ms"] and row["TTFT p50 ms"]:
                ttft.append(row["TTFT p50 ms"] / peer["TTFT p50 ms"])
        entry["vs peer"], entry["TTFT vs peer"] = median(ratios), median(ttft)
        online = [row["tok/s"] / off["tok/s"] for rnd, row in rows if (off := runs.get((rnd, "offline", workload, c)))]
        entry["vs offline"] = median(online) if server != "offline" else None
        nospec = [row["tok/s"] / n["tok/s"] for rnd, row in rows if (n := runs.get((rnd, "nospec", workload, c)))]
        entry["vs nospec"] = median(nospec) if server not in ("offline", "nospec") else None
        entry["rounds"] = len(rows)
        table[(workload, server, c)] = entry
    return table


def markdown(table: dict) -> str:
    lines = []
    for workload in sorted({w for w, _, _ in table}):
        lines += [f"### {workload}", ""]
        cols = ["server", "C", *METRICS, "vs peer", "TTFT vs peer", "vs offline", "vs nospec", "errors"]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for (w, server, c), e in sorted(table.items(), key=lambda kv: (kv[0][2], kv[0][1] != PEER, kv[0][1])):
            if w != workload:
                continue
            cells = [server, str(c)]
            for col in [*METRICS, "vs peer", "TTFT vs peer", "vs offline", "vs nospec"]:
                v, ratio = e[col], col.startswith(("vs", "TTFT vs"))
                cells.append("" if v is None or (server == PEER and ratio) else f"{v:.2f}" if ratio else f"{v:.1f}")
            cells.append(str(e["errors"]))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def plot(table: dict, path: Path):
    """Throughput, TTFT p50 and ITL p99 against clients, a row per workload; each server one
    colour in every panel, a legend on each. Returns the figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({w for w, _, _ in table})
    servers = sorted({s for _, s, _ in table})
    colours = dict(zip(servers, plt.get_cmap("tab10").colors))  # one colour per server in every panel
    fig, axes = plt.subplots(len(workloads), 3, figsize=(14, 3.6 * len(workloads)), squeeze=False)
    for row, workload in zip(axes, workloads):
        for server in servers:
            cs = sorted(c for w, s, c in table if w == workload and s == server)
            for ax, col in zip(row, ("tok/s", "TTFT p50 ms", "ITL p99 ms")):
                points = [(c, table[(workload, server, c)][col]) for c in cs]
                points = [(c, v) for c, v in points if v is not None]
                if points:
                    ax.plot(*zip(*points), marker="o", label=server, color=colours[server])
                    ax.set_xscale("log", base=2)
                    ax.set_xticks(cs, [str(c) for c in cs])
                ax.set_title(f"{workload}: {col}")
                ax.set_xlabel("concurrent clients")
        for ax in row:
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return fig


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = Path(sys.argv[1])
    runs = load(out)
    if not runs:
        sys.exit(f"no aiperf results under {out}")
    table = summarise(runs)
    text = markdown(table)
    (out / "report.md").write_text(text)
    rows = [{"workload": w, "server": s, "C": c, **e} for (w, s, c), e in sorted(table.items())]
    (out / "summary.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(table, out / "serve_compare.png")
    print(text)
    print(f"wrote {out / 'report.md'}, {out / 'summary.json'} and {out / 'serve_compare.png'}")


if __name__ == "__main__":
    main()
