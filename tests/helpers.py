"""Helpers shared by the tests (decoding shortcuts, random prompts, a memoised reference)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys

import pytest
import torch

from batchspec import SamplingParams, SpecDecoder


def random_prompts(seed: int, n: int, lo: int = 1, hi: int = 64, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def decode_checked(pair, prompts, params, proposer: str = "eagle", policy=None, **config):
    """(token ids per prompt, stats) of one decoder with the invariant checker on; `policy`
    replaces its speculation policy (how many drafts each step verifies)."""
    dec = SpecDecoder(pair, proposer=proposer, check_invariants=True, **config)
    if policy is not None:
        dec.speculation = policy
    return [o.token_ids for o in dec.generate(prompts, params)], dec.stats


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(name: str, *args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run scripts/<name> (a tool) or experiments/<name> (a measurement) with this checkout's
    package, offline; assert it exits 0."""
    src = os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    script = os.path.join(ROOT, "scripts", name)
    if not os.path.exists(script):
        script = os.path.join(ROOT, "experiments", name)
    run = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run


_REFERENCE: dict[int, tuple] = {}  # id(pair) -> (pair, {key: tokens}); holding the pair keeps its id unique


def assert_drafted_exactly(pair, oracle, seed: int, method: str, branches, new_tokens: int = 12, **config) -> None:
    """Four random prompts decoded by `method` on `pair` (trees only where the ragged layout verifies
    them) equal `oracle`'s reference tokens."""
    prompts = random_prompts(seed, 4, 1, 40)
    dec = SpecDecoder(pair, method=method, branches=branches if method == "ragged" else 1, **config)
    got = [o.token_ids for o in dec.generate(prompts, SamplingParams(max_new_tokens=new_tokens))]
    assert got == reference_tokens(oracle, prompts, new_tokens)


def reference_tokens(pair, prompts, max_new_tokens: int) -> list[list[int]]:
    """Greedy reference outputs, memoised per (pair, eos, prompt, max_new_tokens)."""
    dec = SpecDecoder(pair, method="reference")
    memo = _REFERENCE.setdefault(id(pair), (pair, {}))[1]
    out = []
    for prompt in prompts:
        key = (pair.eos_ids, tuple(prompt), max_new_tokens)
        if key not in memo:
            memo[key] = dec.generate([prompt], SamplingParams(max_new_tokens=max_new_tokens))[0].token_ids
        out.append(memo[key])
    return out


def decode(pair, prompts, max_new_tokens: int, **config) -> list[list[int]]:
    config.setdefault("check_invariants", False)
    dec = SpecDecoder(pair, **config)
    outs = dec.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    assert [o.index for o in outs] == list(range(len(prompts)))
    return [o.token_ids for o in outs]


@contextlib.contextmanager
def one_thread():
    """torch on one thread for a while: a tiny model gains nothing from threads, and loses much on
    a busy machine (each tensor-parallel rank and each replica runs on one thread too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def onednn_packs_bfloat16() -> bool:
    """Whether oneDNN packs bfloat16 weights on this CPU (it needs AVX-512 or AVX-NE-CONVERT): the
    batch-invariant mode's bfloat16 products are oneDNN's, and the mode refuses a CPU without it."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except (RuntimeError, NotImplementedError):
        return False
    return True


#: Tests of the batch-invariant mode in bfloat16 run where oneDNN can; elsewhere the mode's refusal
#: is what is tested (test_invariant.py::test_bfloat16_under_the_mode_runs_or_is_refused_by_name).
NEEDS_ONEDNN_BF16 = pytest.mark.skipif(
    not onednn_packs_bfloat16(), reason="oneDNN packs no bfloat16 weights on this CPU: the mode refuses it"
)
