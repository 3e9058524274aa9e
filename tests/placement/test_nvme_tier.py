"""The NVMe tier of the optimizer state (offload_optimizer.device "nvme"), on 2 gloo ranks,
a temporary folder standing in for the NVMe drive.

One launch of 2 ranks checks, against the host-offload run (offload_optimizer "cpu": the same
CPU kernels over the same values):
- every piece on NVMe, with the overlapped host step: losses and every master, optimizer
  state and shard bit-identical; the swap files exist while training, one folder per rank;
- three tiers at once (placement.gpu_budget and placement.host_budget cutting the units
  into device, host and NVMe optimizer sides), stepped synchronously: bit-identical too;
- checkpoints: one saved with NVMe loads into a host-offload engine and the reverse, and
  both go on bit-exactly;
- a missing nvme_path on one rank: SwapSetupError on every rank, naming the rank;
- a full disk during a swap write (RLIMIT_FSIZE lowered in the rank: the kernel's EFBIG on
  the write, no mock): a SwapIOError naming the file and the fix; the last checkpoint still
  loads into a new engine, which goes on exactly;
- destroy() removes the rank's swap folder.
The leftovers of a killed run (a process SIGKILLed while holding its swap folder) are
cleared by the next start, and a live run's folder is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from common import make_model, optimizer_tensors, two_param_groups
from harness import run_ranks
from nvme_cases import (beside_a_live_and_a_killed_run, full_disk_then_resume, missing_on_one_rank, setup_error,
                        train_in_compute_dtype)

MICRO, GA, STEPS = 4, 2, 4


def config_for(device: str, nvme_path: str | None = None, overlap: bool = True, budget=None,
               host_budget=None) -> dict:
    optimizer = {"device": device, "overlap_step": overlap}
    if device == "nvme":
        optimizer.update(nvme_path=nvme_path, buffer_count=3)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "reduce_bucket_size": 500,
            "sub_group_size": 400, "offload_param": {"device": "cpu"}, "offload_optimizer": optimizer}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
              "gradient_clipping": 0.5, "zero_optimization": zero, "bf16": {"enabled": True},
              "aio": {"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 2},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                          "warmup_num_steps": 3}}}
    placement = {k: v for k, v in (("gpu_budget", budget), ("host_budget", host_budget)) if v is not None}
    if placement:
        config["placement"] = placement
    return config


def build(config: dict, seed: int = 0):
    import zero3

    model = make_model(seed=seed)
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=config)
    return engine


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    return train_in_compute_dtype(engine, rank, world, first, last, GA, MICRO, STEPS)


def final_state(engine) -> dict[str, torch.Tensor]:
    engine.optimizer_access.state()  # the NVMe tier's state brought into memory
    return optimizer_tensors(engine)


def differing(a: dict, b: dict) -> list[str]:
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def tiers(engine) -> set[str]:
    return {engine.placement.state_tier(sp).value for sp in engine.table.values() if sp.requires_grad}


def nvme_run(rank: int, world: int, folder: str, nvme: str, leftover: str):
    results = {}
    host = build(config_for("cpu"))
    expected = train(host, rank, world, 0, 2)
    host.save_checkpoint(folder, tag="host_half")
    expected += train(host, rank, world, 2, STEPS)
    reference = final_state(host)

    on_nvme = build(config_for("nvme", nvme))
    results["leftover_cleared"] = not Path(leftover).exists()
    swap = on_nvme.optimizer.swap
    alignment = swap.pager.pool.count * 4096 * max(len(g.regions) for g in swap.groups)  # direct I/O rounds each tensor
    results["staging"] = (on_nvme.placement.plan.state_staging_bytes, swap.pager.pool.nbytes, alignment,
                          on_nvme.placement.plan.nvme_bytes)
    swap_folder = on_nvme.optimizer.swap.folder.path
    losses = train(on_nvme, rank, world, 0, 2)
    on_nvme.save_checkpoint(folder, tag="nvme_half")
    results["swap_files"] = sorted(p.name for p in swap_folder.iterdir())
    losses += train(on_nvme, rank, world, 2, STEPS)
    results.update(nvme_losses=losses == expected, nvme_state=differing(reference, final_state(on_nvme)),
                   nvme_tiers=tiers(on_nvme), nvme_plan=on_nvme.placement.plan.describe())
    on_nvme.destroy()
    results["removed_at_destroy"] = not swap_folder.exists()
    results.update(three_tier_run(rank, world, nvme, expected, reference))
    results.update(cross_loads(rank, world, folder, nvme, expected, reference))
    huge = config_for("nvme", nvme)
    huge["zero_optimization"]["offload_optimizer"]["buffer_count"] = 10**8  # far more than any host has
    error = setup_error(lambda: build(huge))  # this process's swap folders are named by its pid
    results["staging_beyond_host"] = (error, sorted(str(p) for p in Path(nvme).rglob(f"*-pid{os.getpid()}-*")))
    results["missing"] = missing_on_one_rank(rank, nvme, lambda path: setup_error(lambda: build(config_for("nvme", path))))
    results.update(full_disk_then_resume(
        lambda seed: build(config_for("nvme", nvme, overlap=False), seed=seed),
        lambda engine, first, last: train(engine, rank, world, first, last), folder, 4096,
        lambda engine: engine.optimizer.swap.folder.path, final_state, expected[2 * GA:], reference, STEPS))
    return results


def three_tier_run(rank: int, world: int, nvme: str, expected: list, reference: dict) -> dict:
    """Optimizer sides on the device, the host and NVMe at once, stepped in step()."""
    everything = build(config_for("cpu", budget="1TiB", overlap=False))
    plan = everything.placement.plan
    part = plan.fixed_bytes + (plan.device_bytes - plan.fixed_bytes) // 2
    everything.destroy()
    first_host = next(u for u in build_plan_units(part) if u[1] == "host")
    engine = build(config_for("nvme", nvme, overlap=False, budget=part, host_budget=first_host[2]))
    losses = train(engine, rank, world, 0, STEPS)
    out = {"three_tiers": tiers(engine), "three_losses": losses == expected,
           "three_state": differing(reference, final_state(engine)), "three_plan": engine.placement.plan.describe()}
    engine.destroy()
    return out


def build_plan_units(budget) -> list[tuple[str, str, int]]:
    """(unit, optimizer-side tier, its bytes) under `budget` with the host offload."""
    from zero3.engine_parts.placement import plan_inputs
    from zero3.placement.budget import BudgetChoice

    engine = build(config_for("cpu", budget=budget, overlap=False))
    inputs = plan_inputs(engine.config, engine.table, engine.units, engine.optimizer.optimizer,
                         BudgetChoice(budget, False, True, "test"))
    sizes = {u.name: u.state_bytes for u in inputs.units}
    units = [(u.name, u.state.value, sizes[u.name]) for u in engine.placement.plan.units if sizes[u.name]]
    engine.destroy()
    return units


def cross_loads(rank: int, world: int, folder: str, nvme: str, expected: list, reference: dict) -> dict:
    """An NVMe-saved checkpoint into a host engine, a host-saved one into an NVMe engine."""
    out = {}
    for name, config, tag in (("host_from_nvme", config_for("cpu"), "nvme_half"),
                              ("nvme_from_host", config_for("nvme", nvme), "host_half")):
        engine = build(config, seed=5)
        engine.load_checkpoint(folder, tag=tag)
        losses = train(engine, rank, world, 2, STEPS)
        out[name] = (losses == expected[2 * GA:], differing(reference, final_state(engine)))
        engine.destroy()
    return out


def test_nvme_tier_is_exact_survives_a_full_disk_and_cleans_up(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results, held = beside_a_live_and_a_killed_run(
        nvme, lambda leftover: run_ranks(nvme_run, 2, str(tmp_path / "ckpt"), str(nvme), str(leftover), timeout=500))
    for rank, r in enumerate(results):
        assert r["leftover_cleared"], rank
        assert r["nvme_losses"] and r["nvme_state"] == [] and r["nvme_tiers"] == {"nvme"}, (rank, r["nvme_plan"])
        assert "lock" in r["swap_files"] and any(n.endswith(".swp") for n in r["swap_files"]), r["swap_files"]
        assert r["removed_at_destroy"], rank
        charged, pool, alignment, in_files = r["staging"]  # the plan's host bytes count the staging buffers
        assert pool - alignment <= charged <= 3 * in_files and charged > 0, (rank, r["staging"])
        assert r["three_tiers"] == {"device", "host", "nvme"}, (rank, r["three_plan"])
        assert r["three_losses"] and r["three_state"] == [], (rank, r["three_state"])
        assert r["host_from_nvme"] == (True, []) and r["nvme_from_host"] == (True, []), rank
        error, files = r["staging_beyond_host"]  # refused before any folder, file or buffer is made
        assert "SwapSetupError" in error and "buffer_count" in error and "sub_group_size" in error, error
        assert "GiB is available" in error and files == [], (error, files)
        assert "SwapSetupError" in r["missing"] and "does not exist" in r["missing"], r["missing"]
        assert "File too large" in r["full_error"] and "nvme_path" in r["full_error"], r["full_error"]
        assert r["full_removed"] and r["full_resumed"] == (True, []), (rank, r["full_resumed"])
    assert "rank 1" in results[0]["missing"]  # rank 0's folder was fine: it names the rank that failed
    assert [p.name for p in (nvme / "zero3_swap").iterdir()] == [held.name], "swap folders left behind"
    assert [p.name for p in (nvme / "relative" / "zero3_swap").iterdir()] == [], "rank 0's folder left behind"


def test_swap_space_and_path_checks(tmp_path):
    """Before training: the space the rank's files need against the free space, a path that
    is a file, one that is not writable (skipped as root, who may write anywhere)."""
    import shutil

    from zero3.nvme.folder import SwapSetupError, check_path, check_space

    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(SwapSetupError, match=r"GiB free.*need .* GiB \(\d+ bytes\)"):
        check_space(tmp_path, free * 4)
    check_space(tmp_path, 4096)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(SwapSetupError, match="is not a folder"):
        check_path(str(a_file))
    if os.geteuid() != 0:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SwapSetupError, match="not writable"):
            check_path(str(locked))


def test_swap_io_moves_bytes_exactly_in_every_issue_mode(tmp_path):
    """The request paths of io.py (windowed, lockstep, single submit) write and read back
    the same bytes through the POSIX backend."""
    from zero3.nvme.backends import PosixFiles
    from zero3.nvme.buffers import aligned_empty
    from zero3.nvme.io import IssueSettings, SwapIO

    data = aligned_empty(5 * 4096)
    data.copy_(torch.randint(0, 255, (5 * 4096,), dtype=torch.uint8))
    for settings in (IssueSettings(4096, 2, 2, False, True), IssueSettings(4096, 2, 2, False, False),
                     IssueSettings(8192, 8, 1, True, True)):
        io = SwapIO(PosixFiles(), settings)
        path = tmp_path / f"f{settings.queue_depth}{settings.single_submit}{settings.overlap_events}"
        io.write(path, data).result()
        back = aligned_empty(5 * 4096)
        io.read(path, back).result()
        assert torch.equal(back, data) and io.bytes_written == io.bytes_read == data.numel()
        io.close()


def test_a_file_is_opened_once_when_many_threads_first_use_it(tmp_path):
    """SwapIO's worker threads write chunks of a new file at once: the backend opens each path
    once (a second handle used to be opened and dropped; KvikIO closed a dropped handle while
    its write was in flight, EBADF). Every descriptor is closed by close()."""
    import threading

    from zero3.nvme.backends import PosixFiles
    from zero3.nvme.buffers import aligned_empty

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    files, paths = PosixFiles(), [tmp_path / f"f{i}" for i in range(40)]
    chunk = aligned_empty(4096)
    chunk.fill_(7)
    start = threading.Barrier(8)

    def writer(k: int) -> None:
        start.wait()
        for path in paths:
            files.pwrite(path, chunk, k * 4096)

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    opened = open_fds() - before
    files.close()
    assert opened == len(paths) and open_fds() == before, (opened, open_fds(), before)
    assert all(p.stat().st_size == 8 * 4096 and set(p.read_bytes()) == {7} for p in paths)


def initialize_memory(rank: int, world: int, nvme: str) -> dict:
    """Host memory taken by initialize with every optimizer side on NVMe: its peak over the
    resident size before (the kernel's high-water mark, reset through clear_refs)."""
    import zero3

    torch.manual_seed(0)
    with torch.device("cpu"):
        model = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16)
                                      for _ in range(8)])
    config = config_for("nvme", nvme)
    config["zero_optimization"].update(sub_group_size=4 << 20, stage3_param_persistence_threshold=0)
    config["zero_optimization"]["offload_optimizer"]["buffer_count"] = 2
    config["gradient_accumulation_steps"] = 1

    def kib(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])

    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = kib("VmRSS:")
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
    grown = (kib("VmHWM:") - before) * 1024
    masters = sum(m.numel() * 4 for m in engine.optimizer.masters)
    stored = engine.optimizer.swap.pager.io.bytes_written
    shards = sum(sp.shard.numel() * sp.shard.element_size() for sp in engine.table.values())
    engine.destroy()
    return {"grown": grown, "masters": masters, "stored": stored, "shards": shards}


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc/self/clear_refs")
def test_initialize_writes_nvme_masters_without_holding_them_all(tmp_path):
    """The NVMe tier's masters are cast from the shards and written one swap group at a time:
    initialize's host peak, the parameter shards it makes aside, stays far below the masters'
    bytes (537 MB here; two staging buffers of 48 MB), which used to be held whole before the
    first write."""
    (tmp_path / "nvme").mkdir()
    [r] = run_ranks(initialize_memory, 1, str(tmp_path / "nvme"), timeout=300)
    assert r["stored"] >= r["masters"], r
    assert r["grown"] - r["shards"] < r["masters"] // 4, r  # the host shards (offload_param) aside
