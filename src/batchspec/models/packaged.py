"""Frozen graphs (`--max-autotune`) compiled ahead of time into packages kept on disk, so a later
start loads them instead of tracing the model again.

A frozen graph (compiled.py: the weights constants of the graph, the products inductor's own C++
GEMM kernels over packed copies of them) cannot be kept by torch's whole-graph precompile
(precompiled.py: it refuses freezing), and inductor's own cache keeps only its generated code: a
start still ran dynamo, AOT autograd and the freezing passes over the 30 layers of each graph
(75 s on 2 cores for the default target's two graphs). `Packaged` exports the graph's stack once
(`torch.export`, the token count symbolic where the graph serves two and more) and compiles it with
AOTInductor into a package (a shared library holding the kernels and the frozen, packed weights)
kept in the tuning cache (`packages/`); a later start loads it in about 1.5 s a graph.

Invariants:
- a package is found only under the full key it was made with (stored with it and compared on
  load, diskcache.complete): precompiled.key's (machine, versions, structure, shapes, slots, one-token or not), the
  digest of the weights it holds (compiled.CompiledDecoder.weights_tag, taken when the weights
  were frozen) and the compile options; a model of the same shapes but other weights never loads
  another's package, and one that does not load is made again;
- the package computes what the frozen graph computes (the same lowering and the same tuned
  kernels); attention and the caches stay the engine's (`batchspec::attend`, called back from the
  library), so layouts, masks, trees and riders are unchanged;
- anything that fails here (export, compile, a package that does not load) falls back to the
  lazily compiled frozen graph, once, with a one-line warning: never a wrong graph, never a stop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from ..core import diskcache
from . import precompiled

KIND = "packages"
FILE = "graph.pt2"
#: The frozen weights beside the library in the package, not linked into it (a shared library's
#: data section does not take a 1B-class model's weights; linking them took longer).
PACKAGING = {
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
}


def key(stack: torch.nn.Module, one: bool, tag: str, options: dict) -> dict:
    """Everything a package of `stack`'s frozen graph depends on, its weights (`tag`) included."""
    options = options | PACKAGING
    return precompiled.key(stack, one, "aoti") | {"weights": tag, "options": options, "torch": torch.__version__}


def cached(stack: torch.nn.Module, one: bool, tag: str, options: dict) -> bool:
    """Whether a package of `stack`'s frozen graph (`key`) is in the tuning cache."""
    found = key(stack, one, tag, options)
    return diskcache.complete(KIND, _name(found), found) is not None


def _name(found: dict) -> str:
    return diskcache.digest(found)[:32]


class Packaged:
    """`stack`'s frozen graph for one kind of call (one token, or two and more): a package loaded
    from the tuning cache, else exported and compiled on the first call's inputs and kept there;
    `lazy()` (the frozen graph under torch.compile) where either fails or there is no cache."""

    def __init__(self, stack: torch.nn.Module, one: bool, tag: str, options: dict, lazy: Callable[[], Callable]):
        self.stack, self.one, self.tag, self.options, self.lazy = stack, one, tag, options, lazy
        self.fn: Callable | None = None
        self.source = None  # "loaded" from disk, "made" now, or "lazy" (the fallback), once called

    def __call__(self, *args):
        if self.fn is None:
            self.fn = self._made(args)
        return self.fn(*args)

    def _made(self, args) -> Callable:
        found = key(self.stack, self.one, self.tag, self.options)
        name = _name(found)
        folder = diskcache.complete(KIND, name, found)
        if folder is not None:
            try:
                runner = _load(folder)
                self.source = "loaded"
                return runner
            except Exception as err:  # noqa: BLE001 - a package that does not load is made again
                diskcache.warn_once(f"making again a saved compiled package that does not load ({type(err).__name__})")
                diskcache.discard(KIND, name)
        self.source = "lazy"
        if diskcache.root() is None:
            return self.lazy()
        try:
            folder = diskcache.directory(KIND, name, lambda tmp: self._package(args, tmp), key=found)
            if folder is None:
                return self.lazy()
            runner = _load(folder)
        except Exception as err:  # noqa: BLE001 - exporting and AOTInductor are experimental in torch
            diskcache.warn_once(f"packaging a compiled graph failed ({type(err).__name__}: {err}); compiling lazily")
            return self.lazy()
        self.source = "made"
        return runner

    def _package(self, args, folder: Path) -> None:
        """Export the stack on `args` (ids [1, N], cos and sin [K, N, D]) and compile it into `folder`.
        A compiler's OSError is not the cache's: raised as a RuntimeError."""
        dims = None
        if not self.one:  # the graph serves N >= 2 tokens, a rider's included
            n = torch.export.Dim("tokens", min=2)
            dims = ({1: n}, {1: n}, {1: n})
        example = tuple(a.clone() for a in args)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # export's notes on transformers' modules
                program = torch.export.export(self.stack, example, dynamic_shapes=dims, strict=False)
                torch._inductor.aoti_compile_and_package(
                    program, package_path=str(folder / FILE), inductor_configs=self.options | PACKAGING
                )
        except OSError as err:
            raise RuntimeError(f"{type(err).__name__}: {err}") from err


def _load(folder: Path) -> Callable:
    """The package in `folder` as a function of the graph's inputs."""
    return torch._inductor.aoti_load_package(str(folder / FILE))
