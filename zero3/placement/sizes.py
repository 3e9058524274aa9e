"""Bytes per piece, from sizes alone: what the engine's placement (engine_parts/placement.py)
and `zero3 estimate` (estimate.py) both charge, so that the estimate shows the plan the
engine will make.

- a unit's parameter shards: its shard elements in the compute dtype;
- its optimizer side, per trainable shard element: the fp32 gradient shard (4 bytes, also
  what a device accumulator of a host-side unit holds), the
  fp32 master (4, or 0 when the compute dtype is fp32 and the master is the shard itself)
  and the optimizer's fp32 state tensors (4 each);
- the working set: gathered units (at most stage3_max_live_parameters elements, at least
  the two largest units: one running, one prefetched) and two gradient buckets (one being
  filled, one being reduced) in the reduce dtype.
"""

from __future__ import annotations

FP32 = 4
GRADIENT_BYTES = FP32  # a gradient shard (or its accumulator on the device) per trainable element


def state_bytes_per_element(compute_width: int, optimizer_states: int) -> int:
    master = 0 if compute_width == FP32 else FP32
    return FP32 + master + FP32 * optimizer_states


def working_set_bytes(unit_numels: list[int], sharded_numel: int, max_live_numel: int, width: int,
                      trainable_padded_numel: int, reduce_bucket_numel: int, reduce_width: int) -> int:
    """`unit_numels`: elements of each fetch unit; `sharded_numel`: elements of the parameters
    that are gathered (not resident)."""
    largest = max(unit_numels, default=0)
    live = min(sharded_numel, max(max_live_numel, 2 * largest))
    buckets = 2 * min(reduce_bucket_numel, trainable_padded_numel) * reduce_width
    return live * width + buckets
