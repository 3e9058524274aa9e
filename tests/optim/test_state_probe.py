"""The optimizer state a first step creates, foreseen before it (optim/state_probe.py).

In one process, no ranks: for several torch optimizers and param groups, the foreseen
state of masters that have not stepped has the keys, shapes and dtypes the real first step
then creates; a master that already has state keeps its own tensors; an optimizer that
cannot be stepped on a probe foresees nothing (the first save allocates instead).
"""

from __future__ import annotations

import pytest
import torch

from zero3.optim.state_probe import foreseen_state

OPTIMIZERS = {
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, fused=True),
    "adam-amsgrad": lambda groups: torch.optim.Adam(groups, amsgrad=True),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "sgd-plain": lambda groups: torch.optim.SGD(groups, lr=0.1),
    "adagrad": lambda groups: torch.optim.Adagrad(groups),
    "rmsprop-centered": lambda groups: torch.optim.RMSprop(groups, centered=True, momentum=0.5),
}


def _masters() -> list[dict]:
    """Two param groups of flat masters of several sizes (one empty, as a rank's shard may be)."""
    make = [torch.randn(n, requires_grad=True) for n in (7, 1, 0, 33)]
    return [{"params": make[:2]}, {"params": make[2:], "weight_decay": 0.01}]


def _layout(state: dict, params: list[torch.Tensor]) -> list[dict]:
    return [{key: (tuple(value.shape), value.dtype) for key, value in state.get(p, {}).items()
             if isinstance(value, torch.Tensor)} for p in params]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_foreseen_state_is_the_first_steps(name):
    optimizer = OPTIMIZERS[name](_masters())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    before = {p: dict(values) for p, values in optimizer.state.items()}  # Adagrad's is made at construction
    foreseen = foreseen_state(optimizer)
    assert {p: dict(values) for p, values in optimizer.state.items()} == before, "the optimizer's state changed"
    assert all(value.device.type == "meta" for p, values in foreseen.items() if p not in before
               for value in values.values())
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    assert _layout(foreseen, params) == _layout(optimizer.state, params)


def test_a_master_with_state_keeps_its_own_tensors():
    optimizer = torch.optim.AdamW(_masters())
    params = [p for group in optimizer.param_groups for p in group["params"]]
    params[0].grad = torch.randn_like(params[0])
    optimizer.step()
    foreseen = foreseen_state(optimizer)
    assert foreseen[params[0]]["exp_avg"] is optimizer.state[params[0]]["exp_avg"]
    assert foreseen[params[3]]["exp_avg"].device.type == "meta"


class Unsteppable(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("this optimizer needs a closure")


def test_an_optimizer_that_cannot_step_on_a_probe_foresees_nothing():
    optimizer = Unsteppable(_masters(), lr=0.1)
    assert all(values == {} for values in foreseen_state(optimizer).values())
