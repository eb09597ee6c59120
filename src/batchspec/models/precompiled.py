"""Compiled graphs kept on disk whole, so a start does not trace the model again.

inductor's own cache keeps the generated code, but every process still runs dynamo over the 30
layers of each graph and builds its guards (about 2.3 s a trace on 2 cores, 18-23 s for a start's
graphs). `Graph` compiles a `LeanStack` ahead of its first call instead (`aot_compile`, on that
call's inputs) and keeps the result in the tuning cache (`graphs/`); a later start loads it without
tracing.

Invariants:
- an artifact is found only under the full key it was made with: the machine and versions (the
  C++ was built for this CPU), the stack's structure, parameter shapes and dtypes, the product
  form and slots (the slot numbers are constants in the graph: a stack whose layers hold other
  slots is a miss, never a call of another model's products), and whether the graph is the
  one-token one; the weights are inputs, not constants, so they are not in the key;
- anything that fails here (an artifact that does not load, a compiler that cannot save, guards
  that refuse the inputs) falls back to the lazily compiled stack (`torch.compile`), once, with a
  one-line warning: never a wrong graph, never a stop.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch

from ..core import diskcache

KIND = "graphs"
ISA_KIND = "vector-isas"  # the verdict of inductor's check of them (trust_vector_isas)
#: The guard failure of an artifact whose inputs differ from the ones it was compiled for.
GUARD_FAILURE = "GuardManager check failed"


def key(stack: torch.nn.Module, one: bool, backend: str) -> dict:
    """Everything a saved graph of `stack` depends on but its weights."""
    params = [(n, list(p.shape), str(p.dtype), p.device.type) for n, p in stack.named_parameters()]
    params += [(n, list(b.shape), str(b.dtype), b.device.type) for n, b in stack.named_buffers()]
    config = stack.layers[0].attn[0].config
    return {
        "machine": diskcache.machine(),
        "structure": diskcache.digest(repr(stack)),
        "config": diskcache.digest(config.to_dict()),
        "params": diskcache.digest(params),
        "form": stack.form,
        "slots": [getattr(p, "batchspec_slot", None) for layer in stack.layers for p in layer.children()],
        "one_token": one,
        "backend": backend,
        "grad": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
    }


class Graph:
    """`stack`'s compiled forward for one kind of call (one token, or two and more): loaded from
    the tuning cache, else compiled ahead on the first call's inputs and saved there; a lazily
    compiled stack where either fails."""

    def __init__(self, stack: torch.nn.Module, one: bool, backend: str, lazy: Callable[[], Callable]):
        self.stack, self.one, self.backend, self.lazy = stack, one, backend, lazy
        self.fn: Callable | None = None
        self.loaded = False  # whether it came from disk

    def __call__(self, *args):
        if self.fn is None:
            self.fn = self._made(args)
        try:
            return self.fn(*args)
        except RuntimeError as err:
            if GUARD_FAILURE not in str(err):
                raise
            diskcache.warn_once(f"a saved compiled graph refused this forward's inputs; tracing it again ({err})")
            self.fn = self.lazy()
            return self.fn(*args)

    def _made(self, args) -> Callable:
        found = key(self.stack, self.one, self.backend)
        data = diskcache.read_bytes(KIND, found)
        if data is not None:
            try:
                fn = torch.compiler.load_compiled_function(io.BytesIO(data))
                self.loaded = True
                return lambda *a: fn(self.stack, *a)
            except Exception as err:  # noqa: BLE001 - a cache that does not load is remade
                diskcache.warn_once(f"ignoring a saved compiled graph that does not load ({type(err).__name__})")
        if diskcache.root() is None:
            return self.lazy()
        try:
            example = tuple(a.clone() for a in args)
            if not self.one:
                for a in example:
                    torch._dynamo.mark_dynamic(a, 1)  # the example has N >= 2: the graph serves N >= 2
            compiled = torch.compile(self.stack, backend=self.backend, fullgraph=True).forward.aot_compile(
                (example, {})
            )
            diskcache.write_bytes(KIND, found, type(compiled).serialize(compiled).serialized_data)
        except Exception as err:  # noqa: BLE001 - ahead-of-time compiling is experimental in torch
            diskcache.warn_once(f"compiling ahead of time failed ({type(err).__name__}: {err}); compiling lazily")
            return self.lazy()
        return lambda *a: compiled(self.stack, *a)


def trust_vector_isas() -> None:
    """inductor checks each vector ISA the CPU's flags claim by building a library with it and
    loading that in a child process, once a process (ten children, about 1.3 s of a start on 2
    cores). Where an earlier start on this machine, with this C++ compiler, found every claimed ISA
    good (its verdict kept in the tuning cache), they are trusted without the check; else the check
    runs and its verdict is kept. A setting of the user's (`TORCHINDUCTOR_VEC_ISA_OK`) is left alone,
    and without a cache the check runs as inductor runs it."""
    from torch._inductor import config, cpp_builder, cpu_vec_isa

    if config.cpp.vec_isa_ok is not None or diskcache.root() is None:
        return
    compiler = cpp_builder.get_cpp_compiler()
    found = {
        "machine": diskcache.machine(),
        "compiler": compiler,
        "version": cpp_builder.get_compiler_version_info(compiler),
        "what": "inductor's vector ISAs all load",
    }
    if diskcache.read(ISA_KIND, found) is True:
        config.cpp.vec_isa_ok = True
        return
    valid = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # the check, cached for the process
    config.cpp.vec_isa_ok = True
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    claimed = [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]  # what the flags claim
    config.cpp.vec_isa_ok = None
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    diskcache.write(ISA_KIND, found, valid == claimed)
