"""Prefetch, reuse and the live-parameter bound: their effect, exact results, collective counts.

`stage3_prefetch_bucket_size`, `stage3_max_reuse_distance` and `stage3_max_live_parameters`
act from the second step on (the first step records the order, schedule.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from common import Chain, batch_index, config, make_batches, make_model, two_param_groups
from harness import run_ranks

OFF = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}
PREFETCH_ONLY = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0}
DEFAULTS: dict = {}


def train_net(rank: int, world: int, zero: dict, steps: int = 4, ga: int = 2):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(2, ga, threshold=30, **zero))
    batches = make_batches(steps * ga * world, 2)
    losses = []
    for step in range(steps):
        for micro in range(ga):
            x, y = batches[batch_index(step, micro, rank, ga, world)]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    fetcher = engine.fetcher
    return losses, consolidated_state_dict(engine), fetcher.prefetched_units, fetcher.reused_units


@pytest.mark.parametrize("world", [2, 4])
def test_prefetch_and_reuse_change_nothing_but_when_gathers_happen(world):
    off = run_ranks(train_net, world, OFF)
    for zero in (PREFETCH_ONLY, DEFAULTS, {"stage3_prefetch_bucket_size": 300}):
        on = run_ranks(train_net, world, zero)
        for (ref_losses, ref_state, _, _), (losses, state, prefetched, reused) in zip(off, on):
            assert losses == ref_losses, zero
            for name, value in ref_state.items():
                assert torch.equal(state[name], value), (zero, name)
            assert prefetched > 0, zero
            if zero.get("stage3_max_reuse_distance", 1) != 0:
                assert reused > 0, zero
            else:
                assert reused == 0, zero
    for _, _, prefetched, reused in off:
        assert prefetched == 0 and reused == 0


def chain_steps(rank: int, world: int, zero: dict, steps: int = 4):
    """Per step: (forward all-gathers, backward all-gathers, reduce-scatters, all-gather bytes),
    the units prefetched and reused in it, the gathers mispredicted so far, and the most
    elements gathered at once as seen from each layer's forward."""
    import zero3

    torch.manual_seed(0)
    model = Chain()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=config(2, 1, threshold=0, **zero))
    live: list[int] = []
    for layer in (model.l1, model.l2, model.l3):
        layer.register_forward_pre_hook(lambda *_: live.append(engine.fetcher.live_numel))
    fetcher = engine.fetcher
    rows = []
    for _ in range(steps):
        live.clear()
        units_before = (fetcher.prefetched_units, fetcher.reused_units)
        s0 = engine.comm_stats()
        loss = engine(torch.randn(2, 13))
        s1 = engine.comm_stats()
        engine.backward(loss)
        s2 = engine.comm_stats()
        engine.step()

        def calls(a, b, op):
            return b.get(op, (0, 0))[0] - a.get(op, (0, 0))[0]

        rows.append({
            "forward": calls(s0, s1, "all_gather"),
            "backward": calls(s1, s2, "all_gather"),
            "reduce_scatter": calls(s1, s2, "reduce_scatter"),
            "gather_bytes": s2.get("all_gather", (0, 0))[1] - s0.get("all_gather", (0, 0))[1],
            "prefetched": fetcher.prefetched_units - units_before[0],
            "reused": fetcher.reused_units - units_before[1],
            "mispredicted": fetcher.guard.mispredicted,
            "max_live": max(live),
        })
    return rows


def shard_bytes(world: int) -> list[int]:
    from zero3.params.divergence import HEADER_BYTES

    return [math.ceil(n / world) * 4 + HEADER_BYTES for n in (221, 187, 33)]


@pytest.mark.parametrize("world", [2, 4])
def test_prefetch_keeps_one_gather_per_unit_and_pass(world):
    per_unit = shard_bytes(world)
    for rows in run_ranks(chain_steps, world, PREFETCH_ONLY):
        first, second, *steady = rows
        assert first["prefetched"] == 0  # no order known yet
        assert (first["forward"], first["backward"]) == (3, 3)
        for row in steady:
            # every unit is gathered once per pass, some of them ahead of use
            assert row["forward"] + row["backward"] == 6, row
            assert row["gather_bytes"] == 2 * sum(per_unit), row
            assert row["reduce_scatter"] == 1, row
            assert row["prefetched"] >= 3, row
        # the new order of gathers is learnt once; steady steps predict every gather
        assert steady[0]["mispredicted"] == steady[-1]["mispredicted"] == second["mispredicted"]


@pytest.mark.parametrize("world", [2])
def test_reuse_distance_keeps_units_reused_within_it(world):
    # After l3's forward its backward comes next (distance 0): kept. After l2's, l3's
    # forward and backward come first: 66 elements, kept for a distance of 200. After
    # l1's, 187 + 33 > 200 elements come first: released, gathered again in backward.
    zero = {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 200}
    for rows in run_ranks(chain_steps, world, zero):
        assert (rows[0]["forward"], rows[0]["backward"]) == (3, 3)
        # step 2 learns the new order of gathers (one more collective for a mispredicted one)
        for row in rows[2:]:
            assert (row["forward"], row["backward"], row["reused"]) == (3, 1, 2), row
    for rows in run_ranks(chain_steps, world, DEFAULTS):  # DeepSpeed's 1e9: all kept
        for row in rows[1:]:
            assert row["backward"] == 0, row


@pytest.mark.parametrize("world", [2])
def test_max_live_parameters_bounds_what_is_gathered_ahead(world):
    unbounded = run_ranks(chain_steps, world, OFF)[0]
    assert max(row["max_live"] for row in unbounded) == 221  # one layer at a time
    tight = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 20}
    for rows in run_ranks(chain_steps, world, tight):
        assert all(row["prefetched"] == 0 for row in rows), rows  # not even the 33-element layer fits
    bounded = {"stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 250}
    for rows in run_ranks(chain_steps, world, bounded):
        assert sum(row["prefetched"] for row in rows) > 0, rows
        assert all(row["max_live"] <= 250 for row in rows), rows


class Reorders(torch.nn.Module):
    """Runs its blocks in reverse order on odd calls: the plan is wrong every other step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.calls = 0

    def forward(self, x):
        order = self.blocks if self.calls % 2 == 0 else list(reversed(self.blocks))
        self.calls += 1
        for block in order:
            x = torch.tanh(block(x))
        return x.square().mean()


def train_reorders(rank: int, world: int, zero: dict):
    import zero3

    model = Reorders()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=config(2, 1, threshold=0, **zero))
    g = torch.Generator().manual_seed(rank)
    losses = [0.0] * 6
    for step in range(6):
        loss = engine(torch.randn(2, 8, generator=g))
        engine.backward(loss)
        engine.step()
        losses[step] = loss.item()
    return losses, engine.fetcher.prefetched_units


def test_an_order_that_changes_every_step_only_stops_the_look_ahead():
    reference = run_ranks(train_reorders, 2, OFF)
    for losses_prefetch, (losses, _) in zip(run_ranks(train_reorders, 2, DEFAULTS), reference):
        assert losses_prefetch[0] == losses
