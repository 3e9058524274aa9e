"""Access patterns: reads of a parameter outside its module (before it runs), another module's weight and tied weights, one module called several times.

Cases and machinery: tests/access_cases.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from access_cases import STEPS, WORLDS, Driver, case, check_cases, token_batch
from torch import nn
from torch.utils.checkpoint import checkpoint


# ------------------------------------------------ 1. reads outside the module, before it runs
class Probes(nn.Module):
    """dtype / shape / device probes of a child's parameters before the child is called.

    `child.weight` (64 elements) is partitioned at threshold 20, `small.*` stay resident;
    `late.weight` is probed only from the first step after the resume.
    """

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.child = nn.Linear(8, 8)
        self.small = nn.Linear(8, 2)
        self.late = nn.Linear(2, 3)
        self.probe_late = False

    def forward(self, x, y):
        h = self.inp(x)
        h = h.to(self.child.weight.dtype)
        assert self.child.weight.shape == (8, 8) and self.child.weight.numel() == 64
        h = h.to(self.small.weight.device).to(self.small.bias.dtype)
        if self.probe_late:
            assert self.late.weight.shape == (3, 2)
            h = h.to(self.late.weight.dtype)
        h = self.small(torch.tanh(self.child(h)))
        return F.mse_loss(self.late(h), y)


def probe_after_resume(driver: Driver, step: int) -> None:
    driver.module.probe_late = step >= STEPS


case("probes_partitioned", build=Probes, threshold=0, before=probe_after_resume)
case("probes_resident_and_partitioned", build=Probes, threshold=20, before=probe_after_resume)


# ------------------------------------------------ 2. another module's weight, tied weights
class UsesOther(nn.Module):
    """A unit (it has a parameter of its own) that computes with another module's weight."""

    def __init__(self, other: nn.Linear) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self._other = [other]  # a reference outside the module tree

    def forward(self, h):
        return h * self.scale + F.linear(h, self._other[0].weight)


class TiedLM(nn.Module):
    """Embedding tied to the lm head; `other` is never called, only its weight is used."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.proj = nn.Linear(width, width)
        self.other = nn.Linear(width, width)
        self.mix = UsesOther(self.other)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, tokens, targets):
        h = torch.tanh(self.proj(self.embed(tokens)))
        h = h + F.linear(h, self.other.weight, self.other.bias)
        h = self.mix(h)
        logits = self.lm_head(h)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    tokens, targets = token_batch(step, rank)
    loss = driver(tokens, targets)
    driver.backward(loss)
    return [loss.item()]


case("other_weight_and_tied", build=TiedLM, step=token_step, threshold=0)
# Clipping well below the gradient norm, so the tied gradient's share of it decides the step.
case("tied_with_clipping", build=TiedLM, step=token_step, threshold=10, clip=0.05)


# ------------------------------------------------ 3. one module called several times
class Repeated(nn.Module):
    """A shared layer in a loop, applied to two inputs at once, and repeated inside checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.layer = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def twice(self, h):
        return self.layer(torch.tanh(self.layer(h)))

    def forward(self, x, y):
        h = self.inp(x)
        for _ in range(3):
            h = h + torch.tanh(self.layer(h))
        h = torch.tanh(self.layer(h)) * torch.tanh(self.layer(2 * h))  # two uses, one backward each
        h = checkpoint(self.twice, h, use_reentrant=True)
        h = checkpoint(self.twice, h, use_reentrant=False)
        return F.mse_loss(self.head(h), y)


case("shared_layer", build=Repeated, threshold=0)
case("shared_layer_resident_bias", build=Repeated, threshold=8)


@pytest.mark.parametrize("world", WORLDS)
def test_01_reads_before_the_module_runs(world, tmp_path):
    check_cases(["probes_partitioned", "probes_resident_and_partitioned"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_02_other_modules_weight_and_tied_weights(world, tmp_path):
    check_cases(["other_weight_and_tied", "tied_with_clipping"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_03_module_called_several_times(world, tmp_path):
    check_cases(["shared_layer", "shared_layer_resident_bias"], world, tmp_path)
