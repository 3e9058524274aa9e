"""Access patterns: control flow that changes between steps, and control flow that differs between ranks (leaf modules; errors naming the block).

Cases and machinery: tests/access_cases.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from access_cases import (
    MICRO,
    WORLDS,
    Case,
    Driver,
    TinyLM,
    build_seeded,
    case,
    check_cases,
    engine_driver,
    initialize,
    regression_batch,
)
from harness import run_ranks
from torch import nn


# ------------------------------------------------ 5. control flow changing between steps
class Branchy(nn.Module):
    """`sometimes` runs on two steps of three; `route` picks `a` or `b` from the data."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, flags):
        h = torch.tanh(self.inp(x))
        if flags[0] > 0:
            h = h + torch.tanh(self.sometimes(h))
        h = self.a(h) if flags[1] > 0 else self.b(h)
        return F.mse_loss(self.head(h), y)


def branchy_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    g = torch.Generator().manual_seed(step)  # the same on every rank
    flags = torch.tensor([step % 3 != 0, torch.rand((), generator=g) > 0.5])
    loss = driver(x, y, flags)
    driver.backward(loss)
    return [loss.item()]


case("changing_control_flow", build=Branchy, step=branchy_step, threshold=0)
case("changing_control_flow_resident", build=Branchy, step=branchy_step, threshold=8)


# ------------------------------------------------ 6. control flow that differs between ranks
class MoE(nn.Module):
    """An MoE-style block: each token goes to the expert its route names (ranks differ)."""

    def __init__(self, width: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.gate = nn.Linear(width, experts)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(experts))

    def forward(self, h, route):
        weights = torch.softmax(self.gate(h), dim=-1)
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            mask = route == index
            if mask.any():
                out = out.index_add(0, mask.nonzero().flatten(),
                                    expert(h[mask]) * weights[mask, index:index + 1])
        return out


class MoEModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.moe = MoE()
        self.proj = nn.Linear(8, 32)
        self.head = nn.Linear(32, 3)

    def forward(self, x, y, route):
        h = torch.tanh(self.inp(x))
        h = h + self.moe(h, route)
        return F.mse_loss(self.head(torch.tanh(self.proj(h))), y)


def expert_route(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank r sends its tokens to experts {r, r + 1} (mod 4) or, at 4 ranks, to expert r alone."""
    if world >= 4:
        return torch.full((MICRO,), rank % 4)
    return torch.tensor([(2 * rank + i % 2) % 4 for i in range(MICRO)])


def moe_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    loss = driver(x, y, expert_route(step, rank, world))
    driver.backward(loss)
    return [loss.item()]


def declare_moe_leaf(model: nn.Module, framework: str) -> None:
    if framework == "zero3":
        from zero3 import set_z3_leaf_modules
    else:
        from deepspeed.utils import set_z3_leaf_modules
    set_z3_leaf_modules(model, [MoE])


case("moe_set_z3_leaf_modules", build=MoEModel, step=moe_step, threshold=0, prepare=declare_moe_leaf)
# Granularity (elements // layers, DeepSpeed's): the MoE block 324 // 6 = 54, the whole model
# 767 // 10 = 76, childless modules never; so the threshold 60 makes the MoE block a leaf
# and nothing else (test_06_leaf_selection checks this).
MOE_GRANULARITY_THRESHOLD = 60
case("moe_granularity_threshold", build=MoEModel, step=moe_step, threshold=0,
     zero={"stage3_module_granularity_threshold": MOE_GRANULARITY_THRESHOLD})
case("moe_config_leaf_module", build=MoEModel, step=moe_step, threshold=0,
     zero={"leaf_module": {"classes": ["MoE"]}})


@pytest.mark.parametrize("world", WORLDS)
def test_05_control_flow_changing_between_steps(world, tmp_path):
    check_cases(["changing_control_flow", "changing_control_flow_resident"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_dependent_control_flow_in_a_leaf(world, tmp_path):
    """Each rank routes to different experts; the MoE block is a leaf three ways."""
    check_cases(["moe_set_z3_leaf_modules", "moe_granularity_threshold", "moe_config_leaf_module"], world, tmp_path)


# ============================================================================ 6. errors
def test_06_leaf_selection():
    """Which modules become leaves: declared, by threshold (DeepSpeed's granularity), by config."""
    import zero3
    from zero3.config import LeafModuleConfig
    from zero3.params.partition import ShardedParam
    from zero3.params.units import LeafModuleError, build_units, granularity, threshold_leaves

    model = MoEModel()
    values = granularity(model)
    assert (values[model], values[model.moe]) == (767 // 10, 324 // 6)
    assert threshold_leaves(model, MOE_GRANULARITY_THRESHOLD) == [model.moe]
    assert threshold_leaves(model, 100) == [model]  # parents first: the root itself
    assert threshold_leaves(model, 0) == []
    table = {p: ShardedParam(p, n, 0, 1, False, torch.device("cpu")) for n, p in model.named_parameters()}

    def leaf_names(**kwargs):
        return [u.name for u in build_units(model, table, **kwargs) if u.leaf]

    assert leaf_names(granularity_threshold=MOE_GRANULARITY_THRESHOLD) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(classes=("MoE",))) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(names=("moe",))) == ["moe"]
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig(name_suffixes=("oe",))) == ["moe"]
    # Nothing declared (the defaults name transformers' MoE classes): each ModuleList element
    # is gathered whole, the default fetch unit.
    assert leaf_names(granularity_threshold=0, leaf_module=LeafModuleConfig()) == [f"moe.experts.{i}" for i in range(4)]
    units = build_units(model, table, 0, leaf_module=LeafModuleConfig(classes=("MoE",)))
    moe = next(u for u in units if u.name == "moe")
    assert len(moe.params) == 2 + 2 * 4  # the gate and every expert, gathered as one
    assert [u.name for u in units] == ["<root>", "inp", "moe", "proj", "head"]
    fresh = MoEModel()
    assert zero3.set_z3_leaf_modules(fresh, ["MoE"]) == [fresh.moe]  # by class name, as DeepSpeed
    assert [u.name for u in build_units(fresh, {p: ShardedParam(p, n, 0, 1, False, torch.device("cpu"))
                                                for n, p in fresh.named_parameters()}, 0) if u.leaf] == ["moe"]
    with pytest.raises(LeafModuleError, match="no module of the classes"):
        zero3.set_z3_leaf_modules(fresh, [TinyLM])


