"""DeepSpeed's communication logger (`comms_logger` section, `deepspeed.comm.log_summary()`):
the engine's collectives timed by operation and message size.

When on, each collective that `Communicator` issues (all_gather, reduce_scatter, all_reduce,
broadcast, barrier) is timed from its issue to its completion, the device synchronized at
completion on CUDA (so the time is the collective's, not the host's queueing; this costs
the overlap it measures, as DeepSpeed's does), and recorded under (operation, message
bytes). `prof_all` logs every operation, else only those named in `prof_ops`; `verbose`
prints each one as it completes; `debug` adds the calling function's name to its line.

`log_summary()` prints, on rank 0, a table per operation and message size: count, total and
average latency (ms), algorithm bandwidth and bus bandwidth (Gbps) by DeepSpeed's
`calc_bw_log` rules: for all_gather and reduce_scatter the message is the whole tensor (the
shard times the ranks) and busbw is algbw x (n-1)/n; for all_reduce algbw counts the message
twice and busbw is algbw x (n-1)/n; for the others busbw equals algbw.

Memory: the records are a dict of small lists, owned by the module's one `COMMS_LOGGER`.
"""

from __future__ import annotations

import inspect
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommsLogger:
    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: list[str] = field(default_factory=list)
    records: dict[str, dict[int, list[float]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))

    def configure(self, enabled: bool | None = None, verbose: bool | None = None, prof_all: bool | None = None,
                  debug: bool | None = None, prof_ops: list[str] | None = None) -> None:
        """DeepSpeed's `comm.configure(...)` keyword arguments; None leaves a setting as it is."""
        for name, value in (("enabled", enabled), ("verbose", verbose), ("prof_all", prof_all), ("debug", debug),
                            ("prof_ops", prof_ops)):
            if value is not None:
                setattr(self, name, list(value) if name == "prof_ops" else bool(value))

    def wants(self, op: str) -> bool:
        return self.enabled and (self.prof_all or op in self.prof_ops)

    def start(self) -> float:
        return time.perf_counter()

    def finish(self, op: str, nbytes: int, world: int, started: float, on_cuda: bool) -> None:
        """Record one completed collective of `nbytes` (the message as DeepSpeed counts it)."""
        if on_cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        self.records[op][nbytes].append(seconds)
        if self.verbose:
            algbw, busbw = bandwidths(op, nbytes, seconds, world)
            caller = f" | caller: {_caller()}" if self.debug else ""
            print(f"zero3 comm: op: {op} | time (ms): {1000 * seconds:.2f} | msg size: {_size(nbytes)} | "
                  f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}{caller}", flush=True)

    def summary_lines(self, world: int) -> list[str]:
        lines = [f"{'Comm. Op':<18}{'Message Size':>14}{'Count':>8}{'Total Latency(ms)':>20}"
                 f"{'Avg Latency(ms)':>18}{'tput_avg (Gbps)':>18}{'busbw_avg (Gbps)':>18}"]
        for op in sorted(self.records):
            for nbytes in sorted(self.records[op]):
                times = self.records[op][nbytes]
                total = sum(times)
                algbw, busbw = bandwidths(op, nbytes, total / len(times), world)
                lines.append(f"{op:<18}{_size(nbytes):>14}{len(times):>8}{1000 * total:>20.2f}"
                             f"{1000 * total / len(times):>18.2f}{algbw:>18.2f}{busbw:>18.2f}")
        return lines

    def reset(self) -> None:
        self.records.clear()


COMMS_LOGGER = CommsLogger()


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algbw, busbw) in Gbps of one `op` of `nbytes` over `world` ranks (module docstring)."""
    if seconds <= 0:
        return 0.0, 0.0
    if op in ("all_gather", "reduce_scatter"):
        algbw = nbytes / seconds
        busbw = algbw * (world - 1) / world
    elif op == "all_reduce":
        algbw = 2 * nbytes / seconds
        busbw = algbw * (world - 1) / world
    else:
        algbw = busbw = nbytes / seconds
    return algbw * 8 / 1e9, busbw * 8 / 1e9


def log_summary() -> None:
    """Print the table (rank 0 only; every rank may call it)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print("\n".join(["zero3 communication summary:"] + COMMS_LOGGER.summary_lines(world)), flush=True)


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _caller() -> str:
    for frame in inspect.stack()[3:]:
        if not frame.filename.endswith(("collectives.py", "comms_log.py")):
            return frame.function
    return "?"
