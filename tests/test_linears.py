"""linears.py: TunedLinear computes nn.Linear's products in every formulation, for any row count;
tune_linears swaps every linear layer and keeps tied weights tied; oneDNN's packed copies follow
the weights; decoding with each formulation forced equals `reference` for every method."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, random_prompts, reference_tokens
from hypothesis import given
from hypothesis import strategies as st

from batchspec import SamplingParams, SpecDecoder, tiny_pair
from batchspec.models import linears
from batchspec.models.linears import (
    FORMS,
    LARGE,
    TUNE_MAX,
    FormTable,
    TunedLinear,
    bucket,
    onednn_rows,
    prepare,
    project,
    tune_linears,
)

ONEDNN = torch.backends.mkldnn.is_available()
needs_onednn = pytest.mark.skipif(not ONEDNN, reason="this torch build has no oneDNN")
#: float64 where the formulation takes it (oneDNN: float32 and bfloat16 only).
DTYPE = {"plain": torch.float64, "transposed": torch.float64, "onednn": torch.float32}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def forms_here():
    return [f for f in FORMS if f != "onednn" or ONEDNN]


def forced(form: str) -> dict:
    return {m: form for m in [*range(1, TUNE_MAX + 1), LARGE]}


@given(
    rows=st.integers(1, TUNE_MAX + 40),
    lead=st.sampled_from([(), (1,), (2,), (3, 1)]),
    bias=st.booleans(),
    form=st.sampled_from(forms_here()),
    seed=st.integers(0, 1000),
)
def test_tuned_linear_equals_linear(rows, lead, bias, form, seed):
    torch.manual_seed(seed)
    dtype = DTYPE[form]
    layer = torch.nn.Linear(24, 40, bias=bias).to(dtype)
    table = FormTable()
    table.choice = forced(form)
    tuned = TunedLinear(layer, table)
    x = torch.randn(*lead, rows, 24, dtype=dtype)
    with torch.no_grad():
        got = tuned(x)
        assert got.shape == (*lead, rows, 40)
        torch.testing.assert_close(got, layer(x), rtol=TOL[dtype], atol=TOL[dtype])


def test_table_measures_each_row_count_once(monkeypatch):
    layer = torch.nn.Linear(16, 32)
    table = FormTable()
    tuned = TunedLinear(layer, table)
    calls = []
    fastest = FormTable._fastest
    monkeypatch.setattr(FormTable, "_fastest", lambda self, rows: calls.append(rows) or fastest(self, rows))
    with torch.no_grad():
        for rows in (1, 3, 1, 3, 2, TUNE_MAX + 1, TUNE_MAX + 9, 1000):
            tuned(torch.randn(rows, 16))
    assert calls == [1, 3, 2, LARGE]  # above TUNE_MAX: one choice, measured at LARGE rows
    assert set(table.choice.values()) <= set(FORMS) and table.choice[LARGE] != "transposed"


def test_prepare_measures_every_reachable_bucket_once(monkeypatch):
    """Row counts between two measured ones take the next one's choice; `prepare` measures up front
    every bucket a decoder can reach, so no step pays for a measurement."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 16))
    table = tune_linears(model)
    calls = []
    fastest = FormTable._fastest
    monkeypatch.setattr(FormTable, "_fastest", lambda self, rows: calls.append(rows) or fastest(self, rows))
    prepare(model, 9)
    assert calls == [1, 2, 3, 4, 6, 8, 12]
    assert [bucket(r) for r in (5, 9, 11, 13, 17, 25, 32, 33)] == [6, 12, 12, 16, 24, 32, 32, LARGE]
    with torch.no_grad():
        model(torch.randn(9, 16))
    prepare(model, 40)
    assert calls == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, LARGE]
    assert set(table.choice) == set(calls)


def test_forms_that_fail_are_not_chosen():
    """oneDNN takes no float64: the table measures the others."""
    table = FormTable()
    tuned = TunedLinear(torch.nn.Linear(16, 32).double(), table)
    with torch.no_grad():
        tuned(torch.randn(5, 16, dtype=torch.float64))
    assert table.choice[bucket(5)] in ("plain", "transposed") and not table.packed