def diverging_worker(rank: int, world: int, kind: str, propagate: bool = False):
    """One training step of a model whose control flow differs between ranks; the error text.

    With `propagate`, the DivergenceError is not caught (for runs where some rank dies).
    """
    import time

    import zero3
    from zero3.params.divergence import DivergenceError

    if kind == "experts":
        c = Case(build=MoEModel, step=moe_step, threshold=0)
    elif kind == "resident_module_skipped":
        c = Case(build=RankSkip, step=rank_skip_step, threshold=40)  # `extra` resident, `head` not
    else:
        c = Case(build=RankSkip, step=rank_skip_step, threshold=0)
    engine = initialize(build_seeded(c, 0), c, "zero3")
    driver = engine_driver(engine, rank, world, zero3.GatheredParameters)
    start = time.monotonic()
    try:
        c.step(driver, 0, rank, world)
    except DivergenceError as exc:
        if propagate:
            raise
        return str(exc), time.monotonic() - start
    raise AssertionError(f"rank {rank}: no DivergenceError")


class RankSkip(nn.Module):
    """`extra` (8x4 + 4) runs only on even ranks: a rank-dependent skip, no leaf to hold it."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.extra = nn.Linear(8, 4)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, use_extra: bool):
        h = torch.tanh(self.inp(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h)).repeat(1, 2)
        return F.mse_loss(self.head(torch.tanh(self.mid(h))), y)


def rank_skip_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    loss = driver(x, y, rank % 2 == 0)
    driver.backward(loss)
    return [loss.item()]


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_dependent_experts_without_leaf_raise_naming_the_block(world):
    for message, seconds in run_ranks(diverging_worker, world, "experts", timeout=120):
        assert "ranks diverged" in message and "moe.experts." in message, message
        assert "zero3.set_z3_leaf_modules(model, [MoE])" in message and "'moe'" in message, message
        assert seconds < 20, seconds


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_skipping_a_resident_module_raises_naming_it(world):
    """`extra` is resident (it gathers nothing): the trace in the next gather's header tells."""
    for message, seconds in run_ranks(diverging_worker, world, "resident_module_skipped", timeout=120):
        assert "ranks diverged" in message and "entered 'extra'" in message, message
        assert seconds < 20, seconds


@pytest.mark.parametrize("world", WORLDS)
def test_06_rank_skipping_a_sharded_module_fails_fast_naming_it(world):
    """Gathers of different sizes: the ranks that received less raise DivergenceError naming
    `extra`; gloo aborts a rank that received more than it expected. Either way, no hang."""
    with pytest.raises(AssertionError) as failure:
        run_ranks(diverging_worker, world, "sharded_module_skipped", True, timeout=120, collective_timeout=30)
    text = str(failure.value)
    assert "did not finish" not in text, text
    assert "DivergenceError" in text and "unit 'extra'" in text, text
