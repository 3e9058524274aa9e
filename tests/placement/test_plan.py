"""The placement planner (zero3/placement/plan.py) on sizes alone: budgets that fit nothing,
everything and a part; frozen units first; DeepSpeed's offload_optimizer.ratio; a budget too
small for what must be on the device; the config's byte sizes."""

from __future__ import annotations

import pytest

from zero3.config import ConfigError, from_deepspeed
from zero3.placement.plan import PlacementError, PlanInputs, Tier, UnitSize, make_plan, widened

# Four units in forward order: a frozen embedding, two trainable blocks, a trainable head.
UNITS = (
    UnitSize("embed", param_bytes=100, state_bytes=0, gathered_bytes=200),
    UnitSize("block0", param_bytes=50, state_bytes=400, gathered_bytes=100),
    UnitSize("block1", param_bytes=50, state_bytes=400, gathered_bytes=100),
    UnitSize("head", param_bytes=10, state_bytes=80, gathered_bytes=20),
)
WORKING = 300
RESIDENT = 7


def plan_under(budget, ratio=None, param_offload=True, state_offload=True):
    return make_plan(PlanInputs(UNITS, param_offload, state_offload, ratio, budget, RESIDENT, WORKING, "test"))


def tiers(plan):
    return {u.name: (u.params.value, u.state.value) for u in plan.units}


def test_no_budget_is_the_config_placement():
    plan = plan_under(None)
    assert all(u.params is Tier.HOST and u.state is Tier.HOST for u in plan.units)
    assert plan.device_bytes == RESIDENT + WORKING and plan.host_bytes == 210 + 880
    plan = plan_under(None, param_offload=False)
    assert all(u.params is Tier.DEVICE for u in plan.units)
    assert all(u.state is Tier.HOST for u in plan.units if u.name != "embed")  # frozen: no optimizer side


def test_budget_for_the_fixed_part_only_places_nothing_on_the_device():
    plan = plan_under(RESIDENT + WORKING)
    assert all(u.params is Tier.HOST and u.state is Tier.HOST for u in plan.units)
    assert plan.device_bytes == RESIDENT + WORKING == plan.budget


def test_budget_that_fits_everything_keeps_everything_on_the_device():
    everything = RESIDENT + WORKING + 210 + 880
    plan = plan_under(everything)
    assert all(u.params is Tier.DEVICE and u.state is Tier.DEVICE for u in plan.units)
    assert plan.device_bytes == everything and plan.host_bytes == 0


def test_part_budget_places_frozen_shards_then_shards_then_state_in_forward_order():
    # 100 left after the fixed part: only the frozen embedding's shard fits first.
    assert tiers(plan_under(RESIDENT + WORKING + 100)) == {
        "embed": ("device", "device"), "block0": ("host", "host"), "block1": ("host", "host"),
        "head": ("host", "host")}
    # 210 + 400: every shard, then block0's optimizer side; block1's (400) no longer fits,
    # the head's (80) does not either with 0 left.
    plan = plan_under(RESIDENT + WORKING + 210 + 400)
    assert tiers(plan) == {"embed": ("device", "device"), "block0": ("device", "device"),
                           "block1": ("device", "host"), "head": ("device", "host")}
    assert plan.device_bytes == RESIDENT + WORKING + 610 <= plan.budget
    # 80 more: the head's optimizer side fits after block1's was passed over.
    assert tiers(plan_under(RESIDENT + WORKING + 210 + 480))["head"] == ("device", "device")


def test_device_bytes_never_exceed_the_budget():
    for budget in range(RESIDENT + WORKING, RESIDENT + WORKING + 1100, 7):
        plan = plan_under(budget)
        assert plan.device_bytes <= budget
        assert plan.device_bytes + plan.host_bytes == RESIDENT + WORKING + 1090


