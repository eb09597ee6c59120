"""The data: the target answers every prompt; we keep, per sequence, the tokens, the target's final
hidden states (after its final norm) and its greedy choices.

A record is {"tokens": int32 [L] (prompt + answer), "hidden": bf16 [L-1, H] (position t predicts
token t+1), "n_prompt": int, "greedy": int32 [L - n_prompt] (the target's argmax at each answer
position, also for sampled rows), "category": str, "temperature": float (0: greedy)}. With the
hidden states the target's logits over ANY reduced vocabulary are `hidden @ head[ids].T` later.
"""

from __future__ import annotations

import logging
import os
import random
import statistics
import time

import corpus
import torch

from batchspec.cache import kv
from batchspec.core.sequence import Sequence
from batchspec.layouts.padded import column_positions, padded_ids, padding_mask
from batchspec.models.pair import ModelPair, load_pair

LOG = logging.getLogger("train_draft")
MIN_PASSAGE_CHARS = 200  # shorter passages are dropped (unless none is longer)


@torch.inference_mode()
def answer_batch(
    pair: ModelPair, prompts: list[list[int]], temps: list[float], max_new: int, gen: torch.Generator
) -> list[dict]:
    """Decode one left-padded batch with the target; a row leaves the batch (and the cache) at an
    EOS of the pair or after `max_new` tokens. Returns one record per prompt (without category)."""
    model, head = pair.target.model, pair.target.get_output_embeddings().weight  # head [V, H]
    seqs = [
        Sequence(index=i, prompt_ids=p, max_len=len(p) + max_new, eos_ids=pair.eos_ids) for i, p in enumerate(prompts)
    ]
    ids = padded_ids(seqs, pair.pad_id)  # [B, W]
    pad_left = ids.shape[1] - torch.tensor([len(s) for s in seqs])  # [B]
    cache = kv.empty(pair.target.config)
    hidden: list[list[torch.Tensor]] = [[] for _ in seqs]  # per row: [n, H] chunks
    greedy: list[list[int]] = [[] for _ in seqs]
    alive = list(range(len(seqs)))  # original row of each live batch row
    temp = torch.tensor(temps)
    while True:
        start = kv.width(cache)
        mask = padding_mask(pad_left, start + ids.shape[1])  # [b, start + q]
        pos = column_positions(pad_left, start, ids.shape[1])  # [b, q]
        h = model(input_ids=ids, attention_mask=mask, position_ids=pos, cache=cache, use_cache=True).last_hidden_state
        for j, row in enumerate(alive):  # the real (non-pad) columns only
            hidden[row].append(h[j, int(pad_left[j]) if start == 0 else 0 :].to(torch.bfloat16))
        logits = (h[:, -1] @ head.T).float()  # [b, V]
        best = logits.argmax(-1)  # [b]
        nxt = best.clone()
        t = temp[alive]
        hot = (t > 0).nonzero()[:, 0]  # sampled rows only: a softmax over the whole vocabulary is not free
        if len(hot):
            probs = torch.softmax(logits[hot] / t[hot, None], -1)
            nxt[hot] = torch.multinomial(probs, 1, generator=gen)[:, 0]
        for j, row in enumerate(alive):
            seqs[row].commit([int(nxt[j])])
            greedy[row].append(int(best[j]))
        keep = [j for j, row in enumerate(alive) if not seqs[row].finished]
        if not keep:
            break
        if len(keep) < len(alive):  # drop finished rows from the batch and the cache
            rows = torch.tensor(keep)
            kv.select_rows(cache, rows)
            pad_left, nxt, alive = pad_left[rows], nxt[rows], [alive[j] for j in keep]
        ids = nxt[:, None]
    return [
        {
            "tokens": torch.tensor(s.token_ids, dtype=torch.int32),
            "hidden": torch.cat(hidden[i])[: len(s) - 1].clone(),
            "n_prompt": s.prompt_len,
            "greedy": torch.tensor(greedy[i], dtype=torch.int32),
        }
        for i, s in enumerate(seqs)
    ]


def answer_all(pair, items: list[tuple[str, str]], seed: int, max_new: int, sample: tuple[float, float], batch: int):
    """Records for (category, text) items, in input order; batches hold similar rows (same
    category, similar length). `sample` = (share of rows sampled, their temperature)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    encoded = [pair.encode(text) for _, text in items]
    temps = [sample[1] if rng.random() < sample[0] else 0.0 for _ in items]
    order = sorted(range(len(items)), key=lambda i: (items[i][0], len(encoded[i])))
    records, new_tokens, start = [None] * len(items), 0, time.time()
    for b in range(0, len(order), batch):
        idx = order[b : b + batch]
        for i, rec in zip(idx, answer_batch(pair, [encoded[i] for i in idx], [temps[i] for i in idx], max_new, gen)):
            rec.update(category=items[i][0], temperature=temps[i])
            records[i] = rec
            new_tokens += len(rec["tokens"]) - rec["n_prompt"]
        rate = new_tokens / (time.time() - start)
        LOG.info(f"{b + len(idx)}/{len(order)} prompts, {new_tokens} new tokens, {rate:.0f} tok/s")
    return records


def build_data(args) -> dict:
    """Prompts -> target answers, in two passes; cached to args.data (a re-run loads the cache).
    Pass 1: the target writes the passages (sampled, for variety; they are training data too).
    Pass 2: every category, the passages quoted by extraction, summarization and rag prompts."""
    if os.path.exists(args.data):
        LOG.info(f"loading cached data from {args.data}")
        return torch.load(args.data)
    start = time.time()
    pair = load_pair(args.pair, dtype=args.gen_dtype, device="cpu")
    rng = random.Random(args.seed)
    items = [("writing", p) for p in corpus.article_prompts()]
    LOG.info(f"passages: {len(items)} prompts")
    arts = answer_all(pair, items, args.seed + 1, args.article_tokens, (1.0, 0.6), args.gen_batch)
    texts = [pair.decode(r["tokens"][r["n_prompt"] :].tolist()).strip() for r in arts]
    passages = [p for p in texts if len(p) > MIN_PASSAGE_CHARS] or [p for p in texts if p]
    if not passages:
        raise RuntimeError("the target wrote no passages; raise --article-tokens")
    LOG.info(f"{len(passages)} passages, mean {statistics.mean(map(len, passages)):.0f} chars")
    items = corpus.build_prompts(rng, passages, args.prompt_scale)
    LOG.info(f"answers: {len(items)} prompts")
    sample = (args.sample_frac, args.sample_temp)
    records = arts + answer_all(pair, items, args.seed + 2, args.max_new_tokens, sample, args.gen_batch)
    data = {"records": records, "passages": passages, "seed": args.seed, "gen_s": time.time() - start}
    os.makedirs(os.path.dirname(os.path.abspath(args.data)), exist_ok=True)
    torch.save(data, args.data)
    LOG.info(f"saved {len(records)} sequences to {args.data}")
    return data
