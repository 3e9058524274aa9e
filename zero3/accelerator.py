"""Device and backend choice: CUDA with NCCL where a GPU exists, CPU with gloo otherwise.

`get_accelerator()` answers the calls DeepSpeed scripts make on
`deepspeed.accelerator.get_accelerator()`. Set ZERO3_ACCELERATOR=cpu to force the CPU
path on a machine that has a GPU.
"""

from __future__ import annotations

import functools
import os

import torch


class Accelerator:
    """The compute device kind of this process."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._index = 0

    # -- names
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_available()

    # -- device selection
    def set_device(self, device_index: int) -> None:
        self._index = int(device_index)
        if self._name == "cuda":
            torch.cuda.set_device(self._index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._name == "cuda" else 0

    def current_device_name(self) -> str:
        return f"cuda:{self.current_device()}" if self._name == "cuda" else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        if self._name == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.current_device() if device_index is None else device_index)

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._name == "cuda" else 1

    # -- synchronisation and memory
    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._name == "cuda":
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._name == "cuda" else 0

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._name == "cuda" else 0

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.reset_peak_memory_stats(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def is_bf16_supported(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self._name == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def __repr__(self) -> str:
        return f"Accelerator({self._name})"


@functools.lru_cache(maxsize=1)
def get_accelerator() -> Accelerator:
    forced = os.environ.get("ZERO3_ACCELERATOR", "").strip().lower()
    if forced not in ("", "cpu", "cuda"):
        raise ValueError(f"ZERO3_ACCELERATOR={forced!r}: use 'cpu' or 'cuda'")
    if forced == "cpu" or (not forced and not torch.cuda.is_available()):
        return Accelerator("cpu")
    return Accelerator("cuda")
