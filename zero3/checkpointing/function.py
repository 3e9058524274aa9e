"""`checkpoint(function, *args, **kwargs)`: DeepSpeed's reentrant activation checkpoint, built
on `torch.utils.checkpoint.checkpoint(use_reentrant=True, preserve_rng_state=True)`.

The forward runs `function` under no_grad and saves only the inputs; the backward runs it
again with grad and back-propagates through that recomputation. RNG: torch restores the CPU
RNG and the device RNG of the inputs' devices for the recomputation; `_Run` also restores the
device RNG tracker's states (rng.py), as DeepSpeed's checkpoint does, so dropout inside a
`fork()` is equal too. The settings in force at the forward (settings.py) hold for its
recomputation. zero3's engine gathers the parameters the recomputation reads as it gathers
them in any forward (params/fetch.py's recompute holds), so checkpointed blocks train under
ZeRO-3 with the gradients of the uncheckpointed model.

Nothing here owns tensors beyond what autograd saves: the inputs (on the host with
cpu_checkpointing, offload.py) and the tracker's state snapshot, freed with the graph.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils.checkpoint as torch_checkpoint

from zero3.checkpointing.offload import HostOffload
from zero3.checkpointing.rng import get_cuda_rng_tracker
from zero3.checkpointing.settings import current
from zero3.config import ActivationCheckpointingConfig
from zero3.platform.device import get_accelerator

logger = logging.getLogger("zero3")


class _Run:
    """`function` as the checkpoint calls it: once in the forward, once per recomputation.
    Keeps the tracker's states of the forward and applies the boundary settings."""

    def __init__(self, function: Callable, settings: ActivationCheckpointingConfig) -> None:
        self.function = function
        self.settings = settings
        self.tracker_states: dict | None = None
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        phase = "forward" if self.calls == 1 else "recomputation"
        if self.calls == 1:
            self.tracker_states = get_cuda_rng_tracker().get_states()
            return self._timed(phase, args)
        tracker = get_cuda_rng_tracker()
        outside = tracker.get_states()
        tracker.set_states(dict(self.tracker_states or {}))
        try:
            return self._timed(phase, args)
        finally:
            tracker.set_states(outside)

    def _timed(self, phase: str, args: tuple) -> Any:
        synchronize = self.settings.synchronize_checkpoint_boundary or self.settings.profile
        if synchronize:
            get_accelerator().synchronize()
        start = time.perf_counter()
        out = self.function(*args)
        if synchronize:
            get_accelerator().synchronize()
        if self.settings.profile:
            record_profile(phase, time.perf_counter() - start)
        return out


# (phase, seconds) of the last timed calls, for tests and tools; bounded so a long profiled run
# does not grow it without end (every call is logged on rank 0 as well).
PROFILE: collections.deque[tuple[str, float]] = collections.deque(maxlen=4096)


def record_profile(phase: str, seconds: float) -> None:
    PROFILE.append((phase, seconds))
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info("zero3: checkpoint %s: %.3f ms", phase, seconds * 1e3)


def _bind_keywords(function: Callable, args: tuple, kwargs: dict) -> tuple[Callable, tuple]:
    """Keyword arguments passed as trailing positions (reentrant checkpoint takes positions
    only), so tensors passed by keyword get gradients as positional ones do."""
    if not kwargs:
        return function, args
    names, count = tuple(kwargs), len(args)

    def with_keywords(*flat: Any) -> Any:
        return function(*flat[:count], **dict(zip(names, flat[count:])))

    return with_keywords, args + tuple(kwargs.values())


@torch.compiler.disable  # as DeepSpeed's: a compiled caller runs the checkpoint eagerly
def checkpoint(function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Checkpoint `function(*args, **kwargs)`: DeepSpeed's `deepspeed.checkpointing.checkpoint`,
    with the settings of `configure()` or the config's ``activation_checkpointing`` section
    (DeepSpeed's defaults when neither was given). Returns what `function` returns."""
    settings = current()
    run_function, flat = _bind_keywords(function, args, kwargs)
    run = _Run(run_function, settings)
    offload = settings.cpu_checkpointing and torch.is_grad_enabled()  # no backward, nothing to save
    with HostOffload() if offload else contextlib.nullcontext():
        return torch_checkpoint.checkpoint(run, *flat, use_reentrant=True, preserve_rng_state=True)
