"""The NVMe tier of parameter shards (offload_param.device "nvme"), on 2 gloo ranks, a
temporary folder standing in for the NVMe drive.

One launch of 2 ranks checks, against the host-offload run (offload_param "cpu": the same
kernels over the same values):
- every unit's shards on NVMe, with the overlapped host step: losses, every master,
  optimizer state and shard bit-identical; the swap files exist while training (their own
  folder per rank, beside the optimizer tier's), and destroy() removes them;
- a frozen base with a trainable head (a LoRA-like model): bit-identical, and the frozen
  shards are written once, at initialize (bytes written per step = the trainable shards');
- checkpoints across tiers both ways, and a resume from an NVMe checkpoint into an engine
  whose max_in_cpu splits the shards between the host and NVMe: bit-exact to the end;
- a missing nvme_path on one rank: SwapSetupError on every rank, naming the rank and the key;
  a buffer_size too small for a shard: PlacementError naming it and the size needed;
- a full disk during a parameter write (RLIMIT_FSIZE lowered in the rank: the kernel's EFBIG,
  no mock): a SwapIOError from step() naming the file and the fix; the last checkpoint still
  loads into a new engine, which goes on exactly.
The leftovers of a killed run are cleared at the start, a live run's folder is left alone.
"""

from __future__ import annotations

from pathlib import Path

import torch
from common import make_model, two_param_groups
from harness import run_ranks
from nvme_cases import (beside_a_live_and_a_killed_run, full_disk_then_resume, missing_on_one_rank, setup_error,
                        train_in_compute_dtype)

MICRO, GA, STEPS = 4, 2, 4


def config_for(device: str, nvme: str | None = None, overlap: bool = True, max_in_cpu: int = 0) -> dict:
    param = {"device": device}
    if device == "nvme":  # 2 buffers of 4096 elements: every unit's shards fit one, two units ahead
        param.update(nvme_path=nvme, buffer_count=2, buffer_size=4096, max_in_cpu=max_in_cpu)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "reduce_bucket_size": 500,
            "sub_group_size": 400, "offload_param": param,
            "offload_optimizer": {"device": "cpu", "overlap_step": overlap}}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
            "gradient_clipping": 0.5, "zero_optimization": zero, "bf16": {"enabled": True},
            "aio": {"block_size": 4096, "queue_depth": 2, "intra_op_parallelism": 2}}


def build(config: dict, seed: int = 0, lora: bool = False):
    import zero3

    model = make_model(seed=seed)
    if lora:  # a frozen base, a trainable head
        model.requires_grad_(False)
        model.head.requires_grad_(True)
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=config)
    return engine


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    return train_in_compute_dtype(engine, rank, world, first, last, GA, MICRO, STEPS)


def state_of(engine) -> dict[str, torch.Tensor]:
    """Every shard's values (on any tier), master and optimizer state, by parameter name."""
    opt = engine.optimizer
    opt.wait()
    out = {f"{sp.name}/shard": sp.shard_values().clone() for sp in engine.table.values()}
    for sp, master in zip(opt.params, opt.masters):
        out[sp.name] = master.clone()
        out.update({f"{sp.name}/{key}": value.clone() for key, value in opt.optimizer.state[master].items()})
    return out


def differing(a: dict, b: dict) -> list[str]:
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])] + [k for k in b if k not in a]


def shard_tiers(engine) -> set[str]:
    return {engine.placement.params_tier(sp).value for sp in engine.table.values() if not sp.persistent}


def param_nvme_run(rank: int, world: int, folder: str, nvme: str, leftover: str) -> dict:
    results = {}
    host = build(config_for("cpu"))
    expected = train(host, rank, world, 0, 2)
    host.save_checkpoint(folder, tag="host_half")
    expected += train(host, rank, world, 2, STEPS)
    reference = state_of(host)
    host.destroy()

    engine = build(config_for("nvme", nvme))
    results["leftover_cleared"] = not Path(leftover).exists()
    swap_folder = engine.param_swap.folder.path
    losses = train(engine, rank, world, 0, 2)
    engine.save_checkpoint(folder, tag="nvme_half")
    results["swap_files"] = (swap_folder.name, sorted(p.name for p in swap_folder.iterdir()))
    losses += train(engine, rank, world, 2, STEPS)
    results.update(losses=losses == expected, state=differing(reference, state_of(engine)),
                   tiers=shard_tiers(engine), plan=engine.placement.plan.describe(),
                   meta=[sp.name for sp in engine.table.values() if sp.backing and sp.shard.device.type != "meta"])
    engine.destroy()
    results["removed_at_destroy"] = not swap_folder.exists()
    results.update(lora_run(rank, world, nvme))
    results.update(cross_loads(rank, world, folder, nvme, expected, reference))
    results["missing"] = missing_on_one_rank(rank, nvme, lambda path: setup_error(lambda: build(config_for("nvme", path))))
    small = {**config_for("nvme", nvme), "zero_optimization": {
        **config_for("nvme", nvme)["zero_optimization"],
        "offload_param": {"device": "nvme", "nvme_path": nvme, "buffer_size": 100, "max_in_cpu": 0}}}
    results["small_buffer"] = setup_error(lambda: build(small))
    results.update(full_disk_then_resume(
        lambda seed: build(config_for("nvme", nvme, overlap=False), seed=seed),
        lambda engine, first, last: train(engine, rank, world, first, last), folder, 1024,
        lambda engine: engine.param_swap.folder.path, state_of, expected[2 * GA:], reference, STEPS))
    return results


