"""The batch-invariant mode (models/invariant.py): proof at the op level (each op the mode provides
or relies on gives a row the same bits alone and inside any batch) and end to end (every method
equals the reference token for token and logprob for logprob, in bfloat16 and float32)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import NEEDS_ONEDNN_BF16, onednn_packs_bfloat16, random_prompts
from hypothesis import given, settings
from hypothesis import strategies as st

from batchspec import EngineConfig, SamplingParams, SpecDecoder, tiny_pair
from batchspec.cache import kv
from batchspec.cli import main
from batchspec.core.errors import BatchspecError
from batchspec.models import attention as plain_attention
from batchspec.models import invariant
from batchspec.models.linears import FormTable

DTYPES = (torch.float32, pytest.param(torch.bfloat16, marks=NEEDS_ONEDNN_BF16))


# --- op level ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("features", [(16, 17), (64, 320), (128, 64), (96, 256), (1536, 576), (2048, 128)])
def test_linear_rows_do_not_depend_on_the_row_count(dtype, features):
    """The mode's linear form: row i of M rows == row i alone, for M = 2..64 and beyond."""
    fan_in, fan_out = features
    gen = torch.Generator().manual_seed(fan_in)
    weight = (torch.randn(fan_out, fan_in, generator=gen) * 0.1).to(dtype)
    bias = torch.randn(fan_out, generator=gen).to(dtype)
    linear = invariant.linear_form(FormTable())
    x = torch.randn(300, fan_in, generator=gen).to(dtype)
    alone = torch.cat([linear(x[i : i + 1], weight, bias) for i in range(300)])
    for rows in [*range(2, 65), 100, 257, 300]:
        assert torch.equal(linear(x[:rows], weight, bias), alone[:rows]), rows


def _qkv(gen, heads, kv_heads, span, dim, dtype):
    q = torch.randn(1, heads, span, dim, generator=gen).to(dtype)
    k = torch.randn(1, kv_heads, span, dim, generator=gen).to(dtype)
    v = torch.randn(1, kv_heads, span, dim, generator=gen).to(dtype)
    return q, k, v


def _alone(q, k, v, pos):
    """Query at position pos over keys 0..pos, as plain decoding computes it (no mask, one query)."""
    plan = invariant.plan_for(None, 1, 1, pos + 1)
    return invariant.attend(q[:, :, pos : pos + 1], k[:, :, : pos + 1], v[:, :, : pos + 1], plan, 0.25)[0, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 16), (9, 3, 64)])
def test_attention_chains_and_padding_equal_each_query_alone(dtype, heads, kv_heads, dim):
    """q = 1..9 queries per row, rows left-padded by different amounts (holes of masked keys) in one
    batch, spans across block boundaries (63, 64, 65, 128, ...): each query's output == alone."""
    gen = torch.Generator().manual_seed(dim)
    span = 300
    q, k, v = _qkv(gen, heads, kv_heads, span, dim, dtype)
    alone = {p: _alone(q, k, v, p) for p in range(span)}
    rng = random.Random(dim)
    for n_q in range(1, 10):
        ends = [rng.choice([1, 63, 64, 65, 127, 128, 129, 200, span]) for _ in range(3)]
        ends = [max(e, n_q) for e in ends]
        pads = [rng.randrange(0, 70) for _ in ends]
        holes = [rng.randrange(0, 3) for _ in ends]  # masked keys inside the row, as rejected drafts leave
        width = max(p + e + h for p, e, h in zip(pads, ends, holes))
        rows_q, rows_k, rows_v, masks = [], [], [], []
        for end, hole in zip(ends, holes):  # the row's left padding: width minus its keys and hole
            keep = list(range(end))
            cols = torch.full((width,), -1)
            at = width - (end + hole)  # right-aligned, `hole` masked columns before the last n_q keys
            first = end - n_q
            positions = list(range(at, at + first)) + list(range(at + first + hole, width))
            cols[positions] = torch.tensor(keep)
            kk = torch.zeros(1, kv_heads, width, dim, dtype=dtype)
            vv = torch.full((1, kv_heads, width, dim), 7.0, dtype=dtype)  # masked keys' values: anything finite
            valid = cols >= 0
            kk[:, :, valid], vv[:, :, valid] = k[:, :, cols[valid]], v[:, :, cols[valid]]
            qq = q[:, :, first:end]
            mask = torch.zeros(n_q, width, dtype=torch.bool)
            for i in range(n_q):
                mask[i] = valid & (cols <= first + i)
            rows_q.append(qq), rows_k.append(kk), rows_v.append(vv), masks.append(mask)
        mask = torch.stack(masks)[:, None]
        plan = invariant.plan_for(mask, len(ends), n_q, width)
        out = invariant.attend(torch.cat(rows_q), torch.cat(rows_k), torch.cat(rows_v), plan, 0.25)
        for b, end in enumerate(ends):
            for i in range(n_q):
                assert torch.equal(out[b, i], alone[end - n_q + i]), (n_q, end, i)


