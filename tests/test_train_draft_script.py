"""Smoke test of scripts/train_draft on the built-in tiny pair: prompts -> target answers -> reduced
vocabulary -> distillation -> saved weights -> Spec-Bench-style measurement, in a few seconds and
offline. The saved weights must load with batchspec.models.draft and give logits over the reduced head."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_script
from safetensors.torch import load_file

from batchspec.models.draft import load_default_draft
from batchspec.models.pair import load_pair

pytestmark = pytest.mark.scripts  # the training tools' tests: on demand, as the measurement scripts'

VOCAB = 48


def test_train_draft_tiny_end_to_end(tmp_path):
    bench = tmp_path / "question.jsonl"
    rows = [("writing", "Write a haiku about rain."), ("math", "What is 7 times 6?"), ("math", "Is 91 prime?")]
    bench.write_text("".join(json.dumps({"category": c, "turns": [t]}) + "\n" for c, t in rows), encoding="utf-8")
    out = tmp_path / "draft.safetensors"
    args = ["--pair", "tiny", "--data", str(tmp_path / "data.pt"), "--out", str(out), "--prompt-scale", "0.01"]
    args += ["--article-tokens", "8", "--max-new-tokens", "6", "--gen-batch", "64", "--vocab", str(VOCAB)]
    args += ["--steps", "2", "--batch-tokens", "512", "--eval-every", "1", "--log-every", "1"]
    args += ["--eval-specbench", str(bench), "--eval-per-category", "2", "--eval-tokens", "4", "--eval-exact", "2"]
    run = run_script("train_draft", *args)
    assert "after training" in run.stdout

    meta = json.loads((tmp_path / "draft.json").read_text(encoding="utf-8"))
    assert meta["architecture"]["vocab_size_reduced"] == VOCAB
    assert meta["training"]["steps"] == 2
    assert meta["data"]["sequences"] == meta["data"]["train_sequences"] + meta["data"]["val_sequences"]
    assert meta["command"].startswith("python scripts/train_draft --pair tiny")
    assert set(meta["specbench"]["per_category"]) == {"writing", "math"}
    assert meta["specbench"]["cost"]["ratio"] > 0

    target = load_pair("tiny", dtype="float32", device="cpu").target
    draft = load_default_draft(target, torch.float32, path=str(out))
    assert draft.vocab_ids.shape == (VOCAB,)
    assert bool((draft.vocab_ids[1:] > draft.vocab_ids[:-1]).all()), "vocab_ids must be sorted and unique"
    assert int(target.config.eos_token_id) in draft.vocab_ids.tolist()
    ids = torch.randint(0, target.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = draft(ids, use_cache=False).logits
    assert logits.shape == (2, 5, VOCAB)
    assert bool(torch.isfinite(logits).all())


def test_train_eagle_tiny_end_to_end(tmp_path):
    """scripts/train_eagle.py on the tiny pair (the second-step loss on): saved weights that load
    with batchspec.models.eagle and draft exactly in the engine."""
    from batchspec import SamplingParams, SpecDecoder
    from batchspec.models.eagle import load_head

    out = tmp_path / "head.safetensors"
    args = ["--pair", "tiny", "--data", str(tmp_path / "data.pt"), "--out", str(out), "--prompt-scale", "0.01"]
    args += ["--article-tokens", "8", "--max-new-tokens", "6", "--gen-batch", "64", "--vocab", str(VOCAB)]
    args += ["--steps", "3", "--batch-tokens", "512", "--eval-every", "2", "--log-every", "1", "--second-step", "0.5"]
    args += ["--self-data", str(tmp_path / "self.pt"), "--self-instruct", "28", "--request-tokens", "12"]
    run_script("train_eagle.py", *args)
    meta = json.loads((tmp_path / "head.json").read_text(encoding="utf-8"))
    assert meta["training"]["steps"] == 3 and meta["training"]["second_step"] == 0.5
    assert meta["architecture"]["vocab_size_reduced"] == VOCAB
    after = meta["validation"]["after"]
    assert "sim_accepted" in after["templated"] and "sim_accepted" in after["self_instruct"]
    extra = torch.load(tmp_path / "self.pt")
    assert len(extra["records"]) == 28 + len(extra["requests"]) == 28 + meta["data"]["self_instruct_requests"]

    pair = load_pair("tiny", dtype="float32", device="cpu")
    pair.head = load_head(pair.target, torch.float32, path=str(out))
    assert pair.head.vocab_ids.shape == (VOCAB,)
    prompts = [[5, 6, 7, 8], [9, 10]]
    params = SamplingParams(max_new_tokens=8)
    ref = [o.token_ids for o in SpecDecoder(pair, method="reference").generate(prompts, params)]
    dec = SpecDecoder(pair, method="ragged", proposer="eagle", k=3, check_invariants=True)
    assert [o.token_ids for o in dec.generate(prompts, params)] == ref

    # --init-from: fine-tuning starts from these weights and keeps their vocabulary (at lr 0 the
    # weights come back unchanged, through the bf16 round trip); --data none: self-instruct data only
    tuned = tmp_path / "tuned.safetensors"
    args[args.index("--out") + 1], args[args.index("--steps") + 1] = str(tuned), "1"
    args[args.index("--data") + 1] = "none"
    run_script("train_eagle.py", *args, "--init-from", str(out), "--lr", "0")
    tuned_meta = json.loads((tmp_path / "tuned.json").read_text(encoding="utf-8"))
    assert tuned_meta["training"]["init_from"] == str(out)
    assert tuned_meta["data"]["sequences"] == len(extra["records"])
    assert tuned_meta["validation"]["held_out_answers"]["templated"] == 0
    first, second = load_file(str(out)), load_file(str(tuned))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)

    # --aux-layers: the fine-tuned head also reads target layers 0 and 1 (fused features); fc's new
    # columns start at zero, so at lr 0 it drafts what the head it started from drafts
    fused = tmp_path / "fused.safetensors"
    args[args.index("--out") + 1] = str(fused)
    args += ["--aux-data", str(tmp_path / "aux.pt")]
    run_script("train_eagle.py", *args, "--init-from", str(out), "--lr", "0", "--aux-layers", "1,0")
    fused_meta = json.loads((tmp_path / "fused.json").read_text(encoding="utf-8"))
    assert fused_meta["training"]["aux_layers"] == [0, 1]
    assert fused_meta["validation"]["after"] == tuned_meta["validation"]["after"]
    state = load_file(str(fused))
    hidden = pair.target.config.hidden_size
    assert state["aux_layers"].tolist() == [0, 1] and state["fc.weight"].shape == (hidden, 4 * hidden)
    assert torch.equal(state["fc.weight"][:, : 2 * hidden], first["fc.weight"])
    assert not state["fc.weight"][:, 2 * hidden :].any()
    pair.head = load_head(pair.target, torch.float32, path=str(fused))
    dec = SpecDecoder(pair, method="ragged", proposer="eagle", k=3, check_invariants=True)
    assert [o.token_ids for o in dec.generate(prompts, params)] == ref
    # the aux features come from the cache the second time: the same head
    again = tmp_path / "again.safetensors"
    args[args.index("--out") + 1] = str(again)
    run = run_script("train_eagle.py", *args, "--init-from", str(out), "--lr", "0", "--aux-layers", "0,1")
    assert "loading cached aux features" in run.stdout
    assert json.loads((tmp_path / "again.json").read_text(encoding="utf-8"))["data"]["aux_extraction_s"] == 0.0
    again_state = load_file(str(again))
    assert all(torch.equal(state[k], again_state[k]) for k in state)
