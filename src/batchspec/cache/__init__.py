"""KV caches: the padded layout's buffers, the ragged layout's size-class slabs, the oracle's plain
cache (`kv`, the only module that knows transformers' `Cache` classes), and the prefix cache that
keeps finished requests' entries for later prompts (`prefixes`). Tensors only: no model runs here."""
