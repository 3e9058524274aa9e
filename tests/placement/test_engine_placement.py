"""The engine under a GPU memory budget (placement.gpu_budget), on 2 and 4 gloo ranks.

On a CPU run the device tier and the host tier are the same memory, but the plan still
decides each piece's tier and so where it steps: device-tier sub-groups in `step()`,
host-tier ones on the overlapped host step's worker. Each check compares with the run that
keeps everything on the device (no offload): the same kernels over the same values, so
bit-identical on CPU. (On a GPU the device tier steps with CUDA's fused kernel and the host
tier with the CPU's, which round differently: bench/placement_bench.py reports by how much.)
"""

from __future__ import annotations

import pytest
import torch
from common import make_batches, make_model, optimizer_tensors, train_windows, two_param_groups
from harness import run_ranks

MICRO = 4
GA = 2
STEPS = 4


def build(budget, seed: int = 0, offload: bool = True, leaf_blocks: bool = False):
    import zero3

    model = make_model(seed=seed)
    if leaf_blocks:
        zero3.set_z3_leaf_modules(model, [type(model.blocks[0])])
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                  config=config_for(budget, offload))
    return engine


def config_for(budget, offload: bool = True) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "reduce_bucket_size": 500}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
        zero["offload_optimizer"] = {"device": "cpu", "overlap_step": True}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
              "gradient_clipping": 0.5, "zero_optimization": zero,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                          "warmup_num_steps": 3}}}
    if budget is not None:
        config["placement"] = {"gpu_budget": budget}
    return config


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    return train_windows(engine, rank, world, first, last, GA, MICRO, STEPS)


def final_state(engine) -> dict[str, torch.Tensor]:
    return optimizer_tensors(engine)


def tiers(engine) -> dict[str, tuple[str, str]]:
    return {sp.name: (engine.placement.params_tier(sp).value, engine.placement.state_tier(sp).value)
            for sp in engine.table.values()}


def accumulating(engine) -> list[str]:
    """The parameters whose window gradient the placement sums on the device."""
    return sorted(sp.name for sp in engine.table.values() if engine.placement.accumulates_on_device(sp))


def device_tier_bytes(engine) -> int:
    """Bytes of the engine's tensors the placement puts on the device tier, counted from the
    tensors themselves (shards, separate masters, optimizer state, resident parameters)."""
    def nbytes(t):
        return t.numel() * t.element_size()

    opt, placement = engine.optimizer, engine.placement
    opt.wait()
    total = sum(sp.numel * sp.param.element_size() for sp in engine.table.values() if sp.persistent)
    for sp in engine.table.values():
        if placement.params_tier(sp).value == "device":
            total += nbytes(sp.shard)
    for sp, master in zip(opt.params, opt.masters):
        if placement.state_tier(sp).value == "device":
            total += 0 if master is sp.shard else nbytes(master)
            total += sum(nbytes(v) for v in opt.optimizer.state[master].values() if isinstance(v, torch.Tensor))
    return total