def lora_run(rank: int, world: int, nvme: str) -> dict:
    """A frozen base: bit-identical to the host tier, its shards never written after initialize."""
    host = build(config_for("cpu"), lora=True)
    expected = train(host, rank, world, 0, 3)
    reference = state_of(host)
    host.destroy()
    engine = build(config_for("nvme", nvme, overlap=False), lora=True)
    swap = engine.param_swap
    at_start = swap.io.bytes_written
    trainable = sum(-(-region.nbytes // 4096) * 4096 for sp in engine.table.values()
                    if sp.requires_grad and (region := swap.regions.get(id(sp))) is not None)
    frozen = sum(1 for sp in engine.table.values() if not sp.requires_grad and id(sp) in swap.regions)
    losses = train(engine, rank, world, 0, 3)
    swap.drain()
    out = {"lora": (losses == expected, differing(reference, state_of(engine)), frozen > 0, trainable > 0,
                    swap.io.bytes_written - at_start == 3 * trainable)}
    engine.destroy()
    return out


def cross_loads(rank: int, world: int, folder: str, nvme: str, expected: list, reference: dict) -> dict:
    """NVMe-saved into a host engine, host-saved into an NVMe engine, and an NVMe resume into
    an engine whose max_in_cpu keeps the first unit on the host."""
    out = {}
    for name, config, tag in (("host_from_nvme", config_for("cpu"), "nvme_half"),
                              ("nvme_from_host", config_for("nvme", nvme), "host_half"),
                              ("split_from_nvme", config_for("nvme", nvme, max_in_cpu=200), "nvme_half")):
        engine = build(config, seed=5)
        engine.load_checkpoint(folder, tag=tag)
        losses = train(engine, rank, world, 2, STEPS)
        out[name] = (losses == expected[2 * GA:], differing(reference, state_of(engine)))
        out[f"{name}_tiers"] = shard_tiers(engine)
        engine.destroy()
    return out


def test_param_nvme_tier_is_exact_resumes_across_tiers_survives_a_full_disk(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    results, held = beside_a_live_and_a_killed_run(
        nvme, lambda leftover: run_ranks(param_nvme_run, 2, str(tmp_path / "ckpt"), str(nvme), str(leftover),
                                         timeout=500))
    for rank, r in enumerate(results):
        assert r["leftover_cleared"], rank
        assert r["losses"] and r["state"] == [] and r["tiers"] == {"nvme"}, (rank, r["plan"], r["state"])
        assert "parameter shards of" in r["plan"] and "units on NVMe" in r["plan"], r["plan"]
        assert r["meta"] == [], r["meta"]  # between uses an NVMe shard holds no values in memory
        name, files = r["swap_files"]
        assert name.endswith(f"rank{rank}-params") and "lock" in files and any(f.endswith(".swp") for f in files)
        assert r["removed_at_destroy"], rank
        same, differ, has_frozen, has_trainable, written_once = r["lora"]
        assert same and differ == [] and has_frozen and has_trainable and written_once, (rank, r["lora"])
        for name in ("host_from_nvme", "nvme_from_host", "split_from_nvme"):
            assert r[name] == (True, []), (rank, name, r[name])
        assert r["host_from_nvme_tiers"] == {"host"} and r["nvme_from_host_tiers"] == {"nvme"}
        assert r["split_from_nvme_tiers"] == {"host", "nvme"}, r["split_from_nvme_tiers"]
        assert "SwapSetupError" in r["missing"] and "does not exist" in r["missing"], r["missing"]
        assert "offload_param.nvme_path" in r["missing"], r["missing"]
        small = r["small_buffer"]  # the largest shard: a block's 24 x 24 weight, 288 elements a rank
        assert small.startswith("PlacementError: offload_param.buffer_size is 100 elements"), small
        assert "linear.weight on this rank is 288 elements" in small and "at least 288" in small, small
        assert "File too large" in r["full_error"] and "params" in r["full_error"], r["full_error"]
        assert "offload_param.max_in_cpu" in r["full_error"] and "last checkpoint" in r["full_error"]
        assert r["full_removed"] and r["full_resumed"] == (True, []), (rank, r["full_resumed"])
    assert "rank 1" in results[0]["missing"]  # rank 0's folder was fine: it names the rank that failed
    assert [p.name for p in (nvme / "zero3_swap").iterdir()] == [held.name], "swap folders left behind"
    assert [p.name for p in (nvme / "relative" / "zero3_swap").iterdir()] == [], "rank 0's folder left behind"


def test_estimate_shows_parameter_shards_on_nvme():
    """`zero3 estimate`'s placement (estimate_placement) with offload_param "nvme": the units
    past max_in_cpu on NVMe, as the engine's plan puts them."""
    from zero3.estimate import estimate_placement

    model = make_model()
    config = config_for("nvme", "/nowhere", max_in_cpu=200)
    config["train_micro_batch_size_per_gpu"] = 1
    plan = estimate_placement(model, 2, config, None).plan
    assert {u.params.value for u in plan.units if u.name == "embed"} == {"host"}
    assert {u.params.value for u in plan.units if u.name.startswith("blocks")} == {"nvme"}
    assert "units on NVMe" in plan.describe() and plan.nvme_param_bytes > 0
