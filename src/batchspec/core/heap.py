"""Giving freed heap pages back to the operating system, for a long-running server.

A server's KV slabs, prefix-cache entries, prefill caches and activations come and go in sizes
that glibc's malloc serves from its heap arenas; freed, their pages stay with the process (the
arenas fragment), so RSS keeps the high-water of every mix of sizes it has seen. `trim()` asks
glibc to return every whole free page (malloc_trim(0), which also releases pages inside an arena).
Where the C library is not glibc it does nothing. It takes milliseconds on a heap of a few GB;
ctypes releases the GIL meanwhile.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


def trim() -> bool:
    """Return free heap pages to the OS; False where the C library cannot."""
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
