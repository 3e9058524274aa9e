"""Run one test function on N real processes joined by a gloo process group.

`run_ranks(fn, world_size, *args)` starts `world_size` fresh processes (spawn), each
joins a gloo group (MASTER_ADDR 127.0.0.1 on a free port), calls `fn(rank, world_size,
*args)` and sends back its return value. A failure on any rank fails the call with that
rank's traceback; ranks that have not finished within `timeout` seconds are killed and
reported by number, so a hang becomes a test failure, never a stuck suite.

`fn` must be defined at module level in an importable module (a test file is fine).
Set ZERO3_TEST_BACKEND=nccl (one GPU a rank) or gloo (ranks may share one GPU) and
ZERO3_TEST_DEVICE=cuda to run device-agnostic tests (the Hugging Face Trainer ones) on GPUs;
ZERO3_TEST_WORLD_SIZE=1 runs the tests that read `WORLD_SIZE_OVERRIDE` on one rank (with
ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1 the sharded collectives still run: one GPU on NCCL).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

BACKEND = os.environ.get("ZERO3_TEST_BACKEND", "gloo")
DEVICE = os.environ.get("ZERO3_TEST_DEVICE", "cpu")
WORLD_SIZE_OVERRIDE = int(os.environ.get("ZERO3_TEST_WORLD_SIZE", "0")) or None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(fn: Callable, rank: int, world_size: int, port: int, args: tuple, results, env: dict,
           collective_timeout: float) -> None:
    os.environ.update(env)
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
    })
    if DEVICE == "cpu":
        os.environ["ZERO3_ACCELERATOR"] = "cpu"
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        if DEVICE == "cuda":
            gpus = torch.cuda.device_count()
            if gpus < world_size:
                # Ranks share the GPUs (gloo): each presents itself as local rank r % gpus, since
                # Accelerate binds LOCAL_RANK to a device (its barrier names device LOCAL_RANK).
                os.environ["LOCAL_RANK"] = str(rank % gpus)
            torch.cuda.set_device(rank % gpus)
        dist.init_process_group(BACKEND, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=collective_timeout))
        value = fn(rank, world_size, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)  # plain bytes: no shared-memory handles that die with us
        results.put(("ok", rank, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put(("error", rank, traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def join_gloo(rank: int, world_size: int, port: int, timeout: float = 120.0) -> None:
    """For a process a test starts by hand (to SIGKILL it): join a gloo group on 127.0.0.1:port
    on the CPU, one torch thread, as run_ranks' children do."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "ZERO3_ACCELERATOR": "cpu"})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0,
              env: dict | None = None, collective_timeout: float = 120.0) -> list[Any]:
    """fn(rank, world_size, *args) on every rank; returns the values in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, r, world_size, port, args, results, env or {}, collective_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                status, rank, value = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if p.exitcode not in (None, 0) and r not in values and r not in errors]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without a result"
                continue
            if status == "ok":
                import torch

                values[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
            if errors:
                deadline = min(deadline, time.monotonic() + 15)  # let the others report, briefly
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in values and r not in errors]
    if errors:
        text = "\n".join(f"--- rank {r} ---\n{errors[r]}" for r in sorted(errors))
        raise AssertionError(f"{len(errors)} of {world_size} ranks failed:\n{text}"
                             + (f"\nranks {missing} did not finish" if missing else ""))
    if missing:
        raise AssertionError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s (hang?)")
    return [values[r] for r in range(world_size)]
