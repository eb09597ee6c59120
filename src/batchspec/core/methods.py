"""The one table of decoding methods: name -> runner, and what each method is.

Everything that lists or branches on methods (config validation, the CLI's choices, bench,
the speed-of-light model, the engine) reads `METHODS`. Adding a method is one entry here plus
its runner, a function `run(ctx, seqs, config) -> None` that decodes `seqs` in place.

Runners are named as "module:function" and imported on first use, so this module imports
nothing from the package and every module may import it (no cycles).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from .errors import BatchspecError


@dataclass(frozen=True)
class Method:
    """A decoding method. `speculative`: uses a proposer and k. `batched`: runs several rows per
    forward (otherwise one sequence at a time, reported at batch size 1). `admits_rows`: can take
    new sequences into a running batch (continuous batching). `broken`: a deliberate
    reproduction of a published bug, for `verify` to catch; never for generation. `serves`: the
    online engine (the server) can run it."""

    name: str
    runner: str  # "module:function" inside the package
    summary: str
    speculative: bool
    batched: bool
    admits_rows: bool = False
    broken: bool = False
    serves: bool = False  # runs in the online engine (`batchspec serve`)

    def run(self) -> Callable:
        """The runner function: (ctx, seqs, EngineConfig) -> None."""
        module, function = self.runner.split(":")
        return getattr(importlib.import_module(f"batchspec.{module}"), function)


_TABLE = (
    Method("reference", "runners.reference:run", "the target alone, one sequence at a time: the oracle", False, False),
    Method(
        "ar",
        "runners.ragged:run",
        "plain batched decoding: the ragged layout's continuous batching, no speculation",
        False,
        True,
        True,
    ),
    Method("spec1", "runners.static:run_spec1", "speculative decoding one sequence at a time", True, False),
    Method(
        "eqspec", "runners.static:run_eqspec", "padded batch, unpad-append-repad realignment every step", True, True
    ),
    Method("exspec", "runners.exspec:run", "sliding pool of same-length groups, EQSPEC fallback", True, True, True),
    Method(
        "ragged",
        "runners.ragged:run",
        "per-row cache offsets, no realignment, continuous admission",
        True,
        True,
        True,
        serves=True,
    ),
    Method(
        "bsp",
        "runners.baselines:run_bsp",
        "BROKEN: holes in the mask, positions from padded columns",
        True,
        True,
        False,
        True,
    ),
    Method(
        "dsd", "runners.baselines:run_dsd", "BROKEN: keeps the draft's token at a mismatch", True, True, False, True
    ),
)
METHODS: dict[str, Method] = {m.name: m for m in _TABLE}

#: The fastest correct method measured (docs/benchmarks.md); the CLI's and the API's default.
DEFAULT_METHOD = "ragged"
#: The baselines speedups are quoted against: plain batched decoding at the same batch size, and
#: speculative decoding one sequence at a time (the paper's baseline).
PLAIN_BASELINE, SPEC_BASELINE = "ar", "spec1"


def names(include_broken: bool = True) -> list[str]:
    """Method names in table order."""
    return [m.name for m in _TABLE if include_broken or not m.broken]


def get(name: str) -> Method:
    """The method called `name`; a clear error for an unknown one."""
    if name not in METHODS:
        raise BatchspecError(f"unknown method {name!r}; choose one of {', '.join(METHODS)}")
    return METHODS[name]
