"""Scenarios both NVMe tiers are tested under (tests/placement/test_nvme_tier.py for the
optimizer state, test_param_nvme.py for the parameter shards), each over its own tier's
engine: training with inputs in the compute dtype, a swap folder held by a live run or left
by a killed one, a setup error as text, an nvme_path missing on one rank, a swap write that
fails for a full disk and the resume from the last checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import make_batches

REPO = Path(__file__).resolve().parents[1]

HOLD_FOLDER = textwrap.dedent("""
    import sys, time
    from zero3.nvme.folder import SwapFolder
    folder, _ = SwapFolder.create(sys.argv[1], int(sys.argv[2]), 0)
    (folder.path / "group00000.swp").write_bytes(b"stale" * 1000)
    print(folder.path, flush=True)
    time.sleep(600)
""")


def hold_swap_folder(nvme: Path, rank: int) -> tuple[subprocess.Popen, Path]:
    """A process that made its swap folder and holds it (until killed)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_FOLDER, str(nvme), str(rank)], stdout=subprocess.PIPE,
                            env=env, text=True)
    return proc, Path(proc.stdout.readline().strip())


def beside_a_live_and_a_killed_run(nvme: Path, run: Callable[[Path], Any]) -> tuple[Any, Path]:
    """`run(leftover)`'s result, run while one process holds its swap folder under `nvme` and
    another's folder (`leftover`) is what a SIGKILL left; the live one's must survive the run.
    Returns the result and the live folder (the leftover's fate is the caller's to check)."""
    live, held = hold_swap_folder(nvme, 8)
    killed, leftover = hold_swap_folder(nvme, 7)
    killed.send_signal(signal.SIGKILL)  # a killed run: its folder stays, its lock dies with it
    killed.wait()
    try:
        assert leftover.exists() and held.exists()
        results = run(leftover)
        assert held.exists(), "a live run's swap folder was removed"
    finally:
        live.kill()
        live.wait()
    return results, held


def train_in_compute_dtype(engine, rank: int, world: int, first: int, last: int, ga: int, micro: int,
                           steps: int) -> list[float]:
    """Optimizer steps `first` to `last` on this rank's slice of the batches, inputs cast to
    the engine's compute dtype (by the caller, as with DeepSpeed); every micro-step's loss."""
    batches = make_batches(steps * ga * world, micro)
    losses = []
    for step in range(first, last):
        for index in range(ga):
            x, y = batches[(step * ga + index) * world + rank]
            loss = engine(x.to(engine.compute_dtype), y.to(engine.compute_dtype))
            engine.backward(loss)
            engine.step()
            losses.append(loss.float().item())
    return losses


def setup_error(make: Callable[[], Any]) -> str:
    """The error `make()` (an engine, destroyed at once) raises, as "Class: message"."""
    try:
        make().destroy()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def missing_on_one_rank(rank: int, nvme: str, error_for: Callable[[str], str]) -> str:
    """The same relative nvme_path everywhere, the folder there on rank 0 only: what
    `error_for("relative")` reports on this rank."""
    cwd = os.getcwd()
    here = Path(nvme) if rank == 0 else Path(nvme) / "elsewhere"
    here.mkdir(exist_ok=True)
    os.chdir(here)
    try:
        if rank == 0:
            Path("relative").mkdir(exist_ok=True)
        return error_for("relative")
    finally:
        os.chdir(cwd)


def full_disk_then_resume(make: Callable[[int], Any], train: Callable[[Any, int, int], list[float]], folder: str,
                          file_limit: int, swap_folder_of: Callable[[Any], Path], state_of: Callable[[Any], dict],
                          expected_rest: list[float], reference: dict, steps: int) -> dict:
    """Train two steps and save; lower the file size limit to `file_limit` bytes (the kernel's
    EFBIG on the next swap write, no mock) for one step; destroy; then a new engine
    (`make(seed)`) loads the last checkpoint and trains steps 2..`steps`. Returns the error,
    whether destroy removed the swap folder, and whether the resumed losses equal
    `expected_rest` with the final state equal to `reference` (the differing names)."""
    import resource

    engine = make(0)
    train(engine, 0, 2)
    engine.save_checkpoint(folder, tag="before_full")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, hard))
    try:
        train(engine, 2, 3)
        error = "no error"
    except Exception as exc:  # noqa: BLE001 - the message is the result
        error = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    swap_folder = swap_folder_of(engine)
    engine.destroy()
    removed = not swap_folder.exists()
    resumed = make(7)
    resumed.load_checkpoint(folder)  # `latest`: the last checkpoint, saved before the failure
    losses = train(resumed, 2, steps)
    differ = [k for k, v in state_of(resumed).items() if k not in reference or not _equal(reference[k], v)]
    resumed.destroy()
    return {"full_error": error, "full_removed": removed, "full_resumed": (losses == expected_rest, differ)}


def _equal(a, b) -> bool:
    import torch

    return torch.equal(a, b)
