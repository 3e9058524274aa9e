"""`deepspeed.runtime.utils`: the helpers scripts call from it (`see_memory_usage`)."""

from __future__ import annotations

import gc
import os

import torch.distributed as dist

from zero3.platform.device import get_accelerator

GIB = 1024 ** 3


def _host_memory_used() -> tuple[float, float]:
    """(GiB of host memory in use by everything, percent of the total), from the OS's counts."""
    page = os.sysconf("SC_PAGE_SIZE")
    total, available = page * os.sysconf("SC_PHYS_PAGES"), page * os.sysconf("SC_AVPHYS_PAGES")
    return (total - available) / GIB, 100.0 * (total - available) / total


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory report: with `force`, on rank 0 only (every process without a
    process group), collect garbage and print `message`, the accelerator memory allocated
    and reserved (now and peak; 0 on the CPU) and the host memory in use; then reset the
    peaks, so the next report shows the peak since this one. Without `force`, nothing."""
    if not force or (dist.is_initialized() and dist.get_rank() != 0):
        return
    gc.collect()
    accelerator = get_accelerator()
    used, percent = _host_memory_used()
    print(message)
    print(f"MA {accelerator.memory_allocated() / GIB:.2f} GB Max_MA {accelerator.max_memory_allocated() / GIB:.2f} GB "
          f"CA {accelerator.memory_reserved() / GIB:.2f} GB Max_CA {accelerator.max_memory_reserved() / GIB:.2f} GB")
    print(f"CPU Virtual Memory:  used = {used:.2f} GB, percent = {percent:.1f}%")
    accelerator.reset_peak_memory_stats()


__all__ = ["see_memory_usage"]
