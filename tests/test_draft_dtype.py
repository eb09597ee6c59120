"""`draft_dtype` / `--draft-dtype`: the draft model and the head run in their own precision, the
target's tied tensors untouched, and the output is still the target's own, in every method."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import BatchspecError, SamplingParams, SpecDecoder, load_pair
from batchspec.cli import main


@pytest.fixture(scope="module")
def tiny_bf16_draft():
    return load_pair("tiny", dtype="float64", draft_dtype="bfloat16")


def test_only_the_drafters_own_tensors_change_precision(tiny_bf16_draft):
    pair = tiny_bf16_draft
    assert all(p.dtype == torch.float64 for p in pair.target.parameters())
    assert all(p.dtype == torch.bfloat16 for p in pair.draft.parameters())
    shared = {id(p) for p in pair.target.parameters()}
    own = [p for p in pair.head.parameters() if id(p) not in shared]
    assert own and all(p.dtype == torch.bfloat16 for p in own)
    assert pair.head.model.embed_tokens.weight is pair.target.model.embed_tokens.weight
    assert pair.describe()["draft_dtype"] == "bfloat16" and pair.describe()["dtype"] == "float64"


@given(
    seed=st.integers(0, 10**6),
    method=st.sampled_from(["ragged", "eqspec", "exspec"]),
    proposer=st.sampled_from(["draft", "eagle", "ngram+draft"]),
    k=st.integers(1, 4),
    batch_size=st.integers(1, 4),
)
def test_a_bfloat16_drafter_leaves_the_output_exact(tiny_bf16_draft, tiny64, seed, method, proposer, k, batch_size):
    prompts = random_prompts(seed, 4, 1, 40)
    dec = SpecDecoder(tiny_bf16_draft, method=method, proposer=proposer, k=k, batch_size=batch_size)
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=12))]
    assert got == reference_tokens(tiny64, prompts, 12)  # the same float64 target


def test_the_default_pairs_tied_drafters_in_bfloat16_are_exact(default_pair):
    """The shipped draft and head share the float32 target's embedding: their caches take their own
    dtype (kv.entry_dtype), the invariant checker its tolerance; tokens equal the float32 target's."""
    pair = load_pair("default", dtype="float32", draft_dtype="bfloat16")
    prompts, params = ["Why is the sky blue?", "List three prime numbers."], SamplingParams(max_new_tokens=12)
    want = [o.token_ids for o in SpecDecoder(default_pair, method="ar").generate(prompts, params)]
    for proposer, method in (("draft", "ragged"), ("ngram+eagle", "eqspec")):
        dec = SpecDecoder(pair, method=method, proposer=proposer, k=3, batch_size=2, check_invariants=True)
        assert [o.token_ids for o in dec.generate(prompts, params)] == want, (proposer, method)


def test_bad_draft_dtype_is_refused():
    with pytest.raises(BatchspecError, match="unknown draft dtype 'int3'"):
        load_pair("tiny", draft_dtype="int3")


def test_cli_draft_dtype(tmp_path, capsys):
    out = tmp_path / "g.json"
    args = ["generate", "--pair", "tiny", "--draft-dtype", "bfloat16", "--proposer", "draft", "-k", "2"]
    assert main([*args, "--max-new-tokens", "4", "--quiet", "--json", str(out), "hello"]) == 0
    report = json.loads(out.read_text())
    assert report["models"]["draft_dtype"] == "bfloat16" and report["models"]["dtype"] == "float32"
