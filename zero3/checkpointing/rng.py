"""DeepSpeed's (Megatron's) device RNG tracker: named RNG states that model-parallel code
forks into (`with get_cuda_rng_tracker().fork(): dropout(x)`), and
`model_parallel_cuda_manual_seed`.

With no model parallelism (zero3's only case: no mpu, or a model-parallel group of one rank)
the meaning is DeepSpeed's with tensor-parallel rank 0: the default RNG is seeded with
`seed` and the tracker's "model-parallel-rng" state with `seed + 2718`. The device RNG is
CUDA's on a GPU and the CPU generator on the CPU (zero3's accelerator). The tracker holds
RNG state tensors only (a few bytes each); `checkpoint()` snapshots its states at the
forward and restores them for the recomputation, so dropout under `fork()` inside a
checkpoint draws the same values twice.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

from zero3.checkpointing.settings import current_mpu, model_parallel_rank
from zero3.platform.device import get_accelerator

logger = logging.getLogger("zero3")
MODEL_PARALLEL_RNG = "model-parallel-rng"
_SEED_OFFSET = 2718  # DeepSpeed's and Megatron's offset of the model-parallel seed


def _seed_device(seed: int) -> None:
    """Seed the device generator only (torch.manual_seed would reseed the CPU one on a GPU too)."""
    if get_accelerator().device_name() == "cuda":
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named device RNG states. Invariant: each name and each seed is added once."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are not cloned: `fork`
        replaces a state, never writes into it)."""
        return copy.copy(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        """Track a new state seeded with `seed`; the device RNG is left as it was."""
        if seed in self.seeds_:
            raise ValueError(f"rng tracker: seed {seed} is already used (names: {sorted(self.states_)}). "
                             "Give each tracked state its own seed.")
        if name in self.states_:
            raise ValueError(f"rng tracker: state {name!r} is already added. Call reset() first, or use another name.")
        accelerator = get_accelerator()
        original = accelerator.get_rng_state()
        _seed_device(seed)
        self.seeds_.add(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on the state `name`, keep where it got to, and restore the device RNG."""
        if name not in self.states_:
            raise ValueError(f"rng tracker: state {name!r} is not added (have {sorted(self.states_)}). "
                             "Call model_parallel_cuda_manual_seed(seed) or add(name, seed) first.")
        accelerator = get_accelerator()
        original = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (DeepSpeed's name; the device RNG on the CPU too)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default device RNG with `seed` (the data-parallel seed) and the tracker's
    model-parallel state with `seed + 2718 + tensor-parallel rank` (0 without model parallelism)."""
    tp_rank = model_parallel_rank(current_mpu())
    model_parallel_seed = seed + _SEED_OFFSET + tp_rank
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("zero3: model parallel seed %d, data parallel seed %d (tensor-parallel rank %d)",
                    model_parallel_seed, seed, tp_rank)
    _TRACKER.reset()
    _seed_device(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, model_parallel_seed)


def model_parallel_reconfigure_tp_seed(seed: int) -> None:
    """Reseed the tracker's model-parallel state (DeepSpeed's function of that name)."""
    with _TRACKER.fork():
        _seed_device(seed + _SEED_OFFSET + model_parallel_rank(current_mpu()))
