"""Length buckets: rows of similar prompt length prefilled together, so one long prompt does not
pad every row to its length (static batches, admission into a ragged batch)."""

from __future__ import annotations


def length_buckets(lengths: list[int], slack: float = 1.25) -> list[int]:
    """Sizes of consecutive buckets of ascending `lengths` such that each bucket, left-padded to its
    longest row, holds at most `slack` x its real tokens (a row that breaks the bound starts a new
    bucket). sum(result) == len(lengths)."""
    sizes: list[int] = []
    n = tokens = 0
    for length in lengths:
        if n and (n + 1) * length > slack * (tokens + length):
            sizes.append(n)
            n = tokens = 0
        n, tokens = n + 1, tokens + length
    return sizes + [n] if n else sizes


def buckets(items: list, length=len) -> list[list]:
    """`items`, ascending by `length`, cut into the consecutive groups of `length_buckets`."""
    groups, first = [], 0
    for size in length_buckets([length(item) for item in items]):
        groups.append(items[first : first + size])
        first += size
    return groups
