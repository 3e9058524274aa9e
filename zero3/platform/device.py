"""Device and backend choice: CUDA with NCCL where a GPU exists, CPU with gloo otherwise.

`get_accelerator()` answers the calls DeepSpeed scripts make on
`deepspeed.accelerator.get_accelerator()`. Set ZERO3_ACCELERATOR=cpu to force the CPU
path on a machine that has a GPU.

Which CUDA device a process computes on (`choose_cuda_device`, applied by
`zero3.init_distributed` and `zero3.initialize`): zero3 never asks for a device the
process cannot see.
1. One visible GPU is every rank's (a scheduler binding one GPU to each task through
   CUDA_VISIBLE_DEVICES, or several ranks sharing one card over gloo).
2. A device the process chose itself (`torch.cuda.set_device(i)` before zero3, i other
   than the default 0) is kept.
3. Otherwise LOCAL_RANK's device, when LOCAL_RANK names a visible GPU.
4. A LOCAL_RANK that names no visible GPU keeps device 0 if the process already
   initialised CUDA there, and is otherwise an error that names LOCAL_RANK, the visible
   count and CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch


def synchronize_cuda() -> None:
    """Wait for the current CUDA device's queued work, when CUDA is in use (a wall-clock
    reading around device work needs it); nothing on a CPU-only run."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def local_rank() -> int:
    """This process's index on its node: torchrun's LOCAL_RANK (0 without it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Processes on this node: torchrun's LOCAL_WORLD_SIZE (or MPI-style LOCAL_SIZE), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)


class DeviceChoiceError(RuntimeError):
    """LOCAL_RANK names a CUDA device this process cannot see."""


def choose_cuda_device() -> int:
    """The CUDA device index this process should compute on (the module docstring's rule)."""
    visible = torch.cuda.device_count()
    rank = local_rank()
    chosen = torch.cuda.current_device() if torch.cuda.is_initialized() else None
    if visible == 1:
        return 0
    if chosen not in (None, 0):
        return chosen
    if rank < visible:
        return rank
    if chosen == 0:
        return 0
    raise DeviceChoiceError(
        f"LOCAL_RANK={rank} names CUDA device {rank}, but this process sees {visible} device(s) "
        f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); launch at most "
        f"{visible} processes per node, make each process see its own GPU, or call "
        f"torch.cuda.set_device(i) before zero3 to choose the device yourself")


class Accelerator:
    """The compute device kind of this process."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._index = 0
        self._compile_backend = "inductor"

    # -- names
    def device_name(self, device_index: int | None = None) -> str:
        if device_index is None or self._name == "cpu":
            return self._name
        return f"{self._name}:{device_index}"

    def communication_backend_name(self) -> str:
        return "nccl" if self._name == "cuda" else "gloo"

    def is_available(self) -> bool:
        return self._name == "cpu" or torch.cuda.is_available()

    # -- torch.compile
    def get_compile_backend(self) -> str:
        """The backend engine.compile() uses when given none (DeepSpeed's name)."""
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        self._compile_backend = backend

    # -- device selection
    def set_device(self, device_index: int) -> None:
        self._index = int(device_index)
        if self._name == "cuda":
            torch.cuda.set_device(self._index)

    def current_device(self) -> int:
        """The CUDA device in use; on the CPU, as DeepSpeed's CPU accelerator, LOCAL_RANK."""
        return torch.cuda.current_device() if self._name == "cuda" else local_rank()

    def local_rank(self) -> int:
        return local_rank()

    def current_device_name(self) -> str:
        return f"cuda:{self.current_device()}" if self._name == "cuda" else "cpu"

    def device(self, device_index: int | None = None) -> torch.device:
        if self._name == "cpu":
            return torch.device("cpu")
        return torch.device("cuda", self.current_device() if device_index is None else device_index)

    def device_count(self) -> int:
        """GPUs on this node; on the CPU, as DeepSpeed's CPU accelerator, the processes on
        this node (each rank counts as one CPU device)."""
        return torch.cuda.device_count() if self._name == "cuda" else local_world_size()

    def is_synchronized_device(self) -> bool:
        return self._name == "cpu"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    # -- random numbers
    def random(self):
        return torch.random

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        if self._name == "cuda":
            return torch.cuda.get_rng_state(device_index if device_index is not None else "cuda")
        return torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.set_rng_state(new_state, device_index if device_index is not None else "cuda")
        else:
            torch.set_rng_state(new_state)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    # -- streams and events (none on the CPU: work is done when the call returns)
    def Stream(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream(*args, **kwargs) if self._name == "cuda" else None

    def Event(self, *args, **kwargs):  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Event(*args, **kwargs) if self._name == "cuda" else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._name == "cuda" else contextlib.nullcontext()

    def current_stream(self, device_index: int | None = None):
        return torch.cuda.current_stream(device_index) if self._name == "cuda" else None

    def default_stream(self, device_index: int | None = None):
        return torch.cuda.default_stream(device_index) if self._name == "cuda" else None

    def range_push(self, message: str) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_push(message)

    def range_pop(self) -> None:
        if self._name == "cuda":
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return callback()

    def is_triton_supported(self) -> bool:
        return False

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

    def memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._name == "cuda" else 0

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._name == "cuda" else 0

    def total_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index: int | None = None) -> int:
        if self._name == "cuda":
            return torch.cuda.mem_get_info(device_index)[0]
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

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
