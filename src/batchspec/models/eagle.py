"""A feature-conditioned draft head (EAGLE-style) that reads the target's own last hidden states.

For token position t the head takes [embedding of token t, the target's feature at t - 1] (the
target's final hidden state, after its final norm: what its LM head reads), projects the pair to
the hidden size (`fc`), runs one Llama decoder layer with its own KV cache and a final norm, and
returns its estimate of the target's feature at t. Logits over the reduced vocabulary are that
estimate times the target's own output rows of `vocab_ids`, so a draft token t + 1 is the target's
LM head applied to the predicted feature. While drafting, each predicted feature is fed back as the
next position's feature input (the target has not computed that one yet).

Cache convention: the head's entry at position t was computed from the target's true feature
f(t - 1). Entries fed while drafting use predicted features, so `EagleProposer` rewinds the head's
cache to its pre-drafting length after every proposal; accepted tokens are re-fed with their true
features on the next step (EAGLE's recipe). The invariant checker can then recompute every cached
entry from the tokens alone (`reference_features`).

Fused features (EAGLE-3): a head with `aux_layers` also reads the outputs of those target layers
(low and middle ones), each RMS-normalised without a weight, after the final feature:
f = [final, aux_1, ..., aux_A] ([H (1 + A)]). While drafting it has only its own prediction of the
final feature; the aux blocks of that input are zero (`fc_input`).

Weights: `weights/smollm2_eagle.safetensors` (fc, the layer, the norm, vocab_ids, aux_layers; bf16).
The input embedding and the head rows are the target's and are not stored. `scripts/train_eagle.py`
trains it.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaModel
from transformers.initialization import no_init_weights
from transformers.modeling_outputs import CausalLMOutputWithPast

from .draft import WEIGHTS_DIR, draft_config
from .linears import project

EAGLE_FILE = os.path.join(WEIGHTS_DIR, "smollm2_eagle.safetensors")
SHARED = ("model.embed_tokens.weight", "head")  # the target's tensors, never stored


class EagleHead(torch.nn.Module):
    """fc([embed(x_t), f_{t-1}]) -> Llama layer(s) -> norm = predicted f_t; logits = f_t @ head.T.

    Called like a causal LM plus `features` [B, q, F] (the target's feature at each fed token's
    previous position, F = feature_size, or [B, q, H]: the head's own prediction): `.logits`
    [B, q', V_r] and `.hidden` [B, q', H] (q' = q or logits_to_keep). `head` [V_r, H] is a frozen
    buffer set by `share_target` (the target's output rows of vocab_ids).
    """

    def __init__(self, config, vocab_ids: torch.Tensor, aux_layers: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.feature_size = hidden * (1 + len(aux_layers))
        self.fc = torch.nn.Linear(hidden + self.feature_size, hidden, bias=True)
        self.model = LlamaModel(config)  # embed_tokens is replaced by the target's
        self.register_buffer("vocab_ids", torch.as_tensor(vocab_ids, dtype=torch.long).clone())  # [V_r]
        self.register_buffer("aux_layers", torch.tensor(sorted(aux_layers), dtype=torch.long))  # [A]
        self.register_buffer("head", torch.zeros(len(vocab_ids), hidden), persistent=False)  # [V_r, H]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def aux(self) -> tuple[int, ...]:
        """The target layers whose outputs the features carry besides the final hidden state."""
        return tuple(self.aux_layers.tolist())

    def share_target(self, target) -> None:
        """Use the target's input embedding (shared) and its output rows of vocab_ids (a copy)."""
        embedding = target.get_input_embeddings().weight
        if tuple(embedding.shape) != (self.config.vocab_size, self.config.hidden_size):
            raise ValueError(f"embedding shape {tuple(embedding.shape)} does not match the head's config")
        self.model.embed_tokens.weight = embedding
        out = target.get_output_embeddings().weight.detach()
        self.head = out[self.vocab_ids.to(out.device)].to(self.fc.weight.dtype).clone()

    def fc_input(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embeds [B, q, H], features [B, q, F]]) -> [B, q, H]; features of width H (the head's
        own predicted final feature) read as F with zero aux blocks."""
        features = features.to(self.dtype)
        if features.shape[-1] < self.feature_size:
            features = torch.nn.functional.pad(features, (0, self.feature_size - features.shape[-1]))
        return self.fc(torch.cat([embeds, features], dim=-1))

    def hidden(self, input_ids, features, attention_mask=None, position_ids=None, cache=None, use_cache=False):
        """ids [B, q], features [B, q, F or H] -> predicted final features [B, q, H] (after the norm)."""
        embeds = torch.nn.functional.embedding(input_ids, self.model.embed_tokens.weight).to(self.dtype)
        x = self.fc_input(embeds, features)
        out = self.model(
            inputs_embeds=x,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
        )
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, q]
        features: torch.Tensor,  # [B, q, H]
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cache=None,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **_ignored,
    ) -> CausalLMOutputWithPast:
        hidden = self.hidden(input_ids, features, attention_mask, position_ids, cache, use_cache)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = project(hidden, self.head, table=getattr(self.fc, "table", None))  # tuned with fc, if it is
        return CausalLMOutputWithPast(logits=logits, hidden_states=hidden)

    def stored_state(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Everything but the target's tensors; floats in `dtype`."""
        return {
            name: t.detach().to(dtype if t.is_floating_point() else t.dtype).contiguous()
            for name, t in self.state_dict().items()
            if name not in SHARED
        }


def save_head(head: EagleHead, meta: dict, weights: str = EAGLE_FILE, meta_file: str | None = None) -> None:
    """Write the weights (bf16, without the target's tensors) and the metadata JSON beside them."""
    os.makedirs(os.path.dirname(os.path.abspath(weights)), exist_ok=True)
    save_file(head.stored_state(), weights, metadata={"num_layers": str(head.config.num_hidden_layers)})
    with open(meta_file or weights.removesuffix(".safetensors") + ".json", "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")


def load_head(target, dtype: torch.dtype | None = None, path: str = EAGLE_FILE) -> EagleHead:
    """The shipped head for SmolLM2-135M-Instruct, offline, in `dtype` (default: the target's),
    sharing the target's embedding and output rows."""
    state = load_file(path)
    num_layers = 1 + max(int(k.split(".")[2]) for k in state if k.startswith("model.layers."))
    aux_layers = tuple(state.setdefault("aux_layers", torch.zeros(0, dtype=torch.long)).tolist())
    with no_init_weights():  # every weight is then loaded or shared (checked below)
        head = EagleHead(draft_config(target.config, num_layers), state["vocab_ids"], aux_layers)
    missing, unexpected = head.load_state_dict(state, strict=False)
    if unexpected or set(missing) - set(SHARED):
        lost = sorted(set(missing) - set(SHARED))
        raise ValueError(f"head weights do not fit: missing {lost}, unexpected {unexpected}")
    embedding = target.get_input_embeddings().weight
    head.to(embedding.device)
    for module in (head.fc, head.model.layers, head.model.norm):  # not the shared embedding
        module.to(dtype=dtype or embedding.dtype)
    head.share_target(target)
    return head.eval()