def placement_run(rank: int, world: int, folder: str):
    import zero3
    from zero3.estimate import estimate_placement
    from zero3.placement.plan import PlacementError

    reference = build(None, offload=False)
    expected_losses = train(reference, rank, world, 0, STEPS)
    expected = final_state(reference)

    everything = build("1TiB")  # what the whole state needs, and the fixed part
    fixed, whole = everything.placement.plan.fixed_bytes, everything.placement.plan.device_bytes
    part = fixed + (whole - fixed) // 2

    partial = build(part)
    plan = partial.placement.plan
    groups = partial.optimizer.sub_groups()
    group_tiers = [{partial.placement.state_tier(partial.optimizer.params[i]).value for i in g} for g in groups]
    partial_losses = train(partial, rank, world, 0, 2)
    partial.save_checkpoint(folder, tag="half")
    partial_losses += train(partial, rank, world, 2, STEPS)

    moved = build(fixed)  # nothing placed on the device, then half of it, mid-training
    all_host = tiers(moved)
    moved_losses = train(moved, rank, world, 0, 2)
    moved.set_gpu_budget(part)
    moved_tiers, moved_accumulators = tiers(moved), accumulating(moved)
    moved_losses += train(moved, rank, world, 2, STEPS)

    resumed = build(fixed, seed=3)  # another budget: the checkpoint records no placement
    resumed.load_checkpoint(folder, tag="half")
    resumed_losses = train(resumed, rank, world, 2, STEPS)

    # `zero3 estimate` makes the engine's plan (decoder blocks as leaf units, as it assumes).
    leafy = build(part, leaf_blocks=True)
    estimated = estimate_placement(make_model(), world, config_for(part), part).plan
    engine_plan = leafy.placement.plan
    same_plan = ({u.name: u for u in estimated.units} == {u.name: u for u in engine_plan.units if u.name in
                                                          {e.name for e in estimated.units}}
                 and estimated.device_bytes == engine_plan.device_bytes and estimated.host_bytes == engine_plan.host_bytes)
    try:
        build(1000)
        too_small = "no error"
    except PlacementError as exc:
        too_small = str(exc)
    return {
        "expected_losses": expected_losses, "partial_losses": partial_losses, "moved_losses": moved_losses,
        "resumed_losses": resumed_losses,
        "partial_equal": _equal(expected, final_state(partial)), "moved_equal": _equal(expected, final_state(moved)),
        "resumed_equal": _equal(expected, final_state(resumed)),
        "partial_tiers": tiers(partial), "all_host": all_host, "moved_tiers": moved_tiers,
        "partial_accumulators": accumulating(partial), "moved_accumulators": moved_accumulators,
        "planned_accumulators": plan.counts()["accumulators_on_device"],
        "group_tiers": group_tiers, "budget": part, "planned_device": plan.device_bytes,
        # the tensors on the device tier, counted, with the working set the plan charges
        "counted": device_tier_bytes(partial) + plan.fixed_bytes - _resident_bytes(partial),
        "too_small": too_small, "estimate_is_the_engine_plan": same_plan,
        "estimate_plan": estimated.describe(), "engine_plan": engine_plan.describe(), "zero3_error_class": zero3.PlacementError is PlacementError,
    }


def _resident_bytes(engine) -> int:
    return sum(sp.numel * sp.param.element_size() for sp in engine.table.values() if sp.persistent)


