"""The config's process-level switches and reports: log_level, disable_python_gc,
dump_state, memory_breakdown and the vocabulary_size check.

Owns no engine state. `apply_process_settings` changes process-wide settings (the zero3
logger's level, Python's automatic GC) at initialize; `restore_process_settings` undoes
the GC switch when the engine is destroyed.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import resource

from zero3.config import Zero3Config
from zero3.platform.comms_log import COMMS_LOGGER
from zero3.platform.device import get_accelerator

logger = logging.getLogger("zero3")


def apply_process_settings(config: Zero3Config) -> bool:
    """Set the logger level, the comms logger (an enabled comms_logger section, as DeepSpeed's
    initialize configures deepspeed.comm) and, with disable_python_gc, turn automatic GC off.
    Returns whether GC was turned off here (collect_garbage then runs at optimizer steps)."""
    if config.log_level is not None:
        logger.setLevel(config.log_level.upper())
    section = config.comms_logger
    if section.enabled:
        COMMS_LOGGER.configure(True, section.verbose, section.prof_all, section.debug, list(section.prof_ops))
    if config.disable_python_gc and gc.isenabled():
        gc.disable()
        return True
    return False


def collect_garbage(disabled_here: bool) -> None:
    """With disable_python_gc: collect at a point where no collective or kernel is in flight."""
    if disabled_here:
        gc.collect()


def restore_process_settings(disabled_here: bool) -> None:
    if disabled_here:
        gc.enable()


def report_config(config: Zero3Config, rank: int) -> None:
    """At initialize, on rank 0: dump_state prints the parsed configuration; a
    vocabulary_size that is not a multiple of 8 is warned about (as DeepSpeed does)."""
    if rank != 0:
        return
    if config.vocabulary_size is not None and config.vocabulary_size % 8:
        logger.warning("zero3: vocabulary_size %d is not a multiple of 8; padding the embedding to a multiple "
                       "of 8 uses the GPU's tensor cores better", config.vocabulary_size)
    if config.dump_state:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "raw"}
        print("zero3 engine configuration:\n" + json.dumps(fields, indent=1, default=str), flush=True)


def host_rss_bytes() -> int:
    """This process's resident set size now (Linux /proc), else its peak."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def log_memory(label: str, rank: int) -> None:
    """memory_breakdown: device memory allocated (now and peak) and host RSS, on rank 0."""
    if rank != 0:
        return
    accelerator = get_accelerator()
    gib = 1024 ** 3
    logger.info("zero3: memory %s: device allocated %.3f GiB (peak %.3f GiB), host RSS %.3f GiB", label,
                accelerator.memory_allocated() / gib, accelerator.max_memory_allocated() / gib,
                host_rss_bytes() / gib)
