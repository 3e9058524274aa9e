"""Bytes per piece, from sizes alone: what the engine's placement (engine_parts/placement.py)
and `zero3 estimate` (estimate.py) both charge, so that the estimate shows the plan the
engine will make.

- a unit's parameter shards: its shard elements in the compute dtype;
- its optimizer side, per trainable shard element: the gradient shard (also what a device
  accumulator of a host-side unit holds) and the master in the master dtype (4 bytes each
  for fp32; 2 for bf16 with bf16_master_weights_and_grads; the master costs 0 when it is the
  shard itself: same dtype as the compute shard, and not the offloaded mixed mode whose
  master is lifted to fp32 for the step) and the optimizer's state tensors in the state
  dtype (4 each, 2 with bf16_optimizer_states): 16 bytes a parameter in all with bf16
  compute and fp32 masters, 8 with both bf16 keys;
- with offload_param.device "nvme": the staging buffers, `buffer_count` of them, each
  `buffer_size` elements of the compute dtype, at most the largest unit's shards (the pool
  is cut to what a swap group can hold), in host memory;
- with offload_optimizer.device "nvme": the staging buffers, `buffer_count` of them, each
  the largest swap group (a sub-group's masters and optimizer state less its gradient): at
  most max(sub_group_size, the largest trainable shard) elements, and no more than the
  swap files hold (direct I/O's 4 KiB alignment of each tensor aside), in host memory;
- the working set: gathered units (at most stage3_max_live_parameters elements, at least
  the two largest units: one running, one prefetched) and two gradient buckets (one being
  filled, one being reduced) in the reduce dtype.
"""

from __future__ import annotations

from zero3.config import OffloadConfig

FP32 = 4


def state_bytes_per_element(compute_width: int, optimizer_states: int, master_width: int = FP32,
                            state_width: int = FP32) -> int:
    """Bytes of a trainable shard element's optimizer side (the module docstring's rule)."""
    shares = compute_width == master_width and master_width == state_width
    master = 0 if shares else master_width
    return master_width + master + state_width * optimizer_states


def working_set_bytes(unit_numels: list[int], sharded_numel: int, max_live_numel: int, width: int,
                      trainable_padded_numel: int, reduce_bucket_numel: int, reduce_width: int) -> int:
    """`unit_numels`: elements of each fetch unit; `sharded_numel`: elements of the parameters
    that are gathered (not resident)."""
    largest = max(unit_numels, default=0)
    live = min(sharded_numel, max(max_live_numel, 2 * largest))
    buckets = 2 * min(reduce_bucket_numel, trainable_padded_numel) * reduce_width
    return live * width + buckets


def param_staging_bytes(offload: OffloadConfig, width: int, unit_param_bytes: list[int]) -> int:
    """Host bytes of the NVMe tier's staging buffers for parameter shards (0 without the
    tier); `unit_param_bytes`: each unit's shard bytes on this rank."""
    if not offload.nvme:
        return 0
    return offload.buffer_count * min(offload.buffer_size * width, max(unit_param_bytes, default=0))


def state_group_bytes(sub_group_numel: int, largest_trainable_shard_numel: int, swap_width: int) -> int | None:
    """Bound on the optimizer NVMe tier's largest swap group in bytes, from sizes: a sub-group
    holds whole parameters, at most `sub_group_numel` elements unless one parameter is larger;
    `swap_width`: bytes a trainable element swaps (master and state, not the gradient).
    None: no bound (sub_group_size 0 makes one group of the whole tier)."""
    if sub_group_numel <= 0:
        return None
    return max(sub_group_numel, largest_trainable_shard_numel) * swap_width