def test_ratio_keeps_deepspeeds_first_sub_groups_on_the_device():
    # Three trainable units: ratio 0.5 keeps int(0.5 * 3) = 1 on the device, the first.
    plan = plan_under(None, ratio=0.5)
    assert [u.state.value for u in plan.units if u.name != "embed"] == ["device", "host", "host"]
    assert [u.state.value for u in plan_under(None, ratio=0.0).units if u.name != "embed"] == ["device"] * 3
    assert [u.state.value for u in plan_under(None, ratio=1.0).units if u.name != "embed"] == ["host"] * 3
    # With a budget, the ratio still decides the optimizer side; shards fill what is left.
    plan = plan_under(RESIDENT + WORKING + 400 + 100, ratio=0.6)  # int(0.4 * 3) = 1 unit's state
    assert tiers(plan)["block0"][1] == "device" and tiers(plan)["embed"] == ("device", "device")


def test_budget_too_small_names_the_largest_unit_its_size_and_the_budget():
    with pytest.raises(PlacementError) as info:
        plan_under(WORKING)  # less than the working set and the resident parameters
    message = str(info.value)
    assert "'embed'" in message and "gathered" in message and "budget" in message
    assert "placement.gpu_budget" in message  # the fix
    # The ratio's device states must fit too.
    with pytest.raises(PlacementError, match="state the config keeps on the device"):
        plan_under(RESIDENT + WORKING + 100, ratio=0.0)


def test_config_reads_sizes_and_refuses_nonsense():
    def parse(placement=None, ratio=None):
        zero = {"stage": 3, "offload_optimizer": {"device": "cpu", **({} if ratio is None else {"ratio": ratio})}}
        config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero}
        if placement is not None:
            config["placement"] = placement
        return from_deepspeed(config, 1)

    assert parse().placement.gpu_budget is None and parse().zero.offload_optimizer.ratio is None
    assert parse({"gpu_budget": "40GiB"}).placement.gpu_budget == 40 << 30
    assert parse({"gpu_budget": "38.5 GB"}).placement.gpu_budget == 38_500_000_000
    assert parse({"gpu_budget": 1024, "activation_reserve": "2MiB"}).placement.activation_reserve == 2 << 20
    assert parse(ratio=0.3).zero.offload_optimizer.ratio == 0.3
    for bad in ({"gpu_budget": "lots"}, {"gpu_budget": -1}, {"budget": 1}):
        with pytest.raises(ConfigError):
            parse(bad)
    with pytest.raises(ConfigError, match="between 0 and 1"):
        parse(ratio=1.5)


def test_widening_brings_more_to_the_device_and_nothing_back():
    from zero3.placement.plan import widened

    first = plan_under(RESIDENT + WORKING + 210 + 400)  # block0's optimizer side on the device
    inputs = PlanInputs(UNITS, True, True, None, RESIDENT + WORKING + 210 + 880, RESIDENT, WORKING, "more")
    wider = widened(first, make_plan(inputs), inputs)
    assert all(u.params is Tier.DEVICE and u.state is Tier.DEVICE for u in wider.units)
    assert wider.device_bytes == RESIDENT + WORKING + 1090 and wider.host_bytes == 0
    # A proposal that would put less on the device takes nothing away.
    smaller = PlanInputs(UNITS, True, True, None, RESIDENT + WORKING, RESIDENT, WORKING, "less")
    assert tiers(widened(first, make_plan(smaller), smaller)) == tiers(first)


