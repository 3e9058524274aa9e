"""`deepspeed.runtime.swap_tensor`: the names scripts and tests import from DeepSpeed's NVMe
swapping. zero3's own NVMe tiers (zero3/nvme/; optimizer state: optim/nvme_state.py, parameter shards: params/nvme_shards.py)
has nothing of DeepSpeed's swapper classes; the sizes are here so that code sizing its
tensors by them (`MIN_SWAPPABLE_BYTES`) runs unchanged.

- `utils.py`: `MIN_SWAPPABLE_BYTES` and the I/O sizes it comes from;
- `constants.py`: the `aio` config section's key names and DeepSpeed's defaults.
"""

from zero3.runtime.swap_tensor.utils import MIN_SWAPPABLE_BYTES

__all__ = ["MIN_SWAPPABLE_BYTES"]
