"""The EAGLE-style draft head (`--proposer eagle`): exact in every method (greedy, seeded sampling,
any number of drafts per step), its cache rewound to entries computed from the target's true
features (checked after every step), the feature store, the shipped weights, the errors."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import decode_checked, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st
from test_speculation import RandomK

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.core.errors import BatchspecError
from batchspec.engine.invariants import InvariantError
from batchspec.models.eagle import EAGLE_FILE, load_head
from batchspec.models.forward import shifted
from batchspec.proposers.features import Features

METHODS = ("spec1", "eqspec", "exspec", "ragged")


@pytest.fixture(scope="module")
def one_layer():
    """A 1-layer tiny pair: its head (tiny.tiny_head) predicts the target's features closely, so
    steps accept anything from no draft to all of them."""
    return tiny_pair(layers=1, dtype=torch.float64)


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 7),
    batch=st.integers(1, 5),
    k=st.integers(1, 6),
    method=st.sampled_from(METHODS),
)
def test_head_equals_reference(one_layer, seed, n, batch, k, method):
    prompts = random_prompts(seed, n, 1, 48)
    params = SamplingParams(max_new_tokens=24)
    got, stats = decode_checked(one_layer, prompts, params, method=method, batch_size=batch, k=k)
    assert got == reference_tokens(one_layer, prompts, 24)


@pytest.fixture(scope="module")
def fused():
    """The 1-layer tiny pair with a head that also reads layer 0's output (fused features)."""
    from batchspec.models.tiny import tiny_head

    pair = tiny_pair(layers=1, dtype=torch.float64)
    pair.head = tiny_head(pair.target, aux_layers=(0,), feature_mix=0.05)
    return pair


@given(
    seed=st.integers(0, 10**6),
    batch=st.integers(1, 4),
    k=st.integers(1, 5),
    method=st.sampled_from(METHODS),
    proposer=st.sampled_from(("eagle", "ngram+eagle")),
    branches=st.sampled_from((1, 3)),
)
def test_fused_head_equals_reference(fused, seed, batch, k, method, proposer, branches):
    """Fused features travel through every target forward (chains and trees) and are checked."""
    prompts = random_prompts(seed, 4, 1, 40)
    params = SamplingParams(max_new_tokens=20)
    config = {"method": method, "batch_size": batch, "k": k, "branches": branches}
    got, _ = decode_checked(fused, prompts, params, proposer=proposer, **config)
    assert got == reference_tokens(fused, prompts, 20)


def test_fused_features_are_read(fused, monkeypatch):
    """The aux blocks matter: a store that zeroes them changes the head's cache (caught), and the
    features carry the final hidden state first, then layer 0's output with unit RMS."""
    from batchspec.models.forward import reference_features

    ids = torch.tensor([[5, 9, 17, 2]])
    feats = reference_features(fused.target, ids, fused.head.aux)
    hidden = fused.target.get_decoder()(input_ids=ids).last_hidden_state
    width = fused.target.config.hidden_size
    assert feats.shape == (1, 4, 2 * width) and torch.equal(feats[..., :width], hidden)
    assert torch.allclose(feats[..., width:].pow(2).mean(-1), torch.ones(1, 4, dtype=feats.dtype), atol=1e-4)
    read = Features.read

    def without_aux(self, seqs, positions, dtype):
        out = read(self, seqs, positions, dtype)
        out[..., width:] = 0
        return out

    monkeypatch.setattr(Features, "read", without_aux)
    with pytest.raises(InvariantError, match="draft row"):
        decode_checked(fused, random_prompts(1, 3, 5, 20), SamplingParams(max_new_tokens=12), method="ragged", k=3)


def test_head_accepts_drafts(one_layer):
    """The property test above covers acceptance: this head accepts some drafts, not all."""
    prompts = random_prompts(3, 6, 1, 40)
    _, stats = decode_checked(one_layer, prompts, SamplingParams(max_new_tokens=32), method="ragged", batch_size=3, k=4)
    hist = stats.summary()["accepted_histogram"]
    assert int(hist.get("0", hist.get(0, 0))) > 0 and int(hist.get("4", hist.get(4, 0))) > 0, hist


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS), batch=st.integers(1, 4))
def test_any_choice_of_k_per_step_equals_reference(one_layer, seed, method, batch):
    """Plain steps (the head lags and catches up), early stops, verify widths: all exact."""
    prompts = random_prompts(seed, 5, 1, 40)
    params = SamplingParams(max_new_tokens=24)
    got, _ = decode_checked(one_layer, prompts, params, policy=RandomK(seed), method=method, batch_size=batch, k=5)
    assert got == reference_tokens(one_layer, prompts, 24)


@pytest.mark.parametrize("branches", [1, 3, (3, 1)])  # 3, 3x1: draft trees (tree.py)
@pytest.mark.parametrize("method", METHODS)
def test_seeded_sampling_equals_reference(one_layer, method, branches):
    prompts = random_prompts(8, 5, 1, 30)
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_new_tokens=20) for s in range(5)]
    ref = [o.token_ids for o in SpecDecoder(one_layer, method="reference").generate(prompts, params)]
    for k in (3, "auto"):
        got, _ = decode_checked(one_layer, prompts, params, method=method, batch_size=3, k=k, branches=branches)
        assert got == ref


def test_two_layer_target_and_auto(tiny64):
    """The default tiny pair's head (a poor predictor of a 2-layer target) with `-k auto`."""
    prompts = random_prompts(5, 6, 1, 60)
    got, _ = decode_checked(tiny64, prompts, SamplingParams(max_new_tokens=16), method="ragged", batch_size=4, k="auto")
    assert got == reference_tokens(tiny64, prompts, 16)


