"""Tensor parallelism's process side (`tp`): the group, rank 0's choices broadcast (`agree`), seeds,
the launcher. Below the models, which shard themselves over it (models/sharding.py)."""
