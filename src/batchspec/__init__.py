"""batchspec: batched speculative decoding that emits exactly what the target alone would."""

from .config import EngineConfig, SamplingParams
from .engine import SpecDecoder
from .errors import BatchspecError
from .models import ModelPair, load_pair, tiny_pair
from .sequence import GenerationOutput

__all__ = [
    "BatchspecError",
    "EngineConfig",
    "GenerationOutput",
    "ModelPair",
    "SamplingParams",
    "SpecDecoder",
    "load_pair",
    "tiny_pair",
]
__version__ = "0.1.0"