def test_checker_sees_a_head_fed_the_wrong_features(one_layer, monkeypatch):
    """Features one position stale (f(t - 2) instead of f(t - 1)) change the head's cache: the
    invariant checker must say so (outputs stay exact: the head only proposes)."""
    read = Features.read

    def stale(self, seqs, positions, dtype):
        return read(self, seqs, positions - 1, dtype)

    monkeypatch.setattr(Features, "read", stale)
    with pytest.raises(InvariantError, match="draft row"):
        decode_checked(one_layer, random_prompts(1, 3, 5, 20), SamplingParams(max_new_tokens=12), method="ragged", k=3)


def test_checker_sees_drafted_entries_kept(one_layer, monkeypatch):
    """Without the rewind, entries computed from predicted features stay cached: caught."""
    from batchspec.layouts.ragged import RaggedBatch

    monkeypatch.setattr(RaggedBatch, "rewind", lambda self, role, mark: None)
    with pytest.raises(InvariantError, match="draft row"):
        decode_checked(one_layer, random_prompts(2, 3, 5, 20), SamplingParams(max_new_tokens=16), method="ragged", k=4)


def test_features_store_positions_and_pads():
    store = Features(2)
    seqs = [object.__new__(type("S", (), {})) for _ in range(2)]
    # row 0: two left pads then positions 0..2; row 1: positions 3..7 (a later chunk)
    pos = torch.tensor([[0, 0, 0, 1, 2], [3, 4, 5, 6, 7]])
    hidden = torch.arange(10, dtype=torch.float32).reshape(2, 5, 1).expand(2, 5, 2).clone()
    store.write(seqs, pos, hidden)
    got = store.read(seqs, torch.tensor([[0, 1, 2, 3], [5, 6, 7, 8]]), torch.float32)[..., 0]
    assert got[0].tolist() == [0, 2, 3, 4]  # f(-1) = 0, then f(0..2): the real columns, not the pads
    assert got[1].tolist() == [6, 7, 8, 9]  # f(4) .. f(7)


def test_shifted():
    f = torch.arange(6.0).reshape(1, 3, 2)
    assert shifted(f).tolist() == [[[0, 0], [0, 1], [2, 3]]]


def test_save_and_load_keep_the_head(one_layer, tmp_path):
    from batchspec.models.eagle import save_head

    head = one_layer.head
    path = str(tmp_path / "head.safetensors")
    save_head(head, {"note": "test"}, path)
    from safetensors.torch import load_file

    state = load_file(path)
    assert "model.embed_tokens.weight" not in state and "head" not in state
    again = load_head(one_layer.target, path=path)  # in the target's dtype (float64 here)
    ids = torch.tensor([[1, 2, 3, 4]])
    seeded = torch.Generator().manual_seed(0)  # bf16 storage: an unseeded draw once fell outside the bound
    feats = torch.randn(1, 4, head.config.hidden_size, dtype=torch.float64, generator=seeded)
    a, b = head(ids, feats).logits, again(ids, feats).logits
    assert torch.allclose(a, b, atol=5e-2), (a - b).abs().max()  # bf16 storage


def test_save_and_load_keep_a_fused_head(fused, tmp_path):
    from batchspec.models.eagle import save_head

    path = str(tmp_path / "fused.safetensors")
    save_head(fused.head, {"note": "test"}, path)
    again = load_head(fused.target, path=path)
    assert again.aux == (0,) and again.feature_size == fused.head.feature_size
    ids = torch.tensor([[1, 2, 3, 4]])
    seeded = torch.Generator().manual_seed(0)  # bf16 storage: an unseeded draw once gave 0.053
    feats = torch.randn(1, 4, fused.head.feature_size, dtype=torch.float64, generator=seeded)
    a, b = fused.head(ids, feats).logits, again(ids, feats).logits
    assert torch.allclose(a, b, atol=5e-2), (a - b).abs().max()


def test_refused_where_it_cannot_run(one_layer, tiny64):
    with pytest.raises(BatchspecError, match="cannot run the draft head"):
        SpecDecoder(one_layer, method="bsp", proposer="eagle", k=2)
    pair = tiny_pair()
    pair.head = None
    with pytest.raises(BatchspecError, match="no draft head"):
        SpecDecoder(pair, method="ragged", proposer="eagle", k=2)


PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a short poem about a lighthouse keeper.",
    "List three uses of a paper clip and explain each one.",
    "Translate into French: The weather is nice today and we are going to the beach.",
]


def test_shipped_head_on_the_default_pair(default_pair):
    """The shipped weights: small, offline, and exact with the padded and ragged layouts."""
    assert os.path.getsize(EAGLE_FILE) <= 25 * 2**20
    head = load_head(default_pair.target)
    assert head.head.shape == (len(head.vocab_ids), default_pair.target.config.hidden_size)
    ref = reference_tokens(default_pair, [default_pair.encode(p) for p in PROMPTS], 14)
    # The layouts' invariants (a fresh prefill a step) are checked on the tiny pairs.
    for method in ("eqspec", "ragged"):
        dec = SpecDecoder(default_pair, method=method, proposer="eagle", k=4, batch_size=4)
        got = [o.token_ids for o in dec.generate(PROMPTS, SamplingParams(max_new_tokens=14))]
        assert got == ref, method
        assert dec.stats.summary()["mean_tokens_per_step"] > 1.2  # it drafts useful tokens