@needs_onednn
def test_packed_copy_follows_the_weight():
    """A weight changed in place (or given new data) is packed again: no stale product."""
    layer = torch.nn.Linear(16, 32)
    table = FormTable()
    table.choice = forced("onednn")
    tuned = TunedLinear(layer, table)
    x = torch.randn(4, 16)
    with torch.no_grad():
        tuned(x)
        layer.weight.mul_(2.0)
        torch.testing.assert_close(tuned(x), layer(x))
        layer.weight.data = torch.randn(32, 16)
        torch.testing.assert_close(tuned(x), layer(x))


@pytest.mark.parametrize("form", forms_here())
def test_products_autograd_records_take_f_linear(form):
    """Training through a tuned layer gets nn.Linear's gradients, whatever the table picked."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 6)
    table = FormTable()
    table.choice = forced(form)
    x = torch.randn(3, 8)
    project(x, layer.weight, layer.bias, table).square().sum().backward()
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(grad, layer.weight.grad)


def test_tune_swaps_every_linear_and_keeps_ties():
    pair = tiny_pair()  # tiny_pair tunes its models, as load_pair does
    target = pair.target
    assert not [m for m in target.modules() if type(m) is torch.nn.Linear]
    assert isinstance(target.lm_head, TunedLinear)
    layers = [m for m in target.modules() if isinstance(m, TunedLinear) and m is not target.lm_head]
    assert len({id(m.table) for m in layers}) == 1 and len(layers[0].table.layers) == len(layers)
    assert target.lm_head.table is not layers[0].table and target.lm_head.table.layers == [target.lm_head]
    if target.config.tie_word_embeddings:
        assert target.lm_head.weight is target.model.embed_tokens.weight
    assert tune_linears(target) is None  # nothing left to swap


@pytest.mark.parametrize("form", forms_here())
@pytest.mark.parametrize("method", ["ar", "spec1", "eqspec", "exspec", "ragged"])
def test_decoding_with_each_form_equals_reference(form, method, monkeypatch):
    """Every forward's linears in one formulation (whatever the measurement would pick); oneDNN's
    in float32 (it takes no float64), against a reference in that formulation too."""
    dtype = DTYPE[form]
    pair = tiny_pair(dtype=dtype)
    monkeypatch.setenv("BATCHSPEC_CACHE", "off")  # every choice made here, none recalled
    monkeypatch.setattr(linears.FormTable, "_fastest", lambda self, rows: form)
    prompts = random_prompts(4, 6, 1, 40)
    dec = SpecDecoder(pair, method=method, k=3, batch_size=3, check_invariants=True)
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=16))]
    tables = {id(m.table): m.table for m in pair.target.modules() if isinstance(m, TunedLinear)}
    assert all(set(t.choice.values()) == {form} for t in tables.values())
    if form != "onednn":
        monkeypatch.undo()
    assert got == reference_tokens(tiny_pair(dtype=dtype), prompts, 16)


def test_onednn_row_counts_are_few_and_waste_little():
    counts = [onednn_rows(m) for m in range(1, 4097)]
    assert all(m <= c <= max(m, 1.125 * m) for m, c in zip(range(1, 4097), counts))
    assert counts[:TUNE_MAX] == list(range(1, TUNE_MAX + 1)) and len(set(counts)) == 88
    assert all(onednn_rows(c) == c for c in counts)  # a padded count is its own bucket


def test_importing_the_package_raises_onednns_primitive_cache_unless_set():
    """oneDNN's cache of one primitive per shape must hold the decode steps' shapes beside
    prefill's many: the package raises its capacity before oneDNN reads it, unless the user set it."""
    code = "import os, batchspec; print(os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    env["PYTHONPATH"] = os.path.join(ROOT, "src")
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)  # noqa: E731
    assert run(env).stdout.strip() == "8192"
    assert run(env | {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64"}).stdout.strip() == "64"
