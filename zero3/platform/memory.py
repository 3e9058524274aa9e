"""The host's memory as the kernel reports it (Linux /proc/meminfo).

Callers check a large host allocation against `available_host_bytes()` before making it, so
that a request the host cannot meet is a clear error naming the bytes, not the kernel's OOM
killer or an allocator failure halfway through initialize or a save.
"""

from __future__ import annotations

from pathlib import Path


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where the system does not say."""
    return _meminfo("MemAvailable:")


def total_host_bytes() -> int | None:
    """MemTotal of /proc/meminfo in bytes; None where the system does not say."""
    return _meminfo("MemTotal:")


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