def _equal(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (an empty list: bit-identical)."""
    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("world", [2, 4])
def test_placement_under_a_budget_trains_moves_and_resumes_exactly(tmp_path, world):
    for rank, r in enumerate(run_ranks(placement_run, world, str(tmp_path), timeout=400)):
        assert r["partial_losses"] == r["expected_losses"], rank
        assert r["partial_equal"] == [] and r["moved_equal"] == [] and r["resumed_equal"] == [], rank
        assert r["moved_losses"] == r["expected_losses"] and r["resumed_losses"] == r["expected_losses"][2 * GA:]
        # A part of the state on each tier, sub-groups never mixed.
        partial = set(r["partial_tiers"].values())
        assert ("device", "device") in partial and any(state == "host" for _, state in partial), partial
        assert all(len(t) == 1 for t in r["group_tiers"]) and {"device"} in r["group_tiers"]
        assert set(r["all_host"].values()) == {("host", "host")}
        assert r["moved_tiers"] == r["partial_tiers"]  # the same plan, reached by moving
        # with its gradient accumulators on the device (GA 2): placed at initialize and by a move alike
        assert r["planned_accumulators"] > 0 and r["partial_accumulators"], r["planned_accumulators"]
        assert r["moved_accumulators"] == r["partial_accumulators"], (r["moved_accumulators"], r["partial_accumulators"])
        # The budget holds the engine's own tensors.
        assert r["counted"] <= r["planned_device"] <= r["budget"], (r["counted"], r["planned_device"], r["budget"])
        assert "budget" in r["too_small"] and "gathered" in r["too_small"] and "GiB" in r["too_small"]
        assert r["zero3_error_class"]
        assert r["estimate_is_the_engine_plan"], (r["estimate_plan"], r["engine_plan"])


def realias_run(rank: int, world: int, dtype_name: str):
    """World size 1: a plan that takes aliased parameters off the device tier makes them
    copies again (released between uses); one that brings them back aliases them again."""
    import zero3

    dtype = getattr(torch, dtype_name)

    def built(budget, offload: bool = True):
        model = make_model().to(dtype)  # block 1 frozen
        engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                      config=config_for(budget, offload))
        return engine

    def train_to(engine, first: int, last: int) -> list[float]:
        batches, losses = make_batches(STEPS * GA, MICRO), []
        for step in range(first, last):
            for index in range(GA):
                x, y = batches[step * GA + index]
                loss = engine(x.to(dtype), y.to(dtype))
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
        return losses

    def view(engine) -> dict:
        sps = list(engine.table.values())
        master = {id(sp): m for sp, m in zip(engine.optimizer.params, engine.optimizer.masters)}
        return {
            "aliased": sorted(sp.name for sp in sps if sp.aliased),
            "on_device": sorted(sp.name for sp in sps if engine.placement.params_tier(sp).value == "device"
                                and engine.placement.state_tier(sp).value == "device"),
            "master_is_shard": sorted(sp.name for sp in sps if master.get(id(sp)) is sp.shard),
            "views": all(sp.shard.data_ptr() == sp.param.data_ptr() for sp in sps if sp.aliased),
            "released": sorted(sp.name for sp in sps if sp.state.value == "sharded"),
            "fetch": sorted(sp.name for unit in engine.units for sp in unit.fetch_list()),
            "persistent": sorted(sp.name for sp in sps if sp.persistent),
            "small": sorted(sp.name for sp in sps if sp.numel <= 30),  # the config's persistence threshold
            "frozen": sorted(sp.name for sp in sps if not sp.requires_grad),
        }

    reference = built(None, offload=False)
    expected_losses = train_to(reference, 0, STEPS)
    expected = final_state(reference)
    everything = built(1 << 40)
    fixed, whole = everything.placement.plan.fixed_bytes, everything.placement.plan.device_bytes
    engine = built(fixed + (whole - fixed) // 2)
    views = {"part": view(engine)}
    losses = train_to(engine, 0, 1)
    engine.set_gpu_budget(fixed)
    views["host"] = view(engine)
    losses += train_to(engine, 1, 2)
    engine.set_gpu_budget(whole)
    views["whole"] = view(engine)
    losses += train_to(engine, 2, STEPS)
    return {"expected_losses": expected_losses, "losses": losses, "differ": _equal(expected, final_state(engine)),
            "views": views, "reference": view(reference)}


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_world_one_new_plans_alias_what_they_keep_on_the_device(dtype_name):
    [r] = run_ranks(realias_run, 1, dtype_name, timeout=300)
    views = r["views"]
    assert r["losses"] == r["expected_losses"] and r["differ"] == [], (r["losses"], r["differ"])
    # At initialize, what the budget keeps on the device is aliased (before the masters exist).
    part = views["part"]
    assert part["aliased"] == part["on_device"] and part["aliased"] and part["views"], part
    # All to the host: every alias undone, those parameters released and fetched again (and
    # the plan charges an aliased parameter once: the budget of nothing on the device holds).
    host = views["host"]
    left = set(part["aliased"]) - set(host["on_device"])
    assert host["aliased"] == host["on_device"] == [], host
    assert left - set(host["small"]) and left - set(host["small"]) <= set(host["released"]) & set(host["fetch"]), host
    assert host["persistent"] == sorted(set(host["small"]) | set(host["aliased"])), host  # the config's, and aliased
    # All back: aliased again, none fetched. An fp32 master that is its shard moves onto the
    # parameter's storage with it (one copy of the bytes); 16-bit shards keep fp32 masters apart.
    whole = views["whole"]
    assert whole["aliased"] == whole["on_device"] and whole["views"] and whole["fetch"] == [], whole
    trainable_aliased = set(whole["aliased"]) - set(whole["frozen"])
    if dtype_name == "float32":
        assert trainable_aliased and trainable_aliased <= set(whole["master_is_shard"]), whole
    else:
        assert trainable_aliased and whole["master_is_shard"] == [], whole
