"""Shared fixtures: the tiny pair (float64 for exact-equality property tests, float32 for the
rest), a draft-equals-target tiny pair, and the default pair; the hypothesis profiles.
(Decoding shortcuts, random prompts and the memoised reference are in helpers.py.)

Why float64 for the property tests: in float32 a batched or multi-token forward differs from the
one-token reference by ~1e-6 in the logits, and the tiny model's top-2 logit gap falls below that
about once in 10^5-10^6 tokens. Property tests decode ~10^5 tokens, so float32 would make them
flaky on near-ties that are not bugs (the verifier explains those). float64 removes near-ties
while keeping every synchronization bug visible. Fixed float32 cases are tested too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings

from batchspec import load_pair, tiny_pair

# Two workers (pytest-xdist, as pyproject's addopts run it) take a core each; one process takes both.
_THREADS = "1" if "PYTEST_XDIST_WORKER" in os.environ else "2"
torch.set_num_threads(int(os.environ.get("BATCHSPEC_TEST_THREADS", _THREADS)))

# One disk cache for the session (diskcache.py), shared with the processes the tests start, and
# removed at the end: the tests neither read nor fill the user's cache.
_CACHE = tempfile.mkdtemp(prefix="batchspec-test-cache-")
os.environ["BATCHSPEC_CACHE"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

# The default pair's target runs eager in the suite (a compile costs it ~20-45 s a process);
# tests/test_compiled.py compiles tiny models and says so explicitly.
os.environ["BATCHSPEC_COMPILE"] = "off"

# "ci" (the default): 12 fixed examples a property (the suite's time on 2 cores); "dev": 60 fresh ones.
settings.register_profile(
    "ci", max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def tiny64():
    return tiny_pair(dtype=torch.float64)


@pytest.fixture(scope="session")
def tiny32():
    return tiny_pair(dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_same():
    """Draft identical to the target: every draft is accepted."""
    return tiny_pair(dtype=torch.float64, noise=0.0)


@pytest.fixture(scope="session")
def default_pair():
    """The built-in default pair (SmolLM2-135M-Instruct + shipped draft), float32, loaded once."""
    return load_pair("default", dtype="float32")
