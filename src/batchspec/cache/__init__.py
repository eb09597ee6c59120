"""KV caches: the padded layout's buffers and the oracle's plain cache (`kv`), the ragged layout's
size-class slabs (`slots`) — the only modules that know transformers' `Cache` classes — and the
prefix cache that keeps finished requests' entries for later prompts (`prefixes`). Tensors only:
no model runs here."""