@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_tree_queries_equal_their_path_alone(dtype):
    """A tree's node attends the prefix and its ancestors (not its siblings): it equals the query
    at its depth's position over prefix + path, computed alone."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim = 4, 2, 16
    for prefix in (1, 60, 64, 70, 127):
        parents = [-1, -1, 0, 0, 1, 2, 4]  # node -> parent (-1: the last committed token)
        n = len(parents)
        q, k, v = _qkv(gen, heads, kv_heads, prefix + n, dim, dtype)
        mask = torch.zeros(n, prefix + n, dtype=torch.bool)
        paths = []
        for node in range(n):
            path, at = [], node
            while at >= 0:
                path.insert(0, at)
                at = parents[at]
            paths.append(path)
            mask[node, :prefix] = True
            mask[node, [prefix + p for p in path]] = True
        plan = invariant.plan_for(mask[None, None], 1, n, prefix + n)
        out = invariant.attend(q[:, :, prefix:], k, v, plan, 0.25)
        for node, path in enumerate(paths):
            cols = list(range(prefix)) + [prefix + p for p in path]
            pos = len(cols) - 1
            qq = torch.zeros_like(q[:, :, : pos + 1])
            qq[:, :, pos] = q[:, :, prefix + node]
            want = _alone(qq, k[:, :, cols], v[:, :, cols], pos)
            assert torch.equal(out[0, node], want), (prefix, node)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_spans_and_prefill_chunks(dtype):
    """Spans up to 2,048: a prefill in chunks (any chunking) gives each query the bits of the query
    alone."""
    gen = torch.Generator().manual_seed(9)
    span = 2048
    q, k, v = _qkv(gen, 4, 2, span, 16, dtype)
    probe = [0, 63, 64, 1000, 2046, 2047]
    alone = {p: _alone(q, k, v, p) for p in probe}
    for chunk in (2048, 700, 64, 5):
        for start in range(0, span, chunk):
            end = min(span, start + chunk)
            wanted = [p for p in probe if start <= p < end]
            if not wanted:
                continue
            plan = invariant.plan_for(None, 1, end - start, end)
            out = invariant.attend(q[:, :, start:end], k[:, :, :end], v[:, :, :end], plan, 0.25)
            for p in wanted:
                assert torch.equal(out[0, p - start], alone[p]), (chunk, p)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_local_ops_the_mode_relies_on(dtype):
    """RMS norm, SiLU, exp, the rotary table: a row's result alone == inside M rows."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(300, 576, generator=gen).to(dtype)
    ops = {
        "rms": lambda t: t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype),
        "silu": F.silu,
        "exp": torch.exp,
    }
    for name, op in ops.items():
        alone = torch.cat([op(x[i : i + 1]) for i in range(300)])
        for rows in (2, 3, 5, 16, 33, 100, 300):
            assert torch.equal(op(x[:rows]), alone[:rows]), (name, rows)
    pair = tiny_pair(dtype=dtype)
    invariant.install(pair.target)
    rotary = pair.target.model.rotary_emb
    positions = torch.tensor([[5, 900, 64, 3000]])
    cos, sin = rotary(x[:1, :16], positions)
    for j in range(4):
        one_cos, one_sin = rotary(x[:1, :16], positions[:, j : j + 1])
        assert torch.equal(cos[:, j], one_cos[:, 0]) and torch.equal(sin[:, j], one_sin[:, 0])


