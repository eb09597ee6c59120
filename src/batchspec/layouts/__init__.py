"""Batch layouts: how the running rows and their caches are stored between steps. `base.Layout` is
the protocol the step, the proposers and verification rely on, with the capabilities a layout may
lack declared there with defaults; `padded` (with EQSPEC's `realign`) and `ragged` meet it."""
