"""Access patterns: train / eval and generation under no_grad, parameters in outputs and output types, retain_graph and skipped forwards, zero-size parameters, modules attached after initialize.

Cases and machinery: tests/access_cases.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from access_cases import (
    WORLDS,
    Case,
    Driver,
    Small,
    TinyLM,
    build_seeded,
    case,
    check_cases,
    initialize,
    regression_batch,
    token_batch,
)
from harness import run_ranks
from torch import nn


# ------------------------------------------------ 7. train / eval, generation under no_grad
def eval_and_generate_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    tokens, targets = token_batch(step, rank)
    loss = driver(tokens, targets)
    driver.backward(loss)
    values = [loss.item()]
    driver.train(False)
    with torch.no_grad():
        eval_tokens, eval_targets = token_batch(step + 1000, rank)
        values.append(driver(eval_tokens, eval_targets).item())
        generated = eval_tokens[:1, :2]
        for _ in range(1 + step % 3):  # variable length, the same on every rank
            logits = driver(generated)
            generated = torch.cat([generated, logits[:, -1:].argmax(-1)], dim=1)
        values.extend(float(t) for t in generated.flatten())
        values.append(float(generated.shape[1]))
    driver.train(True)
    return values


case("eval_and_generation", build=TinyLM, step=eval_and_generate_step, threshold=0)
case("eval_and_generation_resident", build=TinyLM, step=eval_and_generate_step, threshold=16)


# ------------------------------------------------ 8. parameters in outputs; output types
@dataclasses.dataclass
class ValueAndBias:
    value: torch.Tensor
    bias: torch.Tensor


class SkipBiasAdd(nn.Module):
    """Returns (x @ W^T, its own bias), as Megatron's skip_bias_add layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.bias = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x):
        return F.linear(x, self.weight), self.bias


class DictOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return {"h": self.lin(x), "scale": self.scale}


class DataclassOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        self.bias = nn.Parameter(torch.randn(8) / 3)

    def forward(self, x):
        return ValueAndBias(value=self.lin(x), bias=self.bias)


class OutputsModel(nn.Module):
    """Uses returned parameters in ops that save them (mul), and returns one to the caller."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.skip = SkipBiasAdd()
        self.dict_out = DictOut()
        self.data_out = DataclassOut()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        value, bias = self.skip(h)
        h = torch.tanh(value + bias) * bias
        out = self.dict_out(h)
        h = out["h"] * out["scale"]
        both = self.data_out(h)
        h = torch.tanh(both.value) * both.bias
        return {"loss": F.mse_loss(self.head(h), y), "penalty_param": self.data_out.bias}


def outputs_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    x, y = regression_batch(step, rank)
    out = driver(x, y)
    loss = out["loss"] + 0.01 * out["penalty_param"].square().sum()  # computed outside the model
    driver.backward(loss)
    return [loss.item()]


case("params_in_outputs", build=OutputsModel, step=outputs_step, threshold=0)


# ------------------------------------------------ 9. retain_graph, forward without backward
def retain_and_skip_step(driver: Driver, step: int, rank: int, world: int) -> list[float]:
    values = []
    if step % 2 == 1:
        x, y = regression_batch(step + 500, rank)
        values.append(driver(x, y).item())  # a micro-step skipped: never backpropagated
    x, y = regression_batch(step, rank)
    loss = driver(x, y)
    driver.backward(loss, retain_graph=True)
    driver.backward(loss)  # the same graph again: gradients add up
    values.append(loss.item())
    return values


case("retain_graph_and_skipped_forward", build=Small, step=retain_and_skip_step, threshold=0)


# ------------------------------------------------ 10. zero-size parameter
class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.empty = nn.Linear(8, 0)
        self.head = nn.Linear(8, 3)

    def forward(self, x, y):
        h = torch.tanh(self.inp(x))
        h = torch.cat([h, self.empty(h)], dim=-1)
        return F.mse_loss(self.head(h), y)


case("zero_size_parameter", build=WithEmpty, threshold=0)


@pytest.mark.parametrize("world", WORLDS)
def test_07_eval_and_generation_between_steps(world, tmp_path):
    check_cases(["eval_and_generation", "eval_and_generation_resident"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_08_parameters_in_outputs(world, tmp_path):
    check_cases(["params_in_outputs"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_09_retain_graph_and_skipped_forward(world, tmp_path):
    check_cases(["retain_graph_and_skipped_forward"], world, tmp_path)


@pytest.mark.parametrize("world", WORLDS)
def test_10_zero_size_parameter(world, tmp_path):
    check_cases(["zero_size_parameter"], world, tmp_path)


# ============================================================================ 10. attach after init
def attach_after_initialize_worker(rank: int, world: int):
    import warnings

    from zero3.params.late_params import LateParameterWarning

    c = Case(build=Small, threshold=0)
    engine = initialize(build_seeded(c, 0), c, "zero3")
    x, y = regression_batch(0, rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.module.extra = nn.Linear(8, 4)  # never called by the forward
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.module.act = nn.Tanh()  # no parameters: nothing to report
        engine.module.head.bias = nn.Parameter(torch.zeros(3))  # a parameter replaced after initialize
        second = engine(x, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, LateParameterWarning)]
    return messages, loss.item(), second.item(), engine.late_gathers


@pytest.mark.parametrize("world", WORLDS)
def test_10_module_attached_after_initialize_is_used_whole_and_named(world):
    """Decision: a parameter added after initialize is used as in plain PyTorch with an
    optimizer built before it (whole on every rank, not stepped), and rank 0 names it once
    with how to have it trained (tests/params/test_late_modules.py checks parity and checkpoints).
    Modules without parameters are attached silently."""
    results = run_ranks(attach_after_initialize_worker, world)
    torch.manual_seed(0)
    plain = Small()
    for rank, (messages, loss, second, late) in enumerate(results):
        if rank == 0:
            assert len(messages) == 2, messages
            assert "extra.weight (4, 8), extra.bias (4,)" in messages[0], messages[0]
            assert "before zero3.initialize" in messages[0], messages[0]
            assert "head.bias (3,)" in messages[1] and "extra" not in messages[1], messages[1]
        else:
            assert messages == []
        assert math.isclose(loss, plain(*regression_batch(0, rank)).item(), rel_tol=1e-6)
        assert math.isfinite(second) and late == 0
