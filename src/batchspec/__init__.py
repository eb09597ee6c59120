"""batchspec: batched speculative decoding that emits exactly what the target alone would."""

import gc
import os

# oneDNN (linears.py) caches one primitive per matmul shape, 1,024 by default: prefill's many row
# counts evicted the decode steps' shapes, whose primitives were then rebuilt every step (bfloat16,
# B = 16: 23% of the throughput; docs/benchmarks.md). Read when oneDNN first builds one. Row counts
# are bucketed (linears.onednn_rows), so the cache stays well below this, at its steady size early.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

# The imports below (torch, its compiler, transformers) build about a million objects that live as long
# as the process: the collections they would set off midway only scan them (0.3-0.9 s of a start).
_collecting = gc.isenabled()
gc.disable()
try:
    from .core import __version__
    from .core.config import EngineConfig, SamplingParams
    from .core.errors import BatchspecError
    from .core.sequence import GenerationOutput
    from .decoder import SpecDecoder
    from .models.pair import ModelPair, load_pair, tiny_pair
finally:
    if _collecting:
        gc.enable()

__all__ = [
    "__version__",
    "BatchspecError",
    "EngineConfig",
    "GenerationOutput",
    "ModelPair",
    "SamplingParams",
    "SpecDecoder",
    "load_pair",
    "tiny_pair",
]
