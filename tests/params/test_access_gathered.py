"""Access patterns: GatheredParameters: edits between steps, reads, and misuse.

Cases and machinery: tests/access_cases.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from access_cases import WORLDS, Case, Driver, Small, build_seeded, case, check_cases, initialize, regression_batch
from harness import run_ranks


# ------------------------------------------------ 11. GatheredParameters
def gathered_edits(driver: Driver, step: int) -> None:
    """At step 1: read everything, then rank 0 rewrites two parameters (one resident)."""
    if step != 1:
        return
    model = driver.module
    edited = [model.mid.weight, model.head.bias]
    with driver.gathered(edited, modifier_rank=0):
        if driver.plain or driver.rank == 0:
            with torch.no_grad():
                model.mid.weight.mul_(0.5).add_(0.25)
                model.head.bias.fill_(0.125)


case("gathered_parameters_modify", build=Small, threshold=3, before=gathered_edits)


@pytest.mark.parametrize("world", WORLDS)
def test_11_gathered_parameters_modify(world, tmp_path):
    check_cases(["gathered_parameters_modify"], world, tmp_path)


# ============================================================================ 11. misuse
def gathered_misuse_worker(rank: int, world: int):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.engine_parts.gathered import GatheredParametersError

    c = Case(build=Small, threshold=3)  # head.bias resident, the rest partitioned
    engine = initialize(build_seeded(c, 0), c, "zero3")
    model = engine.module
    params = [model.mid.weight, model.head.bias]
    with zero3.GatheredParameters(params):
        read = [p.detach().clone() for p in params]
    # A change without modifier_rank, on the last rank only, to an element another rank owns.
    with pytest.raises(GatheredParametersError) as error:
        with zero3.GatheredParameters(params):
            if rank == world - 1:
                with torch.no_grad():
                    model.mid.weight[0, 0] += 1.0
                    model.head.bias.fill_(7.0)
    with zero3.GatheredParameters(params):
        after = [p.detach().clone() for p in params]
    resident_after = model.head.bias.detach().clone()  # outside any context: resident values
    loss = engine(*regression_batch(0, rank))
    state = consolidated_state_dict(engine)
    engine.destroy()

    # bf16: the fp32 master must take rank 0's new values too.
    c16 = Case(build=Small, threshold=3, bf16=True)
    engine = initialize(build_seeded(c16, 0), c16, "zero3")
    model = engine.module
    with zero3.GatheredParameters([model.mid.weight, model.head.bias], modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                model.mid.weight.fill_(0.375)
                model.head.bias.fill_(-0.5)
    masters = consolidated_state_dict(engine, use_master=True)
    compute = consolidated_state_dict(engine)
    x, y = regression_batch(0, rank)
    loss16 = engine(x.bfloat16(), y.bfloat16())
    return (str(error.value), read, after, resident_after, loss.item(), state if rank == 0 else None,
            masters if rank == 0 else None, compute if rank == 0 else None, math.isfinite(loss16.item()))


@pytest.mark.parametrize("world", WORLDS)
def test_11_gathered_parameters_read_and_misuse(world):
    torch.manual_seed(0)
    plain = Small()
    initial = [plain.mid.weight.detach(), plain.head.bias.detach()]
    results = run_ranks(gathered_misuse_worker, world)
    for rank, (message, read, after, resident, loss, state, masters, compute, finite) in enumerate(results):
        assert "in-place modification of parameters inside GatheredParameters(modifier_rank=None)" in message, message
        assert "modifier_rank" in message and "mid.weight" in message, message
        for got, ref in zip(read + after, initial + initial):
            assert torch.equal(got, ref)  # full values on every rank; the refused change undone
        assert torch.equal(resident, initial[1])
        assert math.isclose(loss, plain(*regression_batch(0, rank)).item(), rel_tol=1e-6)
        assert finite
    state, masters, compute = results[0][5], results[0][6], results[0][7]
    for key, value in plain.state_dict().items():
        assert torch.equal(state[key], value), key
    assert torch.equal(masters["mid.weight"], torch.full((8, 8), 0.375))
    assert torch.equal(masters["head.bias"], torch.full((3,), -0.5))
    assert torch.equal(compute["mid.weight"], torch.full((8, 8), 0.375, dtype=torch.bfloat16))