# --- end to end ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=DTYPES, ids=["float32", "bfloat16"])
def mode_pair(request):
    pair = tiny_pair(dtype=request.param)
    invariant.install(pair.target)
    return pair


def _outputs(pair, prompts, params, **config):
    dec = SpecDecoder(pair, EngineConfig(batch_invariant=True, **config))
    return dec.generate(prompts, params)


@settings(max_examples=10)
@given(
    seed=st.integers(0, 10**6),
    method=st.sampled_from(["eqspec", "exspec", "ragged"]),
    batch=st.integers(1, 9),
    k=st.sampled_from([1, 2, 4, 6, "auto"]),
    branches=st.sampled_from([1, 1, 2, (3, 2, 1)]),
)
def test_every_method_equals_the_reference_under_the_mode(mode_pair, seed, method, batch, k, branches):
    """Tokens and logprobs bit-equal to the reference, in the pair's dtype (bfloat16 included)."""
    if method != "ragged" or k == "auto":
        branches = 1
    prompts = random_prompts(seed, 6, 1, 100)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True, logprobs=2)
    ref = [_outputs(mode_pair, [p], params, method="reference")[0] for p in prompts]
    config = dict(method=method, batch_size=batch, k=k, branches=branches, proposer="eagle")
    got = _outputs(mode_pair, prompts, params, **config)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert [e.logprob for e in g.logprobs] == [e.logprob for e in r.logprobs]
        assert [e.top for e in g.logprobs] == [e.top for e in r.logprobs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_several_size_classes_read_in_place(dtype):
    """The ragged layout's rows in several size classes (slots.RowParts: 256, 512, 1024 slots), each
    attended over its own slab, its float32 entries read in place: bit-equal to the reference."""
    pair = tiny_pair(dtype=dtype)
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (12, 300, 40, 700, 3, 250)]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True, logprobs=1)
    ref = [_outputs(pair, [p], params, method="reference")[0] for p in prompts]
    dec = SpecDecoder(pair, EngineConfig(batch_invariant=True, method="ragged", batch_size=6, k=3))
    got = dec.generate(prompts, params)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert [e.logprob for e in g.logprobs] == [e.logprob for e in r.logprobs]


@NEEDS_ONEDNN_BF16
def test_seeded_sampling_is_the_same_alone_and_in_any_batch():
    pair = tiny_pair(dtype=torch.bfloat16)
    prompts = random_prompts(77, 7, 1, 60)
    params = [SamplingParams(max_new_tokens=20, temperature=0.9, seed=100 + i, ignore_eos=True) for i in range(7)]
    alone = [_outputs(pair, [p], [s], method="reference")[0].token_ids for p, s in zip(prompts, params)]
    for method, batch in (("ragged", 7), ("ragged", 3), ("eqspec", 4)):
        got = [o.token_ids for o in _outputs(pair, prompts, params, method=method, batch_size=batch, k=3)]
        assert got == alone, (method, batch)


@NEEDS_ONEDNN_BF16
def test_install_and_uninstall():
    pair = tiny_pair(dtype=torch.bfloat16)
    target = pair.target
    rotary = target.model.rotary_emb
    SpecDecoder(pair, batch_invariant=True)
    assert invariant.installed(target) and "forward" in vars(rotary)
    assert all(m.table.fixed is not None for m in target.modules() if hasattr(m, "table"))
    assert kv.entry_dtype(target) == torch.float32  # float32 entries, read in place
    SpecDecoder(pair, batch_invariant=None)  # None leaves the model as it is
    assert invariant.installed(target)
    SpecDecoder(pair, batch_invariant=False)
    assert not invariant.installed(target) and "forward" not in vars(rotary)
    assert target.config._attn_implementation == plain_attention.NAME
    assert all(m.table.fixed is None for m in target.modules() if hasattr(m, "table"))
    assert kv.entry_dtype(target) == torch.bfloat16


