"""The invariant checker (`check_invariants=True`, on in tests): after every step, each layout's
structural invariants, then the one that needs the models: every row's cached keys/values equal
those of a fresh, unbatched prefill of that row's tokens (within floating-point tolerance); for a
draft head that reads the target's features, from the target's features of those tokens; and a
constrained row's grammar state is that of its committed tokens.
"""

from __future__ import annotations

import torch

from ..cache import kv
from ..models.eagle import EagleHead
from ..models.forward import reference_features, shifted

# Batched vs unbatched forwards differ by rounding only; these bound that, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}

FEATURE_TOLERANCE = 1e-6  # a head's entries inherit float32 rounding from the features it reads

# A draft whose cache started from the target's entries computes its later ones over those, not over
# its own: they differ from its fresh prefill by up to 0.084 of the entries' scale (SmolLM2-135M's
# int8 copy, 30 layers); an entry out of step (another token or position) differs by about the scale.
ADOPTED_TOLERANCE = 0.25


class InvariantError(AssertionError):
    """A synchronization invariant does not hold (a bug in a layout or the step)."""


def check_batch(batch, models: dict, adopted: tuple[str, ...] = ()) -> None:
    """Raise InvariantError naming the row, role and layer where the batch is out of step. A role in
    `adopted` (a draft whose cache starts from the target's entries) may hold, at each position,
    its own model's entry or the target's."""
    try:
        batch.check_layout()
    except AssertionError as err:
        raise InvariantError(str(err)) from None
    for role, model in models.items():
        counts = batch.cached_counts(role)
        lags = {len(seq) - n for seq, n in zip(batch.seqs, counts)}
        # The target lags by exactly 1; a draft by 1 or 2 after a drafting step, and by more after
        # plain steps in which it did not run (adaptive speculation), never by less than 1.
        if (role == "target" and lags != {1}) or min(lags) < 1:
            raise InvariantError(f"{role}: cache lags {sorted(lags)} behind the tokens")
        for b, (seq, n) in enumerate(zip(batch.seqs, counts)):
            _check_row(model, role, b, seq.token_ids[:n], batch.row_cache(role, b), models["target"], role in adopted)
    for b, seq in enumerate(batch.seqs):
        _check_grammar(b, seq)


def _check_grammar(row: int, seq) -> None:
    """A constrained row's grammar state has consumed its generated tokens, no more (no draft left
    in it), and allows what a fresh matcher fed those tokens allows (rollbacks left nothing behind)."""
    if seq.matcher is None:
        return
    committed = seq.token_ids[seq.prompt_len :]
    if seq.matcher.tokens != committed:
        raise InvariantError(f"row {row}: the grammar consumed {seq.matcher.tokens}, the row committed {committed}")
    if not torch.equal(seq.matcher.mask(), seq.matcher.replayed().mask()):
        raise InvariantError(f"row {row}: the grammar's mask differs from a fresh matcher fed the same tokens")


@torch.inference_mode()
def _check_row(model, role: str, row: int, tokens: list[int], cached: kv.SeqKV, target, adopted: bool = False) -> None:
    """Row `row`'s cached entries against a fresh prefill of its tokens by `model` (or, position by
    position, by `target`, whose entries an `adopted` row may hold instead)."""
    if not tokens:
        return
    fresh = [_fresh(model, tokens, target)] + ([_fresh(target, tokens, target)] if adopted else [])
    tol = TOLERANCE.get(kv.entry_dtype(model), 1e-3)
    if isinstance(model, EagleHead):  # features come out of the target's final RMSNorm, computed in float32
        tol = max(tol, FEATURE_TOLERANCE)
    if adopted:
        tol = max(tol, ADOPTED_TOLERANCE)
    if len(cached) != len(fresh[0]):
        raise InvariantError(f"{role} row {row}: {len(cached)} cached layers, the model has {len(fresh[0])}")
    for layer, (k, v) in enumerate(cached):
        for name, got, wants in (
            ("keys", k, [f[layer][0] for f in fresh]),
            ("values", v, [f[layer][1] for f in fresh]),
        ):
            if got.shape != wants[0].shape:
                raise InvariantError(
                    f"{role} row {row} layer {layer} {name}: shape {tuple(got.shape)} != {tuple(wants[0].shape)}"
                )
            scale = max(want.float().abs().max().item() for want in wants) or 1.0
            per_position = torch.stack([(got.float() - w.float()).abs().amax(dim=(0, 1, 3)) for w in wants])
            err = per_position.min(dim=0).values.max().item()  # each position: the closer reference
            if err > tol * max(1.0, scale):
                raise InvariantError(
                    f"{role} row {row} layer {layer} {name}: cached entries differ from a fresh prefill "
                    f"of the row's {len(tokens)} tokens by {err:.3g} (tolerance {tol * max(1.0, scale):.3g})"
                )


def _fresh(model, tokens: list[int], target) -> kv.SeqKV:
    """`model`'s entries for `tokens` from one unbatched prefill (a head's from the target's features)."""
    fresh = kv.reference_cache(model.config, full=True)  # every entry, sliding layers' too
    ids = torch.tensor([tokens], device=model.device)
    extra = {}
    if isinstance(model, EagleHead):  # a draft head: the target's features of the same tokens
        extra["features"] = shifted(reference_features(target, ids, model.aux))
    model(input_ids=ids, cache=fresh, use_cache=True, logits_to_keep=1, **extra)
    return kv.tensors(fresh)
