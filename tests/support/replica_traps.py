"""The shard layouts two planted data-parallel traps use, the same for every engine's test: each
engine's trap class overrides its ``_split(size)`` with one of these."""
from __future__ import annotations


def overlapping(size: int, world: int) -> list[tuple[int, int, float]]:
    """Replica r's slice starts half a shard after replica r - 1's: the halves overlap (and the
    batch's tail is no replica's)."""
    n = size // world
    return [(r * n // 2, r * n // 2 + n, 1.0) for r in range(world)]


def dropped_remainder(size: int, world: int) -> list[tuple[int, int, float]]:
    """Equal floor-sized slices: a short batch's odd samples are no replica's."""
    n = size // world
    return [(r * n, (r + 1) * n, 1.0) for r in range(world)]
