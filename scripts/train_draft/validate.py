"""Validation on held-out target answers (no decoding): how often the draft, fed the true prefix,
picks the target's greedy token, and the acceptance that greedy speculative decoding would get."""

from __future__ import annotations

import torch

from batchspec.models.draft import SmolDraft


def simulated_accepted(match: list[bool], k: int) -> tuple[int, int]:
    """(accepted drafts, steps) of greedy speculative decoding at k over one greedy answer, where
    match[i] says whether the draft picks answer token i: each step accepts the run of matches
    (at most k) and then takes the target's token. Token 0 comes from the target's prefill."""
    accepted, steps, i = 0, 0, 1
    while i < len(match):
        a = 0
        while a < k and i + a < len(match) and match[i + a]:
            a += 1
        accepted, steps, i = accepted + a, steps + 1, i + a + 1
    return accepted, steps


@torch.no_grad()
def evaluate(draft: SmolDraft, records: list[dict], k: int) -> dict:
    """{"agree": top-1 agreement with the target's greedy token over all answer positions,
    "sim_accepted": mean accepted drafts per step at k over the greedy (temperature 0) answers}."""
    draft.eval()
    agree, total, accepted, steps = 0, 0, 0, 0
    for r in records:
        h, _ = draft.hidden(r["tokens"][None].long())  # [1, L, H]
        picks = draft.vocab_ids[draft.lm_head(h[0]).argmax(-1)]  # [L] full ids; position t predicts t+1
        n0 = r["n_prompt"]
        match = (picks[n0 - 1 : -1] == r["greedy"].long()).tolist()  # [L - n0], one per answer token
        agree += sum(match)
        total += len(match)
        if r["temperature"] == 0:
            a, s = simulated_accepted(match, k)
            accepted, steps = accepted + a, steps + s
    return {"agree": round(agree / max(total, 1), 4), "sim_accepted": round(accepted / max(steps, 1), 3)}
