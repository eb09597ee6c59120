"""The shipped draft model for SmolLM2-135M-Instruct (the `default` pair's target).

`SmolDraft` is a few Llama decoder layers (same shapes as the target's) that read the target's own
token embedding and end in a reduced-vocabulary head: `lm_head` scores only the V_r most frequent
tokens, and `vocab_ids[i]` is the full-vocabulary id of head row i (the `DraftProposer` maps its
picks back through it). A draft forward therefore costs a few layers plus a V_r x 576 matmul,
a few per cent of a target forward.

Weights live in `weights/smollm2_draft.safetensors` (layers, final norm, head, vocab_ids; bf16);
the embedding is not stored: `load_default_draft` shares the target's matrix. Hyper-parameters and
training metadata are in `weights/smollm2_draft.json`. `python scripts/train_draft` produces both.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaModel
from transformers.initialization import no_init_weights
from transformers.modeling_outputs import CausalLMOutputWithPast

WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights")
DRAFT_FILE = os.path.join(WEIGHTS_DIR, "smollm2_draft.safetensors")
META_FILE = os.path.join(WEIGHTS_DIR, "smollm2_draft.json")
EMBED_KEY = "model.embed_tokens.weight"  # never stored: the target's matrix is shared at load time


def draft_config(target_config: LlamaConfig, num_layers: int) -> LlamaConfig:
    """The target's config with `num_layers` decoder layers (and no quantisation info)."""
    values = target_config.to_dict()
    values.pop("quantization_config", None)
    values.pop("_name_or_path", None)
    values.pop("_model_name_or_path", None)
    values["num_hidden_layers"] = num_layers
    config = LlamaConfig(**values)
    config._attn_implementation = getattr(target_config, "_attn_implementation", None) or "sdpa"
    return config


class SmolDraft(torch.nn.Module):
    """N Llama layers over the target's embedding, with a head over `vocab_ids` only.

    Called like a Hugging Face causal LM: `model(input_ids, attention_mask, position_ids, cache,
    use_cache, logits_to_keep)` -> `.logits` [B, q, V_r] ([B, 1, V_r] for logits_to_keep=1).
    """

    def __init__(self, config: LlamaConfig, vocab_ids: torch.Tensor):
        super().__init__()
        self.config = config  # num_hidden_layers = N: a cache for this config has N layers
        self.model = LlamaModel(config)  # embed_tokens [V, H] is replaced by the target's at load
        self.lm_head = torch.nn.Linear(config.hidden_size, len(vocab_ids), bias=False)  # [V_r, H]
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())  # [V_r]

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """What it computes in: its norms' dtype (its linear layers may be quantized, quant.py)."""
        return self.model.norm.weight.dtype

    def get_output_embeddings(self) -> torch.nn.Module:
        """The LM head (over `vocab_ids`), as transformers' models name it (quant.py keeps it int8)."""
        return self.lm_head

    def tie_embedding(self, embedding: torch.nn.Parameter) -> None:
        """Use `embedding` ([V, H], the target's input embedding) as this model's input embedding."""
        if tuple(embedding.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"embedding shape {tuple(embedding.shape)} does not match the draft config")
        self.model.embed_tokens.weight = embedding

    def hidden(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=False):
        """Final hidden states [B, q, H] (after the final norm)."""
        # Embed here so a draft in another dtype than the shared (target's) embedding still works.
        embeds = torch.nn.functional.embedding(input_ids, self.model.embed_tokens.weight).to(self.dtype)
        out = self.model(
            inputs_embeds=embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )
        return out.last_hidden_state, out.cache

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, q]
        attention_mask: torch.Tensor | None = None,  # [B, past + q], 0 on (left) pads
        position_ids: torch.Tensor | None = None,  # [B, q]
        cache=None,  # a transformers Cache with N layers (kv.py), written in place
        use_cache: bool = True,
        logits_to_keep: int = 0,  # 0: every position; n: the last n
        **_ignored,
    ) -> CausalLMOutputWithPast:
        hidden, cache = self.hidden(input_ids, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.lm_head(hidden), cache=cache)  # logits [B, q', V_r]

    # --- (de)serialisation ------------------------------------------------------------------
    def stored_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Everything but the (shared) embedding; floats in `dtype`, vocab_ids as int64."""
        state = {}
        for name, tensor in self.state_dict().items():
            if name == EMBED_KEY:
                continue
            state[name] = tensor.detach().to(dtype if tensor.is_floating_point() else tensor.dtype).contiguous()
        return state


def save_draft(model: SmolDraft, meta: dict, weights: str = DRAFT_FILE, meta_file: str = META_FILE) -> None:
    """Write the weights (bf16, no embedding) and the metadata JSON."""
    os.makedirs(os.path.dirname(weights), exist_ok=True)
    save_file(
        model.stored_state(), weights, metadata={"format": "pt", "num_layers": str(model.config.num_hidden_layers)}
    )
    with open(meta_file, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def build_draft(target, state: dict[str, torch.Tensor], num_layers: int) -> SmolDraft:
    """A SmolDraft for `target` holding `state` (stored tensors), its embedding tied to the target's.
    Built without random initialization: every weight is then loaded or tied (checked)."""
    with no_init_weights():
        model = SmolDraft(draft_config(target.config, num_layers), state["vocab_ids"])
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {EMBED_KEY}:
        raise ValueError(
            f"draft weights do not fit: missing {sorted(set(missing) - {EMBED_KEY})}, unexpected {unexpected}"
        )
    model.tie_embedding(target.model.embed_tokens.weight)
    return model


def load_default_draft(target, dtype: torch.dtype | None = None, path: str = DRAFT_FILE) -> SmolDraft:
    """The shipped draft for SmolLM2-135M-Instruct, offline: weights from the package, the
    embedding shared with `target`, cast to `dtype` (default: the target's), in eval mode."""
    embedding = target.model.embed_tokens.weight
    dtype = dtype or embedding.dtype
    state = load_file(path)
    num_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    model = build_draft(target, state, num_layers)
    # Cast everything but the shared embedding (it stays as the target holds it).
    for module in (model.model.layers, model.model.norm, model.lm_head):
        module.to(device=embedding.device, dtype=dtype)
    model.vocab_ids = model.vocab_ids.to(embedding.device)
    return model.eval()
