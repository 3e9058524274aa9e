"""Access patterns: activation checkpointing over a frozen base with trainable adapters (the seed's shape), and the resume flows.

Cases and machinery: tests/access_cases.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from access_cases import (
    CASES,
    STEPS,
    WORLDS,
    Case,
    Driver,
    assert_values_match,
    build_seeded,
    case,
    check_cases,
    engine_step,
    full_state,
    initialize,
    reference,
)
from harness import run_ranks
from torch import nn
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------ 4. checkpointing, frozen base + adapters
class AdapterBlock(nn.Module):
    """A frozen 8x8 base with a trainable 8-2-8 adapter (16 + 2 + 16 elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(8, 8, bias=False)
        self.base.weight.requires_grad_(False)
        self.adapter_A = nn.Linear(8, 2)
        self.adapter_B = nn.Linear(2, 8, bias=False)

    def forward(self, value):
        base = self.base(value)
        value = value.to(self.adapter_A.weight.dtype)
        return base + self.adapter_B(self.adapter_A(value))


class Adapters(nn.Module):
    """Adapter blocks under reentrant and non-reentrant checkpointing, and unchecked.

    The root owns a parameter used before the checkpointed blocks: its backward comes
    after the reentrant checkpoint's inner backward has ended.
    """

    def __init__(self) -> None:
        super().__init__()
        self.root_scale = nn.Parameter(torch.ones(8))
        self.inp = nn.Linear(6, 8)
        self.reentrant = AdapterBlock()
        self.non_reentrant = AdapterBlock()
        self.plain = AdapterBlock()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = self.inp(x) * self.root_scale
        h = checkpoint(self.reentrant, h, use_reentrant=True)
        h = checkpoint(self.non_reentrant, torch.tanh(h), use_reentrant=False)
        h = self.plain(torch.tanh(h))
        return F.mse_loss(self.head(h), y)


case("adapters_threshold_0", build=Adapters, threshold=0)
case("adapters_threshold_between", build=Adapters, threshold=8)  # biases resident, adapters not
case("adapters_threshold_above", build=Adapters, threshold=20)  # adapters resident, bases not


class SeedAdapterModel(nn.Module):
    """The seed: a checkpointed adapter block as the whole model; ones as input."""

    def __init__(self) -> None:
        super().__init__()
        self.adapter = AdapterBlock()

    def forward(self, value):
        return checkpoint(self.adapter, value, use_reentrant=True).square().mean()


def seed_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    value = torch.ones(2, 8, requires_grad=True) * (1 + 0.1 * rank)
    loss = driver(value)
    driver.backward(loss)
    return [loss.item()]


case("seed_adapter_threshold_16", build=SeedAdapterModel, step=seed_step, threshold=16)


@pytest.mark.parametrize("world", WORLDS)
def test_04_checkpointing_frozen_base_and_adapters(world, tmp_path):
    check_cases(["adapters_threshold_0", "adapters_threshold_between", "adapters_threshold_above",
                 "seed_adapter_threshold_16"], world, tmp_path)


# ============================================================================ 12. resume flows
RESUME_CASE = "adapters_threshold_between"  # resident and partitioned, both checkpoint kinds


def train_steps(engine, c: Case, steps, rank: int, world: int, framework: str = "zero3") -> list[list[float]]:
    return [engine_step(engine, c, step, rank, world, framework) for step in steps]


def resume_flows_worker(rank: int, world: int, folder: str, framework: str = "zero3"):
    c = CASES[RESUME_CASE]
    out: dict[str, Any] = {}
    full = lambda engine: full_state(engine, framework)  # noqa: E731

    # (a) saved before the first optimizer step
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    engine.save_checkpoint(folder, tag="before_first_step")
    engine.destroy()
    engine = initialize(build_seeded(c, 1, framework), c, framework)
    engine.load_checkpoint(folder, tag="before_first_step")
    out["before_first_step"] = train_steps(engine, c, range(2 * STEPS), rank, world, framework)
    engine.destroy()

    # (b) saved right after a load, nothing in between
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    first = train_steps(engine, c, range(STEPS), rank, world, framework)
    engine.save_checkpoint(folder, tag="a")
    engine.destroy()
    engine = initialize(build_seeded(c, 1, framework), c, framework)
    engine.load_checkpoint(folder, tag="a")
    loaded_a = full(engine)
    engine.save_checkpoint(folder, tag="b")
    engine.destroy()
    engine = initialize(build_seeded(c, 2, framework), c, framework)
    engine.load_checkpoint(folder, tag="b")
    same = full(engine)
    out["saved_after_load"] = first + train_steps(engine, c, range(STEPS, 2 * STEPS), rank, world, framework)
    engine.destroy()

    # (c) loaded into engines that already trained in this process: itself, and another
    engine = initialize(build_seeded(c, 0, framework), c, framework)
    first = train_steps(engine, c, range(STEPS), rank, world, framework)
    engine.save_checkpoint(folder, tag="c")
    train_steps(engine, c, range(100, 102), rank, world, framework)  # moves on, then goes back
    engine.load_checkpoint(folder, tag="c")
    out["reloaded_itself"] = first + train_steps(engine, c, range(STEPS, 2 * STEPS), rank, world, framework)
    other = initialize(build_seeded(c, 3, framework), c, framework)
    train_steps(other, c, range(200, 202), rank, world, framework)
    other.load_checkpoint(folder, tag="c")
    out["loaded_into_trained_other"] = first + train_steps(other, c, range(STEPS, 2 * STEPS), rank, world, framework)
    out["late"] = sum(getattr(e, "late_gathers", 0) for e in (engine, other))
    out["same_after_resave"] = (rank != 0) or all(torch.equal(loaded_a[k], same[k]) for k in loaded_a)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_12_resume_flows(world, tmp_path):
    expected = reference(RESUME_CASE, world)["values"]
    results = run_ranks(resume_flows_worker, world, str(tmp_path))
    for flow in ("before_first_step", "saved_after_load", "reloaded_itself", "loaded_into_trained_other"):
        assert_values_match(f"{flow}, {world} ranks", [r[flow] for r in results], expected)
    assert [r["late"] for r in results] == [0] * world
    assert results[0]["same_after_resave"]  # what a re-save right after a load holds is what was loaded
