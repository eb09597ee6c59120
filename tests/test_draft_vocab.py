"""`--draft-vocab N`: the draft model's LM head scores at most N tokens, learned from what the draft
is fed (models/vocab.py). Every method's output stays the target's own; the head learns the
prompts' and the committed tokens; bad values are refused."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import assert_drafted_exactly, random_prompts
from hypothesis import given
from hypothesis import strategies as st

from batchspec import BatchspecError, SamplingParams, SpecDecoder, load_pair, tiny_pair
from batchspec.cli import main
from batchspec.models import quant
from batchspec.models.pair import _reduce_draft_head
from batchspec.models.vocab import SELF_ROWS, GrowingHead


@pytest.fixture(scope="module")
def reduced_pairs():
    """float64 tiny pairs whose draft scores 48 of the 320 tokens: the target's own int8 copy, its
    unquantized copy, and the tiny pair's own draft model (a user's draft), dense and int8."""
    pairs = {
        q: load_pair("tiny", dtype="float64", draft="self", draft_quant=q, draft_vocab=48) for q in ("int8", "none")
    }
    for name, quantized in (("user", False), ("user-int8", True)):
        pair = tiny_pair(dtype=torch.float64)
        _reduce_draft_head(pair, 48, torch.float64, quantized)
        if quantized:
            quant.quantize(pair.draft, "int8")
        pairs[name] = pair
    return pairs


def test_the_head_adds_unseen_ids_in_order_up_to_its_capacity():
    torch.manual_seed(0)
    source = torch.randn(50, 8, dtype=torch.float64)
    head = GrowingHead(source, capacity=10, dtype=torch.float64, quantized=False, seed=3)
    assert head.ids.tolist() == [0, 1, 2]
    head.learn(torch.tensor([[7, 2, 7], [40, 0, 5]]))
    assert head.ids.tolist() == [0, 1, 2, 5, 7, 40]
    head.learn(torch.tensor([49, 48, 47, 46, 45, 44]))
    assert head.ids.tolist() == [0, 1, 2, 5, 7, 40, 44, 45, 46, 47]  # full: the rest is not added
    head.learn(torch.tensor([30]))
    assert len(head.ids) == 10 and not head.known[30] and head.known[head.ids].all()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    assert torch.equal(head(x), x @ source[head.ids].T)  # each column is its id's row


@pytest.mark.parametrize("rows", [4, quant.DENSE_ROWS + 4])  # the int8 kernel's path and the dequantized one
def test_an_int8_head_approximates_its_rows(rows):
    torch.manual_seed(1)
    source = torch.randn(300, 64)
    head = GrowingHead(source, capacity=100, dtype=torch.bfloat16, quantized=True, seed=60)
    x = torch.randn(rows, 64)
    want = x @ source[head.ids].T
    got = head(x)
    assert got.shape == (rows, 60) and got.dtype == torch.float32
    assert (got - want).abs().max() < 0.05 * want.abs().max()


@given(
    seed=st.integers(0, 10**6),
    pair=st.sampled_from(["int8", "none", "user", "user-int8"]),
    method=st.sampled_from(["ragged", "eqspec", "exspec"]),
    proposer=st.sampled_from(["draft", "ngram+draft"]),
    k=st.sampled_from([1, 3, "auto"]),
    batch_size=st.integers(1, 4),
    branches=st.sampled_from([1, 1, 2]),
)
def test_a_reduced_head_leaves_the_output_exact(
    reduced_pairs, tiny64, seed, pair, method, proposer, k, batch_size, branches
):
    assert_drafted_exactly(
        reduced_pairs[pair], tiny64, seed, method, branches, proposer=proposer, k=k, batch_size=batch_size
    )


def test_sampled_rows_with_a_reduced_head_equal_the_target_alone(reduced_pairs, tiny64):
    prompts = random_prompts(5, 6, 1, 30)
    params = [SamplingParams(temperature=0.9, seed=s, max_new_tokens=16) for s in range(6)]
    want = [o.token_ids for o in SpecDecoder(tiny64, method="reference").generate(prompts, params)]
    for name in ("int8", "user"):
        dec = SpecDecoder(reduced_pairs[name], method="ragged", proposer="draft", k=3, batch_size=3)
        assert [o.token_ids for o in dec.generate(prompts, params)] == want, name


def test_the_head_learns_the_prompts_and_the_committed_tokens():
    pair = load_pair("tiny", dtype="float64", draft="self", draft_quant="none", draft_vocab=200)
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, GrowingHead) and pair.draft_vocab_ids is head and len(head.ids) == 50  # seeded: 200 / 4
    prompts = [[300, 301, 302, 250, 260], [310, 299]]
    dec = SpecDecoder(pair, method="ragged", proposer="draft", k=3, batch_size=2)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=10))
    seen = {t for p in prompts for t in p} | {t for o in outs for t in o.token_ids[:-1]}  # the last is never fed
    assert seen <= set(head.ids.tolist())
    # Run again: every token is known now, and the target's own copy drafts what the target picks
    # (each head column mapped back to its id).
    assert [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=10))] == [
        o.token_ids for o in outs
    ]
    assert dec.stats.summary()["mean_accepted"] >= 2.0  # of 3 (a broken mapping: about 0)


def test_a_reduced_head_cuts_the_self_drafts_bytes():
    full = load_pair("tiny", draft="self", draft_quant="int8").describe()["draft"]["bytes"]
    small = load_pair("tiny", draft="self", draft_quant="int8", draft_vocab=32).describe()["draft"]["bytes"]
    assert small < full


def test_bad_draft_vocab_values_are_refused(tmp_path):
    for bad in (0, -3, 2.5, True, "half"):
        with pytest.raises(BatchspecError, match="--draft-vocab .* must be an integer >= 1 or full"):
            load_pair("tiny", draft="self", draft_vocab=bad)
    with pytest.raises(BatchspecError, match="--draft-vocab needs a draft model"):
        load_pair("tiny", draft_vocab=64)
    with pytest.raises(BatchspecError, match="--draft-vocab needs a draft model"):
        load_pair(target=str(tmp_path / "no-such-model"), draft_vocab=64)


def test_a_user_draft_with_another_vocabulary_is_refused():
    pair = tiny_pair(dtype=torch.float64)
    pair.draft.config = copy.copy(pair.draft.config)  # the tiny models share one config
    pair.draft.config.vocab_size = 300
    with pytest.raises(
        BatchspecError, match="tokenizer mismatch: the target's vocabulary has 320 entries, the draft's 300"
    ):
        _reduce_draft_head(pair, 48, torch.float64, False)


def test_cli_draft_vocab(tmp_path, capsys):
    out = tmp_path / "g.json"
    args = ["generate", "--pair", "tiny", "--draft", "self", "--draft-vocab", "64", "--proposer", "draft", "-k", "3"]
    assert main([*args, "--max-new-tokens", "6", "--quiet", "--json", str(out), "hello"]) == 0
    assert main(["generate", "--pair", "tiny", "--draft-vocab", "64", "--quiet", "hello"]) == 2
    assert "--draft-vocab needs a draft model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "--pair", "tiny", "--draft", "self", "--draft-vocab", "half", "hello"])
    assert "expected an integer >= 1 or full, got 'half'" in capsys.readouterr().err


def test_a_self_draft_scores_a_reduced_vocabulary_by_default_and_full_on_request(default_pair):
    pair = load_pair("default", dtype="float32", draft="self")  # SmolLM2: 49,152 tokens
    head = pair.draft.get_output_embeddings()
    assert isinstance(head, GrowingHead) and head.capacity == SELF_ROWS and pair.draft_vocab_ids is head
    full = load_pair("default", dtype="float32", draft="self", draft_vocab="full")
    assert full.draft_vocab_ids is None and isinstance(full.draft.get_output_embeddings(), quant.QuantLinear)
    small = load_pair("tiny", draft="self")  # 320 tokens: fewer than SELF_ROWS, the whole head
    assert small.draft_vocab_ids is None
