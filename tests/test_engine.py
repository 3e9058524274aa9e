"""Core engine: parity with plain PyTorch, sharded memory, collective counters, resume."""

from __future__ import annotations

import math

import pytest
import torch

from common import batch_index, config, make_batches, make_model, reference_training, two_param_groups
from harness import run_ranks

STEPS, MICRO = 3, 2


def train_with_zero3(rank: int, world: int, ga: int, threshold: int):
    import zero3
    from zero3.export import consolidated_state_dict

    model = make_model()
    optimizer = torch.optim.AdamW(two_param_groups(model))
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, config=config(MICRO, ga, threshold))
    batches = make_batches(STEPS * ga * world, MICRO)
    losses = {}
    for step in range(STEPS):
        for micro in range(ga):
            x, y = batches[batch_index(step, micro, rank, ga, world)]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[(step, micro, rank)] = loss.item()
    assert engine.global_steps == STEPS and engine.micro_steps == STEPS * ga
    state = consolidated_state_dict(engine)
    return losses, state, engine.late_gathers


@pytest.mark.parametrize("world,ga,threshold", [(1, 1, 30), (2, 1, 30), (2, 4, 0), (4, 4, 30), (4, 1, 100000)])
def test_parity_with_plain_pytorch(world, ga, threshold):
    ref_losses, ref_state = reference_training(STEPS, ga, world, MICRO)
    results = run_ranks(train_with_zero3, world, ga, threshold)
    for losses, _, late in results:
        assert late == 0
        for key, value in losses.items():
            assert math.isclose(value, ref_losses[key], rel_tol=1e-5, abs_tol=1e-7), (key, value, ref_losses[key])
    state = results[0][1]
    assert set(state) == set(ref_state)
    for name, ref in ref_state.items():
        torch.testing.assert_close(state[name], ref, rtol=1e-5, atol=1e-6, msg=name)
