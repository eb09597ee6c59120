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
    "lfm2": "convolution state",
    "gemma2": "soft-capped attention logits",
    "gpt_oss": "attention sinks",
    "t5": "an encoder-decoder",
    "umt5": "an encoder-decoder",
}


def check_config(config, role: str) -> None:
    """Raise BatchspecError naming what batchspec cannot run in this model config."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(text, "is_encoder_decoder", False):
        raise BatchspecError(f"the {role} model ({text.model_type}) is an encoder-decoder; batchspec runs causal LMs")
    odd = kv.unsupported_layers(text)
    if odd:
        raise BatchspecError(
            f"the {role} model ({text.model_type}) uses cache layers {sorted(odd)}; batchspec supports "
            "full-attention and sliding-window layers only (no recurrent, linear or chunked attention)"
        )
    softcap = getattr(text, "attn_logit_softcapping", None)
    if softcap is not None:
        raise BatchspecError(
            f"the {role} model ({text.model_type}) soft-caps its attention logits "
            f"(attn_logit_softcapping={softcap}); batchspec's attention does not implement that"
        )
    if text.model_type == "gpt_oss":
        raise BatchspecError(f"the {role} model (gpt_oss) uses attention sinks; batchspec's attention does not")


def check_supported(model, role: str) -> None:
    """check_config on a loaded model."""
    check_config(model.config, role)


def check_gguf(path: str, role: str) -> None:
    """Refuse a GGUF file whose architecture batchspec cannot run, from its header alone."""
    arch = gguf_architecture(path)
    if arch in GGUF_REFUSED:
        raise BatchspecError(
            f"the {role} model ({arch}, {path}) has {GGUF_REFUSED[arch]}; batchspec supports causal LMs "
            "with full-attention and sliding-window layers"
        )


_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_architecture(path: str, max_entries: int = 64) -> str | None:
    """`general.architecture` of a GGUF file (versions 2 and 3), read from its header; None when
    the file is not GGUF or the key is not among its first `max_entries` metadata entries."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            return None
        _version, _tensors, entries = struct.unpack("<IQQ", f.read(20))
        for _ in range(min(entries, max_entries)):
            key = _string(f)
            (kind,) = struct.unpack("<I", f.read(4))
            if key == "general.architecture" and kind == _STRING:
                return _string(f)
            _skip(f, kind)
    return None


def _string(f) -> str:
    (n,) = struct.unpack("<Q", f.read(8))
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
