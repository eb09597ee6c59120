"""Constrained output (core/grammar.py): rows with a grammar, mixed with free rows in any batch,
equal the masked `reference` token for token for every method, k, proposer and tree, greedy and
seeded sampling, in float64, float32 and (under the batch-invariant mode) bfloat16; the grammar
state holds the committed tokens only after every step (the invariant checker replays it);
outputs follow their grammar; bad grammars get a clear error."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch
from helpers import NEEDS_ONEDNN_BF16, random_prompts
from hypothesis import given
from hypothesis import strategies as st
from test_speculation import RandomK

from batchspec import BatchspecError, SamplingParams, SpecDecoder, tiny_pair
from batchspec.core import grammar
from batchspec.engine.verify import _tree_paths
from batchspec.proposers.draft import DraftProposer

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "colour", "tags", "ok"],
    "additionalProperties": False,
}
#: A grammar of each kind (None: a free row), all with choices the model's logits decide.
CONSTRAINTS = [
    None,
    {"regex": r"[a-f0-9]{2,12}(-[a-f0-9]{1,6})?"},
    {"regex": r"(yes|no|maybe)"},
    {"json_schema": SCHEMA},
    {"grammar": 'start: "(" item (", " item)* ")"\nitem: /[0-9]{1,3}/ | "x"'},
]
METHODS = ("spec1", "eqspec", "exspec", "ragged")
PROPOSERS = ("draft", "ngram", "eagle", "ngram+draft", "ngram+eagle")


def _params(seed: int, n: int, new: int, sampled: bool) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        constraint = rng.choice(CONSTRAINTS) or {}
        noise = {"temperature": 0.9, "seed": seed + i} if sampled and rng.random() < 0.7 else {}
        out.append(SamplingParams(max_new_tokens=new, **constraint, **noise))
    return out


def _tokens(pair, prompts, params, **config):
    dec = SpecDecoder(pair, check_invariants=config.pop("check", True), **config)
    return [o.token_ids for o in dec.generate(prompts, params)], dec


@pytest.fixture(scope="module")
def one_layer():
    return tiny_pair(layers=1, dtype=torch.float64)


@given(
    seed=st.integers(0, 10**6),
    n=st.integers(1, 6),
    batch=st.integers(1, 5),
    k=st.sampled_from([1, 2, 4, "auto"]),
    method=st.sampled_from(METHODS),
    proposer=st.sampled_from(PROPOSERS),
    sampled=st.booleans(),
)
def test_mixed_batches_equal_the_masked_reference(one_layer, seed, n, batch, k, method, proposer, sampled):
    prompts = random_prompts(seed, n, 1, 30)
    params = _params(seed, n, 20, sampled)
    want, _ = _tokens(one_layer, prompts, params, method="reference", check=False)
    got, _ = _tokens(one_layer, prompts, params, method=method, batch_size=batch, k=k, proposer=proposer)
    assert got == want


@given(seed=st.integers(0, 10**6), proposer=st.sampled_from(["draft", "eagle", "ngram+eagle"]), sampled=st.booleans())
def test_draft_trees_equal_the_masked_reference(one_layer, seed, proposer, sampled):
    prompts = random_prompts(seed, 5, 1, 30)
    params = _params(seed, 5, 20, sampled)
    want, _ = _tokens(one_layer, prompts, params, method="reference", check=False)
    got, _ = _tokens(one_layer, prompts, params, method="ragged", batch_size=3, k=3, proposer=proposer, branches=(3, 2))
    assert got == want


@pytest.mark.parametrize("proposer", ["draft", "eagle"])
def test_a_draft_trees_nodes_follow_their_rows_grammar(one_layer, monkeypatch, proposer):
    """A constrained row's draft tree holds, at each depth, the tokens its grammar allows after
    each node's ancestry before any it refuses: the drafter's logits at every fed node are masked
    (grammar.TreeGuide), so a refused token is drafted only where fewer tokens are allowed than
    the depth has nodes (its score is -inf, last). Unmasked, refused tokens come first at random."""
    seen = []
    drafted = DraftProposer._propose_tree

    def spy(self, batch, *args, **kw):
        proposal = drafted(self, batch, *args, **kw)
        depths = proposal.tree.depth().tolist()
        for seq, nodes, parent in zip(batch.seqs, proposal.nodes.tolist(), proposal.tree.parent.tolist()):
            m, flags = seq.matcher, {}
            for depth, path in zip(depths, _tree_paths(nodes, parent)[1:] if m is not None else ()):
                if m.valid(path[:-1]) == len(path) - 1 and not m.eos.intersection(path[:-1]):
                    flags.setdefault(depth, []).append(m.valid(path) == len(path))
            seen.extend(flags.values())
        return proposal

    monkeypatch.setattr(DraftProposer, "_propose_tree", spy)
    prompts = random_prompts(5, 4, 1, 30)
    params = [SamplingParams(max_new_tokens=16, **c) for c in (CONSTRAINTS[1], CONSTRAINTS[3], CONSTRAINTS[4], {})]
    want, _ = _tokens(one_layer, prompts, params, method="reference", check=False)
    got, _ = _tokens(one_layer, prompts, params, method="ragged", batch_size=4, k=3, proposer=proposer, branches=(3, 2))
    assert got == want
    assert sum(map(sum, seen)) > 50  # allowed nodes drafted
    assert all(flags == sorted(flags, reverse=True) for flags in seen)


@given(seed=st.integers(0, 10**6), method=st.sampled_from(METHODS), proposer=st.sampled_from(PROPOSERS))
def test_any_choice_of_k_per_step_equals_the_masked_reference(one_layer, seed, method, proposer):
    prompts = random_prompts(seed, 5, 1, 30)
    params = _params(seed, 5, 20, sampled=False)
    want, _ = _tokens(one_layer, prompts, params, method="reference", check=False)
    dec = SpecDecoder(one_layer, method=method, batch_size=3, k=4, proposer=proposer, check_invariants=True)
    dec.speculation = RandomK(seed, k_max=4)
    assert [o.token_ids for o in dec.generate(prompts, params)] == want


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NEEDS_ONEDNN_BF16)])
def test_exact_in_float32_and_in_bfloat16_under_the_batch_invariant_mode(dtype):
    pair = tiny_pair(dtype=dtype)
    prompts = random_prompts(3, 6, 1, 30)
    params = _params(3, 6, 24, sampled=True)
    invariant = dtype == torch.bfloat16 or None
    want, _ = _tokens(pair, prompts, params, method="reference", check=False, batch_invariant=invariant)
    got, _ = _tokens(pair, prompts, params, method="ragged", batch_size=6, k=3, check=False, batch_invariant=invariant)
    assert got == want


def test_outputs_follow_their_grammar(one_layer):
    prompts = random_prompts(9, 12, 1, 30)
    params = [SamplingParams(max_new_tokens=160, **(CONSTRAINTS[1 + i % 4])) for i in range(12)]
    outs = SpecDecoder(one_layer, method="ragged", batch_size=4, k=3).generate(prompts, params)
    ended = 0
    for out, p in zip(outs, params):
        text = out.text
        if out.finish_reason != "stop":
            continue
        ended += 1
        if p.regex is not None:
            assert re.fullmatch(p.regex, text), text
        elif p.json_schema is not None:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(r"\((([0-9]{1,3}|x)(, )?)+\)", text), text
    assert ended >= 6  # most end inside 160 tokens: EOS is allowed where the grammar accepts


def test_speculative_paths_leave_the_state_unchanged(one_layer):
    """along, forced and the drafter's guide consume and roll back; the state (consumed tokens and
    the mask) is the same afterwards, also across an EOS at the grammar's end."""
    m = one_layer.matcher(SamplingParams(json_schema=SCHEMA))
    tok = one_layer.tokenizer
    text = tok('{"id": 12, "colour": "red", "tags": [], "ok": true}', add_special_tokens=False)["input_ids"]
    eos = next(iter(one_layer.eos_ids))
    for cut in (0, 3, 10, len(text)):
        m.advance(text[len(m.tokens) : cut])
        before = m.mask()
        masks = m.along([text[cut:][:i] for i in range(len(text) - cut + 1)] + [text[cut:] + [eos]])
        assert masks.shape[0] == len(text) - cut + 2
        m.forced(8)
        guide = grammar.DraftGuide([type("Row", (), {"matcher": m})()])
        for token in (text[cut:] + [eos])[:5]:
            guide.advance(torch.tensor([token]))
        guide.close()
        assert m.tokens == text[:cut] and torch.equal(m.mask(), before)
    assert grammar.allowed(m.mask(), one_layer.vocab_size).nonzero().flatten().tolist() == [eos]


