"""Run statistics: tokens/s, tokens per step, the accepted histogram, time per stage.

Stages are timed with a monotonic clock around each piece of work (`with stats.stage("draft")`);
on a GPU the clock waits for queued kernels first, so a stage is charged for its own work.
"""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

STAGES = ("prefill", "draft", "verify", "accept", "realign", "schedule")


@dataclass
class Stats:
    device: str = "cpu"
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    wall_s: float = 0.0
    tokens: int = 0  # generated tokens, prefill's first token included
    step_tokens: int = 0  # tokens emitted by decode steps (prefill's excluded)
    row_steps: int = 0  # (row, step) pairs: one per row per decode step
    steps: int = 0  # forward steps of the whole batch
    accepted_hist: Counter = field(default_factory=Counter)
    proposed_drafts: int = 0  # draft tokens offered to rows (accepted ones: accepted_hist)
    chosen_k: Counter = field(default_factory=Counter)  # drafts verified per row per step: {k_i: count}
    forced_tokens: int = 0  # drafts a grammar forced (jump-forward, engine/jump.py): no proposer call
    extra: dict = field(default_factory=dict)  # method-specific (e.g. EXSPEC's group_rate)

    def _now(self) -> float:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def stage(self, name: str):
        start = self._now()
        try:
            yield
        finally:
            self.stage_s[name] = self.stage_s.get(name, 0.0) + self._now() - start

    @contextmanager
    def run(self):
        """Wraps a whole generate call: wall time."""
        start = self._now()
        try:
            yield
        finally:
            self.wall_s += self._now() - start

    def record_step(self, kept: list[int], accepted: list[int]) -> None:
        """One decode step: per row, tokens kept and draft tokens accepted."""
        self.steps += 1
        self.row_steps += len(kept)
        self.step_tokens += sum(kept)
        self.tokens += sum(kept)
        self.accepted_hist.update(accepted)

    def record_verified(self, seqs: list, kept: list[int], width: int, limit) -> None:
        """One speculative (or plain) step: per row, the tokens kept and the drafts offered to the
        target (`width`, or limit [B] where rows had fewer)."""
        self.record_step(kept, [seq.accepted_per_step[-1] for seq in seqs])
        offered = [width] * len(seqs) if limit is None else limit.tolist()
        for seq, n in zip(seqs, offered):
            seq.proposed_drafts += n
        self.proposed_drafts += sum(offered)
        self.chosen_k.update(offered)

    def summary(self) -> dict:
        """A JSON-ready dict; shares are of wall time, `other` is what no stage claimed."""
        wall = self.wall_s or float("nan")
        staged = sum(self.stage_s.values())
        shares = {name: s / wall for name, s in self.stage_s.items()}
        shares["other"] = max(0.0, self.wall_s - staged) / wall
        decode_s = self.wall_s - self.stage_s.get("prefill", 0.0)
        accepted = sum(a * n for a, n in self.accepted_hist.items())
        return {
            "tokens": self.tokens,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens / wall,
            "prefill_s": self.stage_s.get("prefill", 0.0),
            "decode_tokens_per_s": self.step_tokens / decode_s if decode_s > 0 else float("nan"),
            "steps": self.steps,
            "row_steps": self.row_steps,
            "mean_tokens_per_step": self.step_tokens / self.row_steps if self.row_steps else 0.0,
            "mean_accepted": accepted / self.row_steps if self.row_steps else 0.0,
            "mean_batch_occupancy": self.row_steps / self.steps if self.steps else 0.0,
            "accepted_histogram": {str(a): n for a, n in sorted(self.accepted_hist.items())},
            "chosen_k_histogram": {str(k): n for k, n in sorted(self.chosen_k.items())},
            "forced_tokens": self.forced_tokens,
            "time_s": dict(self.stage_s),
            "time_share": shares,
            **self.extra,
        }

    def line(self) -> str:
        """One human-readable line."""
        s = self.summary()
        share = ", ".join(f"{k} {v:.0%}" for k, v in s["time_share"].items() if v >= 0.005)
        line = (
            f"{s['tokens']} tokens in {s['wall_s']:.2f}s = {s['tokens_per_s']:.1f} tok/s | "
            f"{s['mean_tokens_per_step']:.2f} tokens/step, mean accepted {s['mean_accepted']:.2f} | {share}"
        )
        if self.forced_tokens:
            line += f" | jump-forward {self.forced_tokens} tokens"
        return line + startup_text(s.get("startup", {}))


def startup_text(startup: dict) -> str:
    """' | start: load 1.2s (cached GGUF conversion), tuning 0.0s (cached)', or '' without one."""
    parts = []
    if "load_s" in startup:
        parts.append(f"load {startup['load_s']:.1f}s ({startup.get('weights', 'read')})")
    if "tuning_s" in startup:
        parts.append(f"tuning {startup['tuning_s']:.1f}s ({startup.get('tuning', 'none')})")
    if "compile_s" in startup:
        how = startup.get("forward", "compiled").removeprefix("compiled")  # " (max-autotune, ...)" or ""
        parts.append(f"compile {startup['compile_s']:.1f}s{how}")
    elif "forward" in startup:
        parts.append(f"forward {startup['forward']}")
    if "drafter" in startup:
        parts.append(startup["drafter"])
    return " | start: " + ", ".join(parts) if parts else ""
