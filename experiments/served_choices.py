"""Every verify choice of a serving `-k auto` policy beside what it then cost: a server that records,
for each step that proposed, the rows, span and width chosen, the cost model's prediction of each
width, the drafting time already spent, the accepted drafts predicted and got, and the step's timed
seconds (less a carried prompt chunk's share; None where untimed).

    python experiments/served_choices.py --json OUT serve --pair default --dtype float32 --port 8766
    python scripts/load_test.py --url http://127.0.0.1:8766 --concurrency 8 --requests 40 --every 15
    (stop the server: the record is written as it exits)
    python experiments/served_choices.py --summary OUT [--rows 8]

The summary groups the steps of at least --rows rows by width: predicted against timed
milliseconds, accepted drafts predicted against got, and the step's gain over a plain step as
predicted and as realised (against the predicted plain step; drafting is spent either way).

Feeds: docs/serving.md, "The policy's choices at 8 clients, traced".
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
import time
from collections import defaultdict


def record(out: str) -> None:
    """Patch the speculation policy to record its choices; write them to `out` at exit."""
    from batchspec.policy import speculation

    steps: list[dict] = []
    choose, observe = speculation.Adaptive.choose, speculation.Adaptive.observe

    def recording_choose(self, batch, proposal, started):
        width = choose(self, batch, proposal, started)
        rows, span, cost = len(batch.seqs), batch.attended_span(), self.step_cost
        predicted, realised = self.calibration
        steps.append(
            {
                "rows": rows,
                "span": span,
                "width": width,
                "drafting_ms": 1e3 * (time.perf_counter() - started),
                "predicted_ms": {str(q): 1e3 * cost(rows, self._columns(q), span) for q in range(self.k_max + 1)},
                "predicted_accepted": self.predicted * realised / predicted,
            }
        )
        return width

    def recording_observe(self, seqs, proposal, width, num_accepted, prop_s, step_s, span, carried=False):
        if proposal is not None and steps and "accepted" not in steps[-1]:
            steps[-1] |= {"accepted": sum(num_accepted), "timed_ms": None if step_s is None else 1e3 * step_s}
        return observe(self, seqs, proposal, width, num_accepted, prop_s, step_s, span, carried)

    speculation.Adaptive.choose, speculation.Adaptive.observe = recording_choose, recording_observe
    atexit.register(lambda: open(out, "w").write(json.dumps({"steps": steps}) + "\n"))


def _mean(group: list[dict], value) -> float:
    return sum(value(s) for s in group) / len(group)


def summary(steps: list[dict], min_rows: int) -> list[dict]:
    """Per width, over the timed steps of at least `min_rows` rows: means of what was predicted
    and what happened."""
    groups = defaultdict(list)
    for s in steps:
        if s["rows"] >= min_rows and s.get("timed_ms") is not None:
            groups[s["width"]].append(s)
    return [_group(width, group) for width, group in sorted(groups.items())]


def _group(width: int, group: list[dict]) -> dict:
    rows, spent = _mean(group, lambda s: s["rows"]), _mean(group, lambda s: s["drafting_ms"])
    plain = _mean(group, lambda s: s["predicted_ms"]["0"])
    predicted = _mean(group, lambda s: s["predicted_ms"][str(width)])
    timed = _mean(group, lambda s: s["timed_ms"])
    guess, got = _mean(group, lambda s: s["predicted_accepted"]), _mean(group, lambda s: s["accepted"])
    plain_rate = rows / (plain + spent)
    return {
        "width": width,
        "steps": len(group),
        "rows": round(rows, 2),
        "predicted_ms": round(predicted, 1),
        "timed_ms": round(timed, 1),
        "plain_predicted_ms": round(plain, 1),
        "drafting_ms": round(spent, 1),
        "accepted_predicted": round(guess, 2),
        "accepted": round(got, 2),
        "gain_predicted": round((rows + guess) / (predicted + spent) / plain_rate, 3),
        "gain_realised": round((rows + got) / (timed + spent) / plain_rate, 3),
    }


def main_of(doc: str, record, summarise, more_args=None) -> int:
    """The command line of a script that records a server (`record(path)` patches it) and
    summarises the record (`summarise(steps, args)`): served_choices.py, served_steps.py."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", help="record a server here (the batchspec arguments follow)")
    ap.add_argument("--summary", help="summarise a record")
    if more_args is not None:
        more_args(ap)
    args, rest = ap.parse_known_args()
    if args.summary:
        print(json.dumps(summarise(json.load(open(args.summary))["steps"], args), indent=1))
        return 0
    if not args.json or not rest:
        ap.error("give --summary FILE, or --json FILE and the batchspec arguments (serve ...)")
    record(args.json)
    from batchspec.cli import main as batchspec

    return batchspec(rest)


def main() -> int:
    def rows(ap):
        ap.add_argument("--rows", type=int, default=8, help="summarise steps of at least this many rows")

    return main_of(__doc__, record, lambda steps, args: summary(steps, args.rows), rows)


if __name__ == "__main__":
    sys.exit(main())