@given(seed=st.integers(0, 10_000), cut=st.integers(0, 40), spoil=st.booleans())
def test_batched_chain_masks_equal_each_row_walked_alone(one_layer, seed, cut, spoil):
    """chain_masks (one llguidance call for the batch) gives what Matcher.along gives each row over
    its chain's prefixes: also past a refused draft, across an EOS, at the grammar's end, for free
    rows; and it leaves every state as it was."""
    rng = random.Random(seed)
    tok, eos = one_layer.tokenizer, next(iter(one_layer.eos_ids))
    texts = ['{"id": 12, "colour": "red", "tags": ["ab"], "ok": true}', "3f9a-0b", "maybe", "(12, x, 7)"]
    rows, chains = [], []
    for constraint, text in zip(CONSTRAINTS[1:], [texts[1], texts[2], texts[0], texts[3]]):
        if rng.random() < 0.25:
            rows.append(type("Row", (), {"matcher": None})())
            chains.append([rng.randrange(100) for _ in range(rng.randrange(5))])
            continue
        m = one_layer.matcher(SamplingParams(**constraint))
        ids = tok(text, add_special_tokens=False)["input_ids"] + [eos]
        start = min(cut, len(ids) - 1)
        m.advance(ids[: rng.randint(0, start)])
        chain = ids[len(m.tokens) :][: rng.randrange(8)]
        if spoil and chain:
            chain[rng.randrange(len(chain))] = rng.randrange(one_layer.vocab_size)
        rows.append(type("Row", (), {"matcher": m})())
        chains.append(chain)
    if all(r.matcher is None for r in rows):
        assert grammar.chain_masks(rows, chains) is None
        return
    before = [(list(r.matcher.tokens), r.matcher.mask()) for r in rows if r.matcher is not None]
    batched = grammar.chain_masks(rows, chains)
    paths = [[chain[:i] for i in range(len(chain) + 1)] for chain in chains]
    assert torch.equal(batched, grammar.row_masks(rows, paths))
    after = [(list(r.matcher.tokens), r.matcher.mask()) for r in rows if r.matcher is not None]
    assert all(a[0] == b[0] and torch.equal(a[1], b[1]) for a, b in zip(before, after))


