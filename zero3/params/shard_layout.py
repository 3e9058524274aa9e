"""The layout rule of a shard: which elements of a parameter each rank owns.

A parameter of `numel` elements is cut into `world_size` rows of
`shard_numel_for(numel, world_size)` elements; rank r owns row r, and the last rows may
be padding. This is the one copy of the rule: the engine, `zero3.Init` and the
checkpoint format (which reshards on load) all read it here. Pure arithmetic and
copies; no state.
"""

from __future__ import annotations

import math

import torch


def shard_numel_for(numel: int, world_size: int) -> int:
    """Elements of each rank's shard of a `numel`-element tensor (the last ones padded)."""
    return math.ceil(numel / world_size) if numel else 0


def owned_range(numel: int, shard_numel: int, rank: int) -> tuple[int, int]:
    """[start, end) of the unpadded elements rank `rank` owns (possibly empty)."""
    start = min(rank * shard_numel, numel)
    return start, min(start + shard_numel, numel)


def copy_rows(flat: torch.Tensor, rows: torch.Tensor, shard_numel: int, into_rows: bool) -> None:
    """Move values between a flat tensor of numel elements and its padded row layout.

    Row r of `rows` holds flat[r * shard_numel:(r + 1) * shard_numel]; the last rows may
    be partly or wholly padding. At most two copies, whatever the world size.
    """
    numel = flat.numel()
    if numel == 0:
        return
    full_rows = numel // shard_numel
    remainder = numel - full_rows * shard_numel
    pairs = [(flat[: full_rows * shard_numel].view(full_rows, shard_numel), rows[:full_rows])]
    if remainder:
        pairs.append((flat[full_rows * shard_numel:], rows[full_rows, :remainder]))
    for flat_part, row_part in pairs:
        if into_rows:
            row_part.copy_(flat_part)
        else:
            flat_part.copy_(row_part)
