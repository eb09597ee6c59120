"""Which models batchspec runs, decided from the config before any weight is read.

Supported: decoder-only causal LMs whose layers attend over all earlier tokens or over a sliding
window of them (Llama, Qwen, SmolLM, Mistral-style, Gemma 3). Refused, by name: layers with other
state (recurrent, linear or chunked attention: realignment and the ragged slots move KV columns,
which only means something where a layer's state is its keys and values), attention logit
soft-capping (Gemma 2) and attention sinks (gpt-oss), which batchspec's attention does not
implement. A GGUF file's architecture is read from its header (`gguf_architecture`: the first
metadata entries, milliseconds; transformers' reader parses the whole file).
"""

from __future__ import annotations

import struct

from ..cache import kv
from ..core.errors import BatchspecError

#: GGUF architectures transformers can load that batchspec cannot run, and why.
GGUF_REFUSED = {
    "mamba": "recurrent state",
    "rwkv6": "recurrent state",
    "rwkv7": "recurrent state",
    "lfm2": "convolution state",
    "gemma2": "soft-capped attention logits",
    "gpt_oss": "attention sinks",
    "t5": "an encoder-decoder",
    "t5encoder": "an encoder",
}
#: Layer kinds batchspec's attention reproduces (transformers' `layer_types` names).
LAYER_KINDS = ("full_attention", "sliding_attention")
#: Model types whose state is not keys and values, though their configs declare no layer types.
RECURRENT = ("rwkv", "xlstm", "mamba", "mamba2", "falcon_mamba")
#: What a refusal of a layer kind says batchspec runs instead.
KINDS_RUN = (
    "batchspec supports full-attention and sliding-window layers only (no recurrent, linear or chunked attention)"
)


def check_config(config, role: str) -> None:
    """Raise BatchspecError naming what batchspec cannot run in this model config."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    name = text.model_type
    if getattr(config, "is_encoder_decoder", False) or getattr(text, "is_encoder_decoder", False):
        raise BatchspecError(f"the {role} model ({config.model_type}) is an encoder-decoder; batchspec runs causal LMs")
    if name in RECURRENT:
        raise BatchspecError(f"the {role} model ({name}) keeps recurrent state; batchspec runs attention models")
    kinds = sorted(set(getattr(text, "layer_types", None) or ()) - set(LAYER_KINDS))
    if kinds or getattr(text, "attention_chunk_size", None) is not None:
        raise BatchspecError(
            f"the {role} model ({name}) has layers of kind {kinds or ['chunked_attention']}; {KINDS_RUN}"
        )
    odd = kv.unsupported_layers(text)
    if odd:
        raise BatchspecError(f"the {role} model ({name}) uses cache layers {sorted(odd)}; {KINDS_RUN}")
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        raise BatchspecError(
            f"the {role} model ({name}) soft-caps its attention logits "
            f"(attn_logit_softcapping={softcap}); batchspec's attention does not implement that"
        )
    if name == "gpt_oss":
        raise BatchspecError(f"the {role} model (gpt_oss) uses attention sinks; batchspec's attention does not")


def check_supported(model, role: str) -> None:
    """check_config on a loaded model."""
    check_config(model.config, role)


def check_gguf(path: str, role: str) -> None:
    """Refuse a GGUF file whose architecture batchspec cannot run, from its header alone."""
    arch = (gguf_architecture(path) or "").replace("-", "_")
    if arch in GGUF_REFUSED:
        raise BatchspecError(
            f"the {role} model ({arch}, {path}) has {GGUF_REFUSED[arch]}; batchspec supports causal LMs "
            "with full-attention and sliding-window layers"
        )


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_architecture(path: str, max_entries: int = 64) -> str | None:
    """`general.architecture` of a GGUF file (versions 2 and 3, little-endian), read from its
    header; None when the file is not such a GGUF, is malformed, or the key is not among its first
    `max_entries` metadata entries (transformers' own load then decides)."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                return None
            version, _tensors, entries = struct.unpack("<IQQ", f.read(20))
            if version not in (2, 3):
                return None
            for _ in range(min(entries, max_entries)):
                key = _string(f)
                (kind,) = struct.unpack("<I", f.read(4))
                if key == "general.architecture" and kind == _STRING:
                    return _string(f)
                _skip(f, kind)
    except (OSError, struct.error, ValueError):
        return None
    return None


#: The longest metadata string read (a key, an architecture name); longer ones mean a malformed file.
MAX_STRING = 1 << 20


def _string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
    if n > MAX_STRING:
        raise ValueError(f"a GGUF string of {n} bytes")
    return f.read(n).decode("utf-8", errors="replace")


def _skip(f, kind: int) -> None:
    """Move past one metadata value of type `kind`."""
    if kind == _STRING:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(n, 1)
    elif kind == _ARRAY:
        inner, count = struct.unpack("<IQ", f.read(12))
        if inner in _SCALARS:
            f.seek(count * struct.calcsize("<" + _SCALARS[inner]), 1)
        else:
            for _ in range(count):
                _skip(f, inner)
    elif kind in _SCALARS:
        f.seek(struct.calcsize("<" + _SCALARS[kind]), 1)
    else:
        raise ValueError(f"unknown GGUF metadata type {kind}")