# The same units with their gradient bytes (a quarter of each optimizer side: fp32 gradient,
# master and two Adam moments).
GRADED = tuple(UnitSize(u.name, u.param_bytes, u.state_bytes, u.gathered_bytes, u.state_bytes // 4) for u in UNITS)


def plan_accumulating(budget, steps, ratio=None):
    return make_plan(PlanInputs(GRADED, True, True, ratio, budget, RESIDENT, WORKING, "test", steps))


def accumulators(plan):
    return [u.name for u in plan.units if u.accumulates_on_device]


def test_accumulation_puts_gradient_accumulators_before_optimizer_sides():
    shards = RESIDENT + WORKING + 210
    # No accumulation: the 400 left go to block0's optimizer side, as before.
    assert accumulators(plan_accumulating(shards + 400, steps=1)) == []
    # Accumulating over 4 micro-steps: accumulators of every host-side unit first (100 + 100 + 20),
    # then optimizer sides at their bytes less their accumulator's: block0's (300) and block1's
    # do not fit the 180 left, the head's (80 - 20) does.
    plan = plan_accumulating(shards + 400, steps=4)
    assert accumulators(plan) == ["block0", "block1"]
    assert [u.state.value for u in plan.units] == ["device", "host", "host", "device"]
    assert plan.device_bytes == shards + 200 + 80
    plan = plan_accumulating(shards + 520, steps=4)
    assert tiers(plan)["block0"] == ("device", "device") and accumulators(plan) == ["block1", "head"]
    assert plan.device_bytes == shards + 520 <= plan.budget
    # Host bytes are unchanged by accumulators: the optimizer side (and its host gradient) stays there.
    assert plan.host_bytes == 400 + 80
    assert "gradient accumulators of 2 host-side units" in plan.describe()


def test_accumulators_fit_the_budget_and_vanish_without_one():
    for budget in range(RESIDENT + WORKING, RESIDENT + WORKING + 1100, 7):
        plan = plan_accumulating(budget, steps=8)
        assert plan.device_bytes <= budget
        assert all(u.state is Tier.HOST for u in plan.units if u.accumulates_on_device)
    assert accumulators(plan_accumulating(None, steps=8)) == []  # no budget: the config's placement
    # A ratio decides the optimizer sides; accumulators take the host-side ones' room left.
    plan = plan_accumulating(RESIDENT + WORKING + 400 + 210 + 120, steps=2, ratio=0.6)
    assert tiers(plan)["block0"][1] == "device" and accumulators(plan) == ["block1", "head"]


def test_widening_keeps_accumulators_and_replaces_them_by_sides():
    from zero3.placement.plan import widened

    first = plan_accumulating(RESIDENT + WORKING + 210 + 220, steps=4)
    assert accumulators(first) == ["block0", "block1", "head"]
    inputs = PlanInputs(GRADED, True, True, None, RESIDENT + WORKING + 210 + 880, RESIDENT, WORKING, "more", 4)
    wider = widened(first, make_plan(inputs), inputs)
    assert accumulators(wider) == [] and all(u.state is Tier.DEVICE for u in wider.units)
    assert wider.device_bytes == RESIDENT + WORKING + 1090


def test_predicted_peak_adds_the_reserve_and_state_bytes_leave_out_the_working_set():
    from zero3.placement.budget import GIB, margin, provisional_budget

    budget = RESIDENT + WORKING + 210 + 400
    stated = make_plan(PlanInputs(UNITS, True, True, None, budget, RESIDENT, WORKING, "test", reserve=1000))
    assert stated.predicted_peak == stated.device_bytes + 1000 and "peak" in stated.describe()
    assert stated.state_bytes_on_device == stated.device_bytes - WORKING == RESIDENT + 210 + 400
    explicit = plan_under(budget)  # no known reserve: the engine's own bytes alone
    assert explicit.predicted_peak == explicit.device_bytes and "reserve" not in explicit.describe()
    # The provisional first-window budget of a measured "auto": half the card less the margin.
    assert provisional_budget(80 * GIB) == 40 * GIB - margin(80 * GIB) == 36 * GIB
    assert provisional_budget(1 * GIB) == 0


def test_host_shards_that_do_not_fit_are_spread_through_the_forward_order():
    layers = tuple(UnitSize(f"layer{i}", param_bytes=10, state_bytes=0, gathered_bytes=20) for i in range(8))
    plan = make_plan(PlanInputs(layers, True, True, None, RESIDENT + WORKING + 50, RESIDENT, WORKING, "test"))
    host = [u.name for u in plan.units if u.params is Tier.HOST]
    # five of eight fit: the three on the host are evenly spaced, not the last three in a row
    assert host == ["layer1", "layer4", "layer6"], host
    assert plan.device_bytes == RESIDENT + WORKING + 50
    # a leftover that fits one more host unit takes it (in forward order among the spread ones)
    plan = make_plan(PlanInputs(layers, True, True, None, RESIDENT + WORKING + 55, RESIDENT, WORKING, "test"))
    assert [u.name for u in plan.units if u.params is Tier.HOST] == ["layer1", "layer4", "layer6"]
    plan = make_plan(PlanInputs(layers, True, True, None, RESIDENT + WORKING + 75, RESIDENT, WORKING, "test"))
    assert [u.name for u in plan.units if u.params is Tier.HOST] == ["layer4"]


def test_parameter_shards_past_max_in_cpu_go_to_nvme_and_stay_there():
    """Rule 5: host parameter shards kept, whole units in forward order, while their elements
    fit max_in_cpu; a unit that does not fit goes to NVMe, a later smaller one may still fit.
    A budget places device shards first; a re-plan keeps the NVMe units where they are."""
    units = tuple(UnitSize(u.name, u.param_bytes, u.state_bytes, u.gathered_bytes, param_numel=u.param_bytes // 2)
                  for u in UNITS)  # embed 50 elements, block0 25, block1 25, head 5

    def planned(max_in_cpu, budget=None, nvme_param_units=None):
        return make_plan(PlanInputs(units, True, True, None, budget, RESIDENT, WORKING, "test", params_nvme=True,
                                    max_in_cpu=max_in_cpu, param_staging_bytes=64,
                                    nvme_param_units=nvme_param_units))

    plan = planned(60)  # embed (50) fits, block0 (25) and block1 do not, the head (5) still does
    assert {u.name: u.params.value for u in plan.units} == {
        "embed": "host", "block0": "nvme", "block1": "nvme", "head": "host"}
    assert plan.nvme_param_bytes == 100 and plan.host_bytes == 110 + 880 + 64  # staging buffers on the host
    assert plan.state_tier("embed") is Tier.HOST  # a frozen unit's (absent) side is never "nvme"
    assert "parameter shards of 2/4 units on NVMe" in plan.describe()
    assert all(u.params is Tier.NVME for u in planned(0).units)
    assert planned(0).state_tier("embed") is Tier.HOST
    # with a budget, what fits the device goes there first; the host share of the rest follows
    plan = planned(25, budget=RESIDENT + WORKING + 100)
    assert {u.name: u.params.value for u in plan.units} == {
        "embed": "device", "block0": "host", "block1": "nvme", "head": "nvme"}
    # a re-plan under a larger budget moves none of the NVMe units, and no other joins them
    replan = planned(10**9, budget=RESIDENT + WORKING + 10**6, nvme_param_units=("block1", "head"))
    assert {u.name: u.params.value for u in replan.units} == {
        "embed": "device", "block0": "device", "block1": "nvme", "head": "nvme"}
    assert widened(plan, replan, PlanInputs(units, True, True, budget=10**6)).params_tier("head") is Tier.NVME
    assert planned(0).describe().count("NVMe") == 1 and plan_under(None).describe().count("NVMe") == 0


def test_optimizer_sides_on_nvme_charge_their_staging_buffers_to_the_host():
    """Rule 4's staging: buffer_count buffers of the largest swap group, bounded by the group
    bound and by what the swap files hold, are in host_bytes; none without an NVMe unit."""
    units = tuple(UnitSize(u.name, u.param_bytes, u.state_bytes, u.gathered_bytes, grad_bytes=u.state_bytes // 4,
                           swap_bytes=u.state_bytes * 3 // 4) for u in UNITS)  # block0 300 in files, head 60

    def planned(host_budget, group_bytes):
        return make_plan(PlanInputs(units, True, True, None, None, RESIDENT, WORKING, "test", state_nvme=True,
                                    host_budget=host_budget, state_staging_buffers=3, state_group_bytes=group_bytes))

    plan = planned(400, 120)  # block0 stays on the host; block1 (300 in files) and the head (60) on NVMe
    assert [u.state.value for u in plan.units] == ["host", "host", "nvme", "nvme"]
    assert plan.nvme_bytes == 360 and plan.state_staging_bytes == 3 * 120
    assert plan.host_bytes == 210 + 400 + 100 + 20 + 3 * 120  # shards, host side, NVMe units' gradients, staging
    assert planned(400, None).state_staging_bytes == 3 * 360  # no bound: one group of the whole tier
    assert planned(480, 1000).state_staging_bytes == 3 * 300  # no more than the files hold
    assert planned(10**6, 120).state_staging_bytes == 0  # everything on the host: no swap files, no buffers
