"""Reading a GGUF once while transformers converts it.

transformers parses a GGUF's header (its vocabulary and merges included) once for the tokenizer,
once for the config and once for the weights, about 4 s each for a 49k-token vocabulary on 2
cores, and rebuilds gguf's tensor-name map for every module it maps (18 ms each, about 400 times
for a 30-layer model). Within `reading_once`, a file's reader and a tensor-name map are each made
once and shared: the same objects transformers would have made, so the same weights, config and
tokenizer come out (tests/test_diskcache.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def reading_once() -> Iterator[None]:
    """Within: `gguf.GGUFReader(path)` returns one reader per path and `gguf.get_tensor_name_map`
    one map per (arch, layers). Where gguf lacks either name, it is left as it is."""
    import gguf

    patches = []
    if hasattr(gguf, "GGUFReader"):
        readers: dict[tuple, object] = {}
        make = gguf.GGUFReader

        def reader(path, *args, **kwargs):
            key = (str(path), args, tuple(sorted(kwargs.items())))
            if key not in readers:
                readers[key] = make(path, *args, **kwargs)
            return readers[key]

        patches.append(mock.patch.object(gguf, "GGUFReader", reader))
    if hasattr(gguf, "get_tensor_name_map"):
        patches.append(
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=8)(gguf.get_tensor_name_map))
        )
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield
