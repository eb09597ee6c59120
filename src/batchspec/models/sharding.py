"""A model built in memory, sharded over the tensor-parallel ranks (distributed/tp.py)."""

from __future__ import annotations

import os

from ..distributed import tp
from . import attention


def shard(model, n: int):
    """A model built in memory (the tiny pair), sharded over n ranks: saved to a temporary
    directory and loaded back with its TP plan (transformers applies a plan while loading).
    Every rank writes its own copy (`save_pretrained` writes on rank 0 only)."""
    import tempfile

    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="batchspec-tp-") as folder:
        model.config.to_json_file(os.path.join(folder, "config.json"))
        save_model(model, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
        dtype = next(model.parameters()).dtype
        sharded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **tp.from_pretrained_options(n))
        return attention.install(sharded.eval())
