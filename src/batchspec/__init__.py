"""batchspec: batched speculative decoding that emits exactly what the target alone would."""

import os

# oneDNN (linears.py) caches one primitive per matmul shape, 1,024 by default: prefill's many row
# counts evicted the decode steps' shapes, whose primitives were then rebuilt every step (bfloat16,
# B = 16: 23% of the throughput; docs/benchmarks.md). Read when oneDNN first builds one. Row counts
# are bucketed (linears.onednn_rows), so the cache stays well below this, at its steady size early.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")

from .core import __version__
from .core.config import EngineConfig, SamplingParams
from .core.errors import BatchspecError
from .core.sequence import GenerationOutput
from .decoder import SpecDecoder
from .models.pair import ModelPair, load_pair, tiny_pair

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