@given(st.lists(st.integers(0, 99), max_size=3), st.integers(1, 100))
def test_the_one_allowed_token_is_read_from_its_word(tokens, vocab):
    bits = torch.zeros(4, dtype=torch.int32)
    for t in tokens:
        bits[t // 32] |= torch.tensor(1 << (t % 32)).to(torch.int32)  # bit 31: a negative word
    ids = grammar.allowed(bits, vocab).nonzero().flatten().tolist()
    assert grammar.only(bits, vocab) == (ids[0] if len(ids) == 1 and len(set(tokens)) == 1 else None)


def test_forced_tokens_are_the_fixed_keys(one_layer):
    m = one_layer.matcher(SamplingParams(json_schema=SCHEMA))
    m.advance(one_layer.tokenizer("{", add_special_tokens=False)["input_ids"])
    assert one_layer.tokenizer.decode(m.forced(20)) == '"id": '  # the key and its layout, then a number


def test_apply_masks_disallowed_tokens_only():
    logits = torch.randn(2, 3, 70)
    bits = torch.full((2, 3, 3), -1, dtype=torch.int32)
    bits[1, 2] = torch.tensor([0b101, 0, -(1 << 31)], dtype=torch.int32)  # tokens 0, 2 and 95 (beyond V)
    out = grammar.apply(logits, bits)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[1, :2], logits[1, :2])
    assert torch.isfinite(out[1, 2]).nonzero().flatten().tolist() == [0, 2]


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"json_schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, "strin"),
        ({"json_schema": {"type": "string", "format": "weird"}}, "format"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: item\n"}, "item"),
    ],
)
def test_an_invalid_grammar_names_the_problem(one_layer, kw, message):
    with pytest.raises(BatchspecError, match=f"(?s)invalid .*{message}"):
        SpecDecoder(one_layer, method="ragged").generate([[1, 2]], SamplingParams(**kw))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"regex": "a", "grammar": "start: /a/"}, "at most one"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": [1]}, "JSON object"),
        ({"regex": ""}, "non-empty"),
        ({"regex": "a+", "ignore_eos": True}, "ignore_eos"),
    ],
)
def test_bad_constraint_parameters_are_refused_where_written(kw, message):
    with pytest.raises(BatchspecError, match=message):
        SamplingParams(**kw)


def test_a_pair_without_tokenizer_refuses_a_grammar():
    pair = tiny_pair(vocab_size=64)
    with pytest.raises(BatchspecError, match="no tokenizer"):
        SpecDecoder(pair).generate([[1, 2]], SamplingParams(regex="a+"))


def test_compiled_grammars_are_cached_and_bounded(one_layer):
    compiler = grammar.Compiler(one_layer.tokenizer, one_layer.vocab_size, one_layer.eos_ids, cache_size=2)
    specs = [grammar.Grammar.of("regex", f"a{{{i}}}") for i in range(1, 4)]
    first = compiler.matcher(specs[0])
    assert compiler.matcher(specs[0])._start is first._start  # compiled once
    compiler.matcher(specs[1])
    compiler.matcher(specs[2])
    assert list(compiler._compiled) == specs[1:]


@pytest.mark.parametrize("proposer", ["ngram", "eagle", "ngram+draft", "draft"])
def test_jump_forward_drafts_the_forced_keys_and_counts_them(one_layer, proposer):
    prompts = random_prompts(4, 4, 1, 30)
    params = [SamplingParams(max_new_tokens=40, json_schema=SCHEMA)] * 4
    want, _ = _tokens(one_layer, prompts, params, method="reference", check=False)
    got, dec = _tokens(one_layer, prompts, params, method="ragged", batch_size=4, k=4, proposer=proposer)
    assert got == want
    forced = dec.stats.summary()["forced_tokens"]
    if proposer == "draft":  # its cache keeps its drafts: they are masked, and start with the forced run
        assert forced == 0 and dec.stats.summary()["mean_accepted"] > 1
    elif proposer == "ngram+draft":  # the masked draft model proposes most forced runs itself
        assert forced >= 1 and "jump-forward" in dec.stats.line()
    else:
        assert forced >= 4 * 4 and "jump-forward" in dec.stats.line()  # '"id": ' at least, per row
