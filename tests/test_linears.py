"""linears.py: TunedLinear computes nn.Linear's products in either formulation, for any row count;
tune_linears swaps every linear layer and keeps tied weights tied; decoding with each
formulation forced equals `reference` for every method."""

from __future__ import annotations

import pytest
import torch
from helpers import random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder, linears, tiny_pair
from batchspec.linears import FORMS, TUNE_MAX, FormTable, TunedLinear, tune_linears


@given(
    rows=st.integers(1, TUNE_MAX + 8),
    lead=st.sampled_from([(), (1,), (2,), (3, 1)]),
    bias=st.booleans(),
    form=st.sampled_from(sorted(FORMS)),
    seed=st.integers(0, 1000),
)
def test_tuned_linear_equals_linear(rows, lead, bias, form, seed):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(24, 40, bias=bias).double()
    table = FormTable()
    table.choice = {m: form for m in range(1, TUNE_MAX + 1)}
    tuned = TunedLinear(layer, table)
    x = torch.randn(*lead, rows, 24, dtype=torch.float64)
    got = tuned(x)
    assert got.shape == (*lead, rows, 40)
    torch.testing.assert_close(got, layer(x), rtol=1e-12, atol=1e-12)


def test_table_measures_each_row_count_once(monkeypatch):
    layer = torch.nn.Linear(16, 32)
    table = FormTable()
    tuned = TunedLinear(layer, table)
    calls = []
    fastest = FormTable._fastest
    monkeypatch.setattr(FormTable, "_fastest", lambda self, rows: calls.append(rows) or fastest(self, rows))
    for rows in (1, 3, 1, 3, 2, TUNE_MAX + 1):
        tuned(torch.randn(rows, 16))
    assert calls == [1, 3, 2]  # above TUNE_MAX: F.linear, unmeasured
    assert set(table.choice.values()) <= set(FORMS)


def test_tune_swaps_every_linear_and_keeps_ties():
    pair = tiny_pair()  # tiny_pair tunes its models, as load_pair does
    target = pair.target
    assert not [m for m in target.modules() if type(m) is torch.nn.Linear]
    assert isinstance(target.lm_head, TunedLinear)
    layers = [m for m in target.modules() if isinstance(m, TunedLinear)]
    assert len({id(m.table) for m in layers}) == 1 and len(layers[0].table.layers) == len(layers)
    if target.config.tie_word_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight
    assert tune_linears(target) is None  # nothing left to swap


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("method", ["ar", "spec1", "eqspec", "exspec", "ragged"])
def test_decoding_with_each_form_equals_reference(form, method, monkeypatch):
    """Every forward's linears in one formulation (whatever the measurement would pick)."""
    pair = tiny_pair(dtype=torch.float64)
    monkeypatch.setattr(linears.FormTable, "_fastest", lambda self, rows: form)
    prompts = random_prompts(4, 6, 1, 40)
    dec = SpecDecoder(pair, method=method, k=3, batch_size=3, check_invariants=True)
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=16))]
    tables = {id(m.table): m.table for m in pair.target.modules() if isinstance(m, TunedLinear)}
    assert all(set(t.choice.values()) == {form} for t in tables.values())
    monkeypatch.undo()
    assert got == reference_tokens(tiny_pair(dtype=torch.float64), prompts, 16)
