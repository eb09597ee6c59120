"""The shipped SmolLM2 draft (`batchspec.models.draft`): it loads offline, its reduced vocabulary is sane,
it is called like a causal LM (logit shapes with and without a cache, left-padded batches), and
cached incremental logits equal a full forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from batchspec import BatchspecError, SamplingParams, SpecDecoder, load_pair
from batchspec.models.draft import DRAFT_FILE, SmolDraft

EOS_ID = 2  # <|im_end|>


@pytest.fixture(scope="module")
def pair(default_pair):
    """The default pair (float32), whose draft is the shipped one."""
    assert isinstance(default_pair.draft, SmolDraft)
    return default_pair


@pytest.fixture(scope="module")
def draft(pair):
    return pair.draft


def ids_of(pair, text: str) -> torch.Tensor:
    return torch.tensor([pair.encode(text)])  # [1, L]


def test_weights_file_is_small():
    import os

    assert os.path.getsize(DRAFT_FILE) <= 25 * 1024 * 1024


def test_vocab_ids(draft, pair):
    ids = draft.vocab_ids
    assert ids.dtype == torch.long and ids.dim() == 1
    assert len(torch.unique(ids)) == len(ids)
    assert int(ids.min()) >= 0 and int(ids.max()) < pair.vocab_size == 49152
    assert EOS_ID in ids.tolist()
    assert draft.lm_head.weight.shape == (len(ids), pair.target.config.hidden_size)


def test_embedding_is_the_targets(draft, pair):
    assert draft.model.embed_tokens.weight is pair.target.model.embed_tokens.weight
    assert len(DynamicCache(config=draft.config).layers) == draft.config.num_hidden_layers < 30


@pytest.mark.parametrize("q", [1, 5])
def test_logit_shapes(draft, pair, q):
    ids = ids_of(pair, "Name three colours.")[:, :q]  # [1, q]
    v_r = len(draft.vocab_ids)
    with torch.inference_mode():
        assert draft(input_ids=ids, use_cache=False).logits.shape == (1, q, v_r)
        assert draft(input_ids=ids, logits_to_keep=1).logits.shape == (1, 1, v_r)
        cache = DynamicCache(config=draft.config)
        out = draft(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=0)
        assert out.logits.shape == (1, q, v_r)
        assert cache.get_seq_length() == q
        nxt = draft(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)  # q more on top
        assert nxt.logits.shape == (1, 1, v_r) and cache.get_seq_length() == 2 * q


def test_incremental_equals_full_forward(draft, pair):
    ids = ids_of(pair, "Explain in one sentence why the sky is blue.")  # [1, L]
    with torch.inference_mode():
        full = draft(input_ids=ids, use_cache=False).logits  # [1, L, V_r]
        cache = DynamicCache(config=draft.config)
        parts = [draft(input_ids=ids[:, :10], cache=cache).logits]
        parts += [draft(input_ids=ids[:, t : t + 1], cache=cache).logits for t in range(10, ids.shape[1] - 3)]
        parts.append(draft(input_ids=ids[:, -3:], cache=cache).logits)  # a multi-token step on a cache
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_equals_single_rows(draft, pair):
    rows = [pair.encode("Hi!"), pair.encode("Write a haiku about autumn leaves.")]
    width = max(map(len, rows))
    ids = torch.tensor([[EOS_ID] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.inference_mode():
        batched = draft(
            input_ids=ids, attention_mask=mask, position_ids=pos, cache=DynamicCache(config=draft.config)
        ).logits
        for b, row in enumerate(rows):
            alone = draft(input_ids=torch.tensor([row])).logits[0]
            torch.testing.assert_close(batched[b, width - len(row) :], alone, atol=1e-4, rtol=1e-4)


def test_spec1_with_draft_equals_reference(pair):
    prompts = ["What is the capital of France?", "Write a short poem about the sea."]
    params = SamplingParams(max_new_tokens=24)
    ref = SpecDecoder(pair, method="reference").generate(prompts, params)
    spec = SpecDecoder(pair, method="spec1", k=4, proposer="draft")
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert spec.stats.summary()["mean_accepted"] > 0.2  # a trained draft (an untrained one: ~0.05)


def test_every_method_with_the_draft_equals_reference(pair):
    prompts = ["Name three primary colours.", "Translate 'good morning' into French.", "What is 12 times 7?"]
    params = SamplingParams(max_new_tokens=20)
    ref = [o.token_ids for o in SpecDecoder(pair, method="reference").generate(prompts, params)]
    for method in ("eqspec", "exspec", "ragged"):
        outs = SpecDecoder(pair, method=method, k=3, batch_size=3, proposer="draft").generate(prompts, params)
        assert [o.token_ids for o in outs] == ref, method


def test_reduced_head_samples_its_full_vocabulary_distribution(pair):
    """The 8192-id head picks with the full-vocabulary noise exactly as its distribution over the
    full vocabulary (zero outside its ids) would, and reports its own probability of the pick."""
    from batchspec.core.sampling import RowParams, choose, gumbel, probabilities
    from batchspec.proposers.draft import DraftProposer

    proposer = DraftProposer(pair.draft, pair.vocab_size, pair.draft.vocab_ids)
    logits = torch.randn(3, len(pair.draft.vocab_ids), generator=torch.Generator().manual_seed(0))
    params = RowParams.of([SamplingParams(temperature=0.8, top_p=0.95)] * 3)
    noise = torch.stack([gumbel(seed, 10, pair.vocab_size) for seed in range(3)])
    tokens, confidence = proposer._pick(logits, params, noise)
    full = torch.zeros(3, pair.vocab_size)
    full[:, pair.draft.vocab_ids] = probabilities(logits, params)
    assert tokens.tolist() == choose(full, noise).tolist()
    assert set(tokens.tolist()) <= set(pair.draft.vocab_ids.tolist())
    torch.testing.assert_close(confidence, full.gather(1, tokens[:, None])[:, 0])


def test_default_pair_proposes_lookup_first_with_the_head_and_keeps_the_others(pair):
    # The measured choice (docs/benchmarks.md, "Beam trees", "Widths per depth"): lookup first and the
    # head elsewhere by default in float32 and bfloat16, the others on request.
    assert SpecDecoder(pair, method="eqspec").proposer_name == "ngram+eagle"
    assert SpecDecoder(pair, method="eqspec", proposer="eagle").proposer_name == "eagle"
    assert SpecDecoder(pair, method="eqspec", proposer="ngram").proposer_name == "ngram"
    assert load_pair("default", dtype="bfloat16").default_proposer == "ngram+eagle"
    assert isinstance(SpecDecoder(pair, method="eqspec", proposer="draft").proposer.model, SmolDraft)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_the_shipped_draft_quantized_drafts_exactly(pair, kind):
    quantized = load_pair("default", dtype="float32", draft_quant=kind)
    assert type(quantized.draft.lm_head).__name__ == "QuantLinear"
    assert quantized.draft.lm_head.kind == "int8"  # the head picks the token: int8 under int4 too
    prompts = ["Name three primary colours.", "What is 12 times 7?"]
    params = SamplingParams(max_new_tokens=20)
    ref = [o.token_ids for o in SpecDecoder(pair, method="reference").generate(prompts, params)]
    dec = SpecDecoder(quantized, method="ragged", k=3, batch_size=2, proposer="draft")
    assert [o.token_ids for o in dec.generate(prompts, params)] == ref
    assert dec.stats.summary()["mean_accepted"] > 0.2


def test_a_quantized_draft_that_the_proposer_would_not_run_is_refused(pair):
    """--draft-quant is honoured or refused: a proposer that runs no draft model would ignore it."""
    quantized = load_pair("default", dtype="float32", draft_quant="int8")
    for proposer in (None, "eagle", "ngram", "ngram+eagle"):  # None: the pair's default
        with pytest.raises(BatchspecError, match="--draft-quant int8 quantizes the draft model.*--proposer draft"):
            SpecDecoder(quantized, method="ragged", k=2, proposer=proposer)
    assert SpecDecoder(quantized, method="ragged", k=2, proposer="ngram+draft").proposer_name == "ngram+draft"
