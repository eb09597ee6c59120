"""Distillation: a `SmolDraft` (batchspec.models.draft) learns the target's next-token distribution over
the reduced vocabulary, from the cached records (answers.py).

Loss = KL(target || draft) over the V_r kept ids + ce_weight x CE on the target's (reduced)
argmax, per position, weighted (answer positions 1, prompt positions `prompt_weight`, pads 0).
The target is needed only through `head_teacher` [V_r, H] (its output rows of the kept ids) and
the cached hidden states: its logits at a position are `hidden @ head_teacher.T`.
"""

from __future__ import annotations

import logging
import math
import random
import time

import torch
import torch.nn.functional as F
import validate

from batchspec.models.draft import SmolDraft, draft_config

LOG = logging.getLogger("train_draft")


def init_draft(target, layers: list[int | None], vocab_ids: torch.Tensor) -> SmolDraft:
    """A float32 draft of len(layers) layers: layer i copied from target layer layers[i] (None:
    random init), final norm from the target, head rows = the target's output rows of `vocab_ids`
    [V_r]; the input embedding is the target's (shared, frozen, never stored)."""
    draft = SmolDraft(draft_config(target.config, len(layers)), vocab_ids)
    with torch.no_grad():
        for i, src in enumerate(layers):
            if src is not None:
                draft.model.layers[i].load_state_dict(target.model.layers[src].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab_ids])
    draft.tie_embedding(target.model.embed_tokens.weight)
    draft.model.embed_tokens.weight.requires_grad_(False)
    return draft.float()


def make_batches(records: list[dict], batch_tokens: int, max_len: int, rng: random.Random) -> list[list[int]]:
    """Indices of records grouped by length so that rows x longest <= batch_tokens; shuffled."""
    order = sorted(range(len(records)), key=lambda i: min(len(records[i]["tokens"]), max_len))
    batches, cur, longest = [], [], 0
    for i in order:
        n = min(len(records[i]["tokens"]), max_len)
        if cur and max(longest, n) * (len(cur) + 1) > batch_tokens:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(records: list[dict], idx: list[int], max_len: int, prompt_weight: float, pad_id: int):
    """Right-padded batch: ids [B, T], mask [B, T], teacher hidden [B, T, H] (position t predicts
    token t+1; the last column has none), weights [B, T] (0 on pads and on each row's last token)."""
    rows = [records[i] for i in idx]
    T = max(min(len(r["tokens"]), max_len) for r in rows)
    H = rows[0]["hidden"].shape[1]
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    hidden = torch.zeros(len(rows), T, H, dtype=torch.bfloat16)
    weight = torch.zeros(len(rows), T)
    for b, r in enumerate(rows):
        n = min(len(r["tokens"]), max_len)
        ids[b, :n] = r["tokens"][:n].long()
        mask[b, :n] = 1
        hidden[b, : n - 1] = r["hidden"][: n - 1]
        weight[b, : n - 1] = torch.where(torch.arange(n - 1) + 1 >= r["n_prompt"], 1.0, prompt_weight)
    return ids, mask, hidden, weight


def distill_loss(draft: SmolDraft, head_teacher: torch.Tensor, ids, mask, hidden, weight, ce_weight: float):
    """(loss, {"kl", "agree"}), averaged over weighted positions; head_teacher [V_r, H]."""
    sel = weight > 0  # [B, T]
    h_draft, _ = draft.hidden(ids, attention_mask=mask)  # [B, T, H]
    z_draft = draft.lm_head(h_draft[sel]).float()  # [N, V_r]
    z_teacher = hidden[sel].float() @ head_teacher.T  # [N, V_r]
    w = weight[sel]  # [N]
    logp_t = F.log_softmax(z_teacher, -1)
    logp_d = F.log_softmax(z_draft, -1)
    kl = (logp_t.exp() * (logp_t - logp_d)).sum(-1)  # [N]
    ce = F.cross_entropy(z_draft, z_teacher.argmax(-1), reduction="none")  # [N]
    agree = (z_draft.argmax(-1) == z_teacher.argmax(-1)).float()
    total = w.sum()
    loss = ((kl + ce_weight * ce) * w).sum() / total
    return loss, {"kl": float((kl.detach() * w).sum() / total), "agree": float((agree * w).sum() / total)}


def lr_factor(step: int, steps: int) -> float:
    """Linear warm-up over 5% of the steps, then cosine from 1 down to 0.1."""
    warm = max(1, steps // 20)
    return min(1.0, (step + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, step / steps))))


def train(draft: SmolDraft, head_teacher: torch.Tensor, train_recs, val_recs, args, pad_id: int) -> dict:
    """AdamW over args.steps batches (epochs of shuffled length buckets, seeded by args.seed);
    validates every args.eval_every steps. Returns {"history", "train_s", "train_tokens"}."""
    rng = random.Random(args.seed)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.steps))
    batches, history, start, seen = [], [], time.time(), 0
    draft.train()
    for step in range(args.steps):
        if not batches:
            batches = make_batches(train_recs, args.batch_tokens, args.max_len, rng)
        ids, mask, hidden, weight = collate(train_recs, batches.pop(), args.max_len, args.prompt_weight, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, info = distill_loss(draft, head_teacher, ids, mask, hidden, weight, args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += int(mask.sum())
        if step % args.log_every == 0 or step == args.steps - 1:
            rate, lr = seen / (time.time() - start), sched.get_last_lr()[0]
            LOG.info(
                f"step {step}/{args.steps} loss {float(loss.detach()):.3f} kl {info['kl']:.3f} "
                f"agree {info['agree']:.3f} lr {lr:.2e} {rate:.0f} tok/s"
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            history.append({"step": step + 1, **validate.evaluate(draft, val_recs, args.k)})
            LOG.info(f"val @ {step + 1}: {history[-1]}")
            draft.train()
    draft.eval()
    return {"history": history, "train_s": time.time() - start, "train_tokens": seen}