def test_bfloat16_under_the_mode_runs_or_is_refused_by_name():
    """Where oneDNN packs bfloat16 weights the mode installs; elsewhere (an AVX2 CPU) it is refused
    with the reason, never run with other kernels."""
    pair = tiny_pair(dtype=torch.bfloat16)
    if onednn_packs_bfloat16():
        SpecDecoder(pair, batch_invariant=True)
        assert invariant.installed(pair.target)
    else:
        with pytest.raises(BatchspecError, match="needs oneDNN's matmul in torch.bfloat16 on this CPU"):
            SpecDecoder(pair, batch_invariant=True)
        assert not invariant.installed(pair.target)


def test_refusals(capsys):
    with pytest.raises(BatchspecError, match="batch_invariant"):
        EngineConfig(batch_invariant="yes")
    meta = tiny_pair().target.to("meta")
    with pytest.raises(BatchspecError, match="CPUs only"):
        invariant.install(meta)
    untuned = tiny_pair().target
    untuned.lm_head = torch.nn.Linear(64, 320, bias=False)
    with pytest.raises(BatchspecError, match="linear layers tuned"):
        invariant.install(untuned)
    assert main(["generate", "--pair", "tiny", "--tp", "2", "--batch-invariant", "hi"]) == 2
    assert "--tp" in capsys.readouterr().err
    assert main(["verify", "--pair", "tiny", "--batch-invariant", "off,on"]) == 2
    assert "one -k, --branches and --batch-invariant" in capsys.readouterr().err
    assert main(["bench", "--pair", "tiny", "--batch-invariant", "maybe"]) == 2
    assert "off, on or off,on" in capsys.readouterr().err


@NEEDS_ONEDNN_BF16
def test_verify_cli_reports_zero_logprob_difference(tmp_path, capsys):
    out = tmp_path / "v.json"
    args = ["verify", "--pair", "tiny", "--dtype", "bfloat16", "--batch-invariant", "--methods", "ragged,exspec"]
    assert main([*args, "--batch-sizes", "1,5", "--max-new-tokens", "16", "--quiet", "--json", str(out)]) == 0
    import json

    runs = json.loads(out.read_text())["runs"]
    assert all(r["exact_match"] == 1.0 and r["max_logprob_diff"] == 0.0 and r["batch_invariant"] for r in runs)


@NEEDS_ONEDNN_BF16
def test_bench_runs_both_modes_paired(tmp_path, capsys):
    """bench --batch-invariant off,on: every method in both modes, each on-run with its paired
    ratio to the off-run of the same repeat; the model is left in the last run's mode."""
    import json

    out = tmp_path / "b.json"
    args = ["bench", "--pair", "tiny", "--dtype", "bfloat16", "--methods", "ar,ragged", "--batch-sizes", "2"]
    extra = ["-k", "3", "--max-new-tokens", "8", "--repeats", "2", "--quiet", "--limit", "2", "--json", str(out)]
    assert main([*args, "--batch-invariant", "off,on", *extra]) == 0
    text = capsys.readouterr().out
    assert "(--batch-invariant): " in text and "x the same run with plain kernels" in text
    assert "* = under --batch-invariant" in text
    runs = json.loads(out.read_text())["runs"]
    assert sorted((r["method"], r["batch_invariant"]) for r in runs) == [
        ("ar", False),
        ("ar", True),
        ("ragged", False),
        ("ragged", True),
    ]
    for r in runs:
        if r["batch_invariant"]:
            assert len(r["vs_mode_off_repeats"]) == 2 and r["vs_mode_off_paired"] > 0
