"""The invariant checker (`check_invariants=True`, on in tests): after every step, each layout's
structural invariants, then the one that needs the models: every row's cached keys/values equal
those of a fresh, unbatched prefill of that row's tokens (within floating-point tolerance); for a
draft head that reads the target's features, from the target's features of those tokens.
"""

from __future__ import annotations

import torch

from ..cache import kv
from ..models.eagle import EagleHead
from ..models.forward import reference_features, shifted

# Batched vs unbatched forwards differ by rounding only; these bound that, per dtype.
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}

FEATURE_TOLERANCE = 1e-6  # a head's entries inherit float32 rounding from the features it reads


class InvariantError(AssertionError):
    """A synchronization invariant does not hold (a bug in a layout or the step)."""


def check_batch(batch, models: dict) -> None:
    """Raise InvariantError naming the row, role and layer where the batch is out of step."""
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
            _check_row(model, role, b, seq.token_ids[:n], batch.row_cache(role, b), models["target"])


@torch.inference_mode()
def _check_row(model, role: str, row: int, tokens: list[int], cached: kv.SeqKV, target) -> None:
    if not tokens:
        return
    fresh = kv.reference_cache(model.config, full=True)  # every entry, sliding layers' too
    ids = torch.tensor([tokens], device=model.device)
    extra = {}
    if isinstance(model, EagleHead):  # a draft head: the target's features of the same tokens
        extra["features"] = shifted(reference_features(target, ids, model.aux))
    model(input_ids=ids, cache=fresh, use_cache=True, logits_to_keep=1, **extra)
    tol = TOLERANCE.get(kv.entry_dtype(model), 1e-3)
    if extra:  # features come out of the target's final RMSNorm, computed in float32 whatever the dtype
        tol = max(tol, FEATURE_TOLERANCE)
    for layer, ((k, v), (fk, fv)) in enumerate(zip(cached, kv.tensors(fresh), strict=True)):
        for name, got, want in (("keys", k, fk), ("values", v, fv)):
            if got.shape != want.shape:
                raise InvariantError(
                    f"{role} row {row} layer {layer} {name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
                )
            err = (got.float() - want.float()).abs().max().item()
            scale = want.float().abs().max().item() or 1.0
            if err > tol * max(1.0, scale):
                raise InvariantError(
                    f"{role} row {row} layer {layer} {name}: cached entries differ from a fresh prefill "
                    f"of the row's {len(tokens)} tokens by {err:.3g} (tolerance {tol * max(1.0, scale):.3g})"
                )
