"""Train the shipped EAGLE-style head for SmolLM2-135M-Instruct (batchspec.models.eagle), end to end.

    python scripts/train_eagle.py                  # data (cached) -> head -> weights (~40 min, 2 CPU cores)
    python scripts/train_eagle.py --pair tiny --steps 50 --out /tmp/head.safetensors   # seconds

1. data: the same target-written corpus as the draft (scripts/train_draft: prompts.json templates x
   topics, never Spec-Bench prompts; the target answers them and its final hidden states, the
   features, are kept), plus --self-instruct requests the target writes itself and then answers
   (train_draft/selfinstruct.py). Cached at --data and --self-data; a run with both skips generation.
   `--data none` trains on the self-instruct corpus alone (fine-tuning a trained head, --init-from).
2. vocabulary: the 8,192 most frequent tokens of the training split (train_draft/vocab.py).
3. head: fc + one Llama layer initialised from the target's last layer, the final norm from the
   target's; the embedding and the LM head rows are the target's (shared, frozen, not stored).
   `--aux-layers 1,14,26` fuses those target layers' outputs into the features (EAGLE-3); they are
   extracted from the corpus's tokens in one target forward per batch (`add_aux`). Fine-tuning a
   head without them (--init-from) starts their fc columns at zero: the same head at step 0.
4. loss per position t, fed [x_t, f(t-1) + noise]: smooth-L1(predicted f_t, f_t) + cls_weight x
   cross-entropy of the head's reduced logits against the target's distribution (EAGLE's recipe).
5. validation: held-out greedy answers, drafting k tokens per step as the engine does (true
   features for committed tokens, predicted ones while drafting): mean accepted drafts per step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see scripts/train_draft/__main__.py

import argparse
import logging
import random
import sys
import time

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "train_draft"))

import answers  # noqa: E402
import distill  # noqa: E402
import pipeline  # noqa: E402
import selfinstruct  # noqa: E402
import vocab  # noqa: E402

from batchspec.cache import kv
from batchspec.models.draft import draft_config  # noqa: E402
from batchspec.models.eagle import EAGLE_FILE, EagleHead, load_head, save_head
from batchspec.models.forward import decoder_features, shifted
from batchspec.models.pair import cpu_has_bf16, load_pair  # noqa: E402

LOG = logging.getLogger("train_eagle")
TRAINING_KEYS = (
    "seed",
    "steps",
    "batch_tokens",
    "lr",
    "cls_weight",
    "noise",
    "second_step",
    "bf16",
    "gen_dtype",
    "init_from",
    "aux_layers",
)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python scripts/train_eagle.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="default", choices=("default", "tiny"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--data", default="/tmp/batchspec_draft/data.pt", help="cache of the templated corpus ('none': without it)"
    )
    ap.add_argument("--self-data", default="/tmp/batchspec_draft/selfinstruct.pt", help="cache of the second corpus")
    ap.add_argument("--self-instruct", type=int, default=1024, help="requests the target writes (0: none)")
    ap.add_argument("--request-tokens", type=int, default=64, help="longest request the target writes")
    ap.add_argument("--out", default=EAGLE_FILE, help="weights file (the JSON goes next to it)")
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--cls-weight", type=float, default=0.1)
    ap.add_argument("--noise", type=float, default=0.1, help="uniform noise on input features, x their RMS")
    ap.add_argument("--second-step", type=float, default=0.0, help="weight of the second drafting step's loss")
    ap.add_argument("--init-layer", type=int, default=-1, help="target layer the head's layer starts from")
    ap.add_argument("--init-from", default=None, help="fine-tune these head weights (keeps their vocabulary)")
    ap.add_argument(
        "--aux-layers",
        type=lambda text: tuple(sorted({int(x) for x in text.split(",") if x.strip()})),
        default=(),
        help="target layers whose outputs the features fuse, e.g. 1,14,26 (default: the final hidden state only)",
    )
    ap.add_argument("--aux-data", default=None, help="cache of the aux features (extracted once, ~22 min here)")
    ap.add_argument(
        "--bf16",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="bf16 autocast (default: if the CPU has bf16)",
    )
    ap.add_argument("--val-frac", type=float, default=0.04)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-records", type=int, default=16, help="held-out answers simulated during training")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--k", type=int, default=4)
    # data generation (as train_draft's defaults; used only when --data is missing)
    ap.add_argument("--prompt-scale", type=float, default=1.2)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--article-tokens", type=int, default=360)
    ap.add_argument("--gen-batch", type=int, default=32)
    ap.add_argument("--gen-dtype", default="float32", choices=("float32", "bfloat16"), help="the target's, generating")
    ap.add_argument("--sample-frac", type=float, default=0.2)
    ap.add_argument("--sample-temp", type=float, default=0.7)
    args = ap.parse_args(argv)
    args.bf16 = cpu_has_bf16() if args.bf16 is None else args.bf16
    args.command = " ".join(["python scripts/train_eagle.py", *argv])
    return args


def init_head(target, vocab_ids: torch.Tensor, layer: int, aux_layers: tuple[int, ...] = ()) -> EagleHead:
    """A float32 head: its layer copied from the target's `layer`, final norm from the target's."""
    head = EagleHead(draft_config(target.config, 1), vocab_ids, aux_layers)
    with torch.no_grad():
        head.model.layers[0].load_state_dict(target.model.layers[layer].state_dict())
        head.model.norm.load_state_dict(target.model.norm.state_dict())
    head = head.float()
    head.share_target(target)
    head.model.embed_tokens.weight.requires_grad_(False)
    return head


def widen(head: EagleHead, aux_layers: tuple[int, ...], target) -> EagleHead:
    """A head reading `aux_layers` too that computes exactly what `head` does: fc's columns for the
    new feature blocks start at zero."""
    if aux_layers == head.aux:
        return head
    if head.aux:
        raise SystemExit(f"--init-from reads aux layers {head.aux}; cannot change them to {aux_layers}")
    wide = EagleHead(head.config, head.vocab_ids, aux_layers).to(head.dtype)
    state = {k: v for k, v in head.stored_state(head.dtype).items() if k not in ("aux_layers", "fc.weight")}
    wide.load_state_dict(state, strict=False)
    with torch.no_grad():
        wide.fc.weight.zero_()
        wide.fc.weight[:, : head.fc.weight.shape[1]] = head.fc.weight
    wide.share_target(target)
    return wide


@torch.no_grad()
def add_aux(records: list[dict], target, aux_layers: tuple[int, ...], batch_tokens: int = 8192) -> float:
    """Store each record's aux features ("aux": bf16 [L-1, A H], beside "hidden") from one target
    forward over its tokens (right-padded batches of similar length); seconds taken."""
    start, width = time.time(), target.config.hidden_size
    longest = max(len(r["tokens"]) for r in records)
    batches = distill.make_batches(records, batch_tokens, longest, random.Random(0))  # the order does not matter
    for n, batch in enumerate(batches):
        rows = [records[i] for i in batch]
        ids = torch.zeros(len(rows), max(len(r["tokens"]) for r in rows) - 1, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, : len(r["tokens"]) - 1] = r["tokens"][:-1].long()
        feats = decoder_features(target, aux_layers, input_ids=ids)[1][..., width:]
        for b, r in enumerate(rows):
            r["aux"] = feats[b, : len(r["tokens"]) - 1].to(torch.bfloat16).clone()
        if n % 10 == 9 or n + 1 == len(batches):
            LOG.info(f"aux features of layers {aux_layers}: batch {n + 1}/{len(batches)}, {time.time() - start:.0f} s")
    return time.time() - start


def cached_aux(records: list[dict], target, args) -> float:
    """`add_aux`, read from --aux-data when it holds these records' features of these layers (else
    extracted and written there); seconds of extraction (0 when read)."""
    lengths = [len(r["tokens"]) - 1 for r in records]
    if args.aux_data and os.path.exists(args.aux_data):
        saved = torch.load(args.aux_data)
        if saved["aux_layers"] == list(args.aux_layers) and [len(a) for a in saved["aux"]] == lengths:
            LOG.info(f"loading cached aux features from {args.aux_data}")
            for r, a in zip(records, saved["aux"]):
                r["aux"] = a
            return 0.0
        LOG.info(f"{args.aux_data} holds other records or layers: extracting again")
    seconds = add_aux(records, target, args.aux_layers)
    if args.aux_data:
        torch.save({"aux_layers": list(args.aux_layers), "aux": [r["aux"] for r in records]}, args.aux_data)
    return seconds


def record_features(r: dict) -> torch.Tensor:
    """A record's features [L-1, F]: the final hidden states, then the aux layers' if extracted."""
    return torch.cat([r["hidden"], r["aux"]], dim=-1) if "aux" in r else r["hidden"]


def collate(records: list[dict], idx: list[int], max_len: int, pad_id: int):
    """Right-padded ids [B, T], mask [B, T], target features [B, T, F] (position t's, t <= n - 2)."""
    rows = [records[i] for i in idx]
    T = max(min(len(r["tokens"]) - 1, max_len) for r in rows)
    F_ = record_features(rows[0]).shape[1]
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    feats = torch.zeros(len(rows), T, F_)
    for b, r in enumerate(rows):
        n = min(len(r["tokens"]) - 1, max_len)
        ids[b, :n], mask[b, :n], feats[b, :n] = r["tokens"][:n].long(), 1, record_features(r)[:n].float()
    return ids, mask, feats


def head_loss(head: EagleHead, ids, mask, feats, noise: float, cls_weight: float, second: float = 0.0):
    """(loss, {"reg", "agree"}) over the real positions of a collated batch. `second` > 0 adds the
    second drafting step's loss with that weight (`second_step`)."""
    inputs = shifted(feats)
    if noise:
        inputs = inputs + noise * (torch.rand_like(inputs) * 2 - 1)
    pred = head.hidden(ids, inputs, attention_mask=mask)  # [B, T, H]
    sel = mask.bool()
    final = feats[..., : head.config.hidden_size][sel]  # what the head predicts: the final hidden state
    loss, info = _position_loss(head, pred[sel].float(), final, cls_weight)
    if second:
        pred2 = second_step(head, ids, inputs, shifted(pred))
        loss2, info2 = _position_loss(head, pred2[sel].float(), final, cls_weight)
        loss, info["agree2"] = loss + second * loss2, info2["agree"]
    return loss, info


def _position_loss(head: EagleHead, p: torch.Tensor, f: torch.Tensor, cls_weight: float):
    """Predicted p and true f features [N, H]: smooth-L1 + cls_weight x CE against the target."""
    reg = F.smooth_l1_loss(p, f)
    z_head = p @ head.head.float().T
    z_teacher = f @ head.head.float().T
    cls = -(F.softmax(z_teacher, -1) * F.log_softmax(z_head, -1)).sum(-1).mean()
    agree = (z_head.argmax(-1) == z_teacher.argmax(-1)).float().mean()
    return reg + cls_weight * cls, {"reg": float(reg.detach()), "agree": float(agree)}


def second_step(head: EagleHead, ids, true_in, own_in):
    """The head's second drafting step at every position t at once: token t with its own feature
    input `own_in` (its prediction of f(t - 1)), attending to the first pass's entries (computed
    from true features, `true_in`) at positions < t and to itself, as while drafting. [B, T, H]."""
    layer, attn = head.model.layers[0], head.model.layers[0].self_attn
    emb = F.embedding(ids, head.model.embed_tokens.weight)
    T = ids.shape[1]
    pos = torch.arange(T)[None].expand(ids.shape[0], T)
    x1, x2 = head.fc_input(emb, true_in), head.fc_input(emb, own_in)
    cos, sin = head.model.rotary_emb(x1, pos)

    def qkv(x):
        h = layer.input_layernorm(x)
        shape = (*x.shape[:2], -1, attn.head_dim)
        q, k, v = (proj(h).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    _, k1, v1 = qkv(x1)
    q2, k2, v2 = qkv(x2)
    groups = q2.shape[1] // k1.shape[1]
    keys = torch.cat([k1, k2], dim=2).repeat_interleave(groups, dim=1)
    values = torch.cat([v1, v2], dim=2).repeat_interleave(groups, dim=1)
    i = torch.arange(T)
    see = torch.cat([i[None, :] < i[:, None], torch.eye(T, dtype=torch.bool)], dim=1)  # [T, 2T]
    out = F.scaled_dot_product_attention(q2, keys, values, attn_mask=see)
    h = x2 + attn.o_proj(out.transpose(1, 2).reshape(*x2.shape[:2], -1))
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return head.model.norm(h)


@torch.no_grad()
def simulate(head: EagleHead, record: dict, k: int) -> tuple[int, int]:
    """(accepted drafts, steps) of greedy speculative decoding over one greedy answer with the
    head drafting as the engine does: true features up to the last committed token, then its own."""
    tokens, feats, n0 = record["tokens"].long(), record_features(record).float(), record["n_prompt"]
    cache = kv.reference_cache(head.config)
    n = n0  # tokens 0..n are committed (token n0 came from the prefill); the head has fed 0..done-1
    done, accepted, steps = 0, 0, 0
    while n < len(tokens) - 1:
        ids = tokens[None, done : n + 1]
        fin = shifted(feats[None, : n + 1])[:, done:]
        pos = torch.arange(done, n + 1)[None]
        drafts = []
        for _ in range(k):
            h = head.hidden(ids, fin, position_ids=pos, cache=cache, use_cache=True)[:, -1:]
            token = head.vocab_ids[(h @ head.head.T).argmax(-1)]  # [1, 1]
            drafts.append(int(token))
            ids, fin, pos = token, h, pos[:, -1:] + 1
        cache.crop(n + 1 - cache.get_seq_length())  # drop the drafted entries (negative: how many)
        done = n + 1
        a = 0
        while a < k and n + 1 + a < len(tokens) and drafts[a] == int(tokens[n + 1 + a]):
            a += 1
        accepted, steps, n = accepted + a, steps + 1, n + a + 1
    return accepted, steps


def greedy_answers(records: list[dict]) -> list[dict]:
    """The records the simulation replays: greedy answers of two tokens or more."""
    return [r for r in records if r["temperature"] == 0 and len(r["tokens"]) - r["n_prompt"] > 1]


def evaluate(head: EagleHead, records: list[dict], k: int) -> dict:
    """Mean accepted drafts per step over the greedy answers among `records` (`simulate`)."""
    head.eval()
    accepted = steps = 0
    for r in greedy_answers(records):
        a, s = simulate(head, r, k)
        accepted, steps = accepted + a, steps + s
    return {"sim_accepted": round(accepted / max(steps, 1), 3)}


def train(head: EagleHead, train_recs, val_recs, args, pad_id: int) -> dict:
    rng = random.Random(args.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: distill.lr_factor(s, args.steps))
    rms = float(torch.cat([r["hidden"][:64].float() for r in train_recs[:200]]).pow(2).mean().sqrt())
    batches, history, start, seen = [], [], time.time(), 0
    head.train()
    for step in range(args.steps):
        if not batches:
            batches = distill.make_batches(train_recs, args.batch_tokens, args.max_len, rng)
        ids, mask, feats = collate(train_recs, batches.pop(), args.max_len, pad_id)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
            loss, info = head_loss(head, ids, mask, feats, args.noise * rms, args.cls_weight, args.second_step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        seen += int(mask.sum())
        if step % args.log_every == 0 or step == args.steps - 1:
            LOG.info(
                f"step {step}/{args.steps} loss {float(loss.detach()):.3f} reg {info['reg']:.3f} "
                f"agree {info['agree']:.3f} "
                f"lr {sched.get_last_lr()[0]:.2e} {seen / (time.time() - start):.0f} tok/s"
            )
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            history.append({"step": step + 1, **evaluate(head, val_recs[: args.eval_records], args.k)})
            LOG.info(f"val @ {step + 1}: {history[-1]}")
            head.train()
    head.eval()
    return {"history": history, "train_s": round(time.time() - start, 1), "train_tokens": seen, "feature_rms": rms}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="[%(relativeCreated)7.0fms] %(message)s", stream=sys.stdout)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    wall = time.time()
    args.data_only = False
    data = {"records": []} if args.data == "none" else answers.build_data(args)
    extra = selfinstruct.build(args) if args.self_instruct else {"records": [], "requests": []}
    train_recs, val_recs = pipeline.split(data["records"], args.val_frac, args.seed)
    self_train, self_val = pipeline.split(extra["records"], args.val_frac, args.seed)
    train_recs = train_recs + self_train
    pair = load_pair(args.pair, dtype="float32", device="cpu")
    if args.init_from:  # fine-tuning: the weights and the vocabulary of a trained head
        head = widen(load_head(pair.target, torch.float32, args.init_from), args.aux_layers, pair.target)
        head.model.embed_tokens.weight.requires_grad_(False)
        vocab_ids = head.vocab_ids
    else:
        forced = vocab.forced_ids(pair.tokenizer, pair.eos_ids)
        vocab_ids = vocab.choose_vocab(train_recs, min(args.vocab, pair.vocab_size), forced, pair.vocab_size)
        layer = args.init_layer % pair.target.config.num_hidden_layers
        head = init_head(pair.target, vocab_ids, layer, args.aux_layers)
    aux_s = cached_aux(data["records"] + extra["records"], pair.target, args) if args.aux_layers else 0.0
    # before/history: the first eval_records greedy answers held out (the templated corpus's if any)
    watched = greedy_answers(val_recs or self_val)
    before = evaluate(head, watched[: args.eval_records], args.k)
    LOG.info(f"before training: {before}")
    info = train(head, train_recs, watched, args, pair.pad_id)
    held_out = {"templated": val_recs, "self_instruct": self_val}
    after = {name: evaluate(head, recs, args.k) for name, recs in held_out.items() if recs}
    LOG.info(f"after training: {after}")
    meta = {
        "target": pipeline.TARGET_NAMES.get(args.pair, args.pair),
        "architecture": {
            "input": "fc([target embedding of token t, target final hidden state at t-1"
            + (f", RMS-normalised outputs of target layers {list(args.aux_layers)} at t-1" if args.aux_layers else "")
            + "])",
            "layers": 1,
            "init_from_target_layer": args.init_layer,
            "vocab_size_reduced": len(vocab_ids),
            "shared_with_target": "input embedding, LM head rows (not stored)",
            "params_stored": sum(t.numel() for t in head.stored_state().values()),
            "stored_dtype": "bfloat16",
        },
        "training": {k: getattr(args, k) for k in TRAINING_KEYS}
        | {"train_s": info["train_s"], "train_tokens_seen": info["train_tokens"], "feature_rms": info["feature_rms"]},
        "data": {
            "sequences": len(data["records"]) + len(extra["records"]),
            "tokens": sum(len(r["tokens"]) for r in data["records"] + extra["records"]),
            "generation_s": round(data.get("gen_s", 0.0) + extra.get("gen_s", 0.0), 1),
            "aux_extraction_s": round(aux_s, 1),
            "prompts": ("scripts/train_draft/prompts.json templates x topics, and " if data["records"] else "")
            + "requests the target wrote from train_draft/selfinstruct.py's kinds; no Spec-Bench prompts",
            "self_instruct_requests": len(extra["requests"]),
        },
        "validation": {
            "k": args.k,
            "held_out_answers": {name: len(recs) for name, recs in held_out.items()},
            "before (first eval_records greedy answers)": before,
            "after": after,
            "history (first eval_records greedy answers)": info["history"],
        },
        "command": args.command,
        "wall_time_s": round(time.time() - wall, 1),
    }
    save_head(head, meta, args.out)
    LOG.info(f"saved {args.out}")


if __name__ == "__main__":
    main()
