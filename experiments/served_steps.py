"""Every decode step of a server beside what it cost: rows, attended span, the drafts each row
verified, tokens kept, the step's wall seconds and its draft and verify stages, and the prompt
tokens it was offered to carry (a rider) and whether it carried them.

    python experiments/served_steps.py --json OUT serve --pair default --batch-size 16 --port 8767
    python scripts/load_test.py --url http://127.0.0.1:8767 --concurrency 16 --requests 48 --every 10
    (stop the server with Ctrl-C: the record is written as it exits)
    python experiments/served_steps.py --summary OUT

The summary groups the steps by rows (in fours), the widest draft count verified and whether a
rider was offered: mean wall, verify and draft milliseconds and tokens kept a row.

Feeds: docs/serving.md, "Where speculation's time goes at 16 clients".
"""

from __future__ import annotations

import atexit
import json
import statistics
import sys
import time
from collections import defaultdict


def record(out: str) -> None:
    """Patch the engine's step to record each one; write the record to `out` at exit."""
    from batchspec.engine import loop, step

    steps: list[dict] = []
    decode_step = step.decode_step

    def recorded(ctx, batch, rider=None):
        stats, rows, span = ctx.stats, len(batch.seqs), batch.attended_span()
        started, tokens = time.perf_counter(), stats.step_tokens
        draft, verify, chosen = stats.stage_s["draft"], stats.stage_s["verify"], dict(stats.chosen_k)
        finished = decode_step(ctx, batch, rider)
        widths = [k for k, n in stats.chosen_k.items() if n > chosen.get(k, 0)]
        steps.append(
            {
                "rows": rows,
                "span": span,
                "width": max(widths, default=0),
                "tokens": stats.step_tokens - tokens,
                "wall_s": time.perf_counter() - started,
                "draft_s": stats.stage_s["draft"] - draft,
                "verify_s": stats.stage_s["verify"] - verify,
                "rider_tokens": 0 if rider is None else int(rider.ids.numel()),
                "carried": bool(rider is not None and rider.fed),
            }
        )
        return finished

    step.decode_step = loop.decode_step = recorded
    atexit.register(lambda: open(out, "w").write(json.dumps({"steps": steps}) + "\n"))


def summary(steps: list[dict]) -> list[dict]:
    """Per (rows in fours, width, rider offered): means of what the steps cost and kept."""
    groups = defaultdict(list)
    for s in steps:
        groups[(s["rows"] // 4 * 4, s["width"], s["rider_tokens"] > 0)].append(s)
    return [_group(*key, group) for key, group in sorted(groups.items())]


def _group(rows: int, width: int, rider: bool, group: list[dict]) -> dict:
    def mean(key: str) -> float:
        return statistics.mean(s[key] for s in group)

    return {
        "rows": f"{max(rows, 1)}-{rows + 3}",
        "width": width,
        "rider": rider,
        "steps": len(group),
        "wall_ms": round(1e3 * mean("wall_s"), 1),
        "verify_ms": round(1e3 * mean("verify_s"), 1),
        "draft_ms": round(1e3 * mean("draft_s"), 1),
        "tokens_a_row": round(statistics.mean(s["tokens"] / s["rows"] for s in group), 2),
    }


def main() -> int:
    from served_choices import main_of  # beside this script

    return main_of(__doc__, record, lambda steps, args: summary(steps))


if __name__ == "__main__":
    sys.exit(main())
