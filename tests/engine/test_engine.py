"""Core engine: parity with plain PyTorch, sharded memory, collective counters, resume."""

from __future__ import annotations

import math

import pytest
import torch
from common import Chain, batch_index, config, make_batches, make_model, reference_training, two_param_groups
from harness import run_ranks

STEPS, MICRO = 3, 2


def train_with_zero3(rank: int, world: int, ga: int, threshold: int):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

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


def count_collectives(rank: int, world: int):
    import zero3

    torch.manual_seed(0)
    model = Chain()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=config(2, 1, threshold=0))
    x = torch.randn(2, 13)
    before = engine.comm_stats()
    loss = engine(x)
    after_forward = engine.comm_stats()
    engine.backward(loss)
    after_backward = engine.comm_stats()
    engine.step()
    after_step = engine.comm_stats()
    return before, after_forward, after_backward, after_step


def delta(a, b, op):
    return tuple(y - x for x, y in zip(a.get(op, (0, 0)), b.get(op, (0, 0))))


@pytest.mark.parametrize("world", [2, 4])
def test_collective_counts_match_arithmetic(world):
    from zero3.params.divergence import HEADER_BYTES

    shards = [math.ceil(n / world) for n in (13 * 17, 17 * 11, 11 * 3)]
    # each coalesced all-gather carries the divergence guard's header in front of the shard
    gathered_bytes = sum(shards) * 4 + 3 * HEADER_BYTES
    for before, fwd, bwd, step in run_ranks(count_collectives, world):
        # forward: one all-gather per unit; nothing else
        assert delta(before, fwd, "all_gather") == (3, gathered_bytes)
        assert delta(before, fwd, "reduce_scatter") == (0, 0)
        # backward: one all-gather per unit again, one reduce-scatter for the single bucket
        assert delta(fwd, bwd, "all_gather") == (3, gathered_bytes)
        assert delta(fwd, bwd, "reduce_scatter") == (1, world * sum(shards) * 4)
        # step: one all-reduce of the squared gradient norm (float64), no gathers (nothing resident);
        # no leaf unit here, so no usage counts ride on it (test_unused_params.py counts those)
        assert delta(bwd, step, "all_gather") == (0, 0)
        assert delta(bwd, step, "all_reduce") == (1, 8)


def held_memory(rank: int, world: int):
    import zero3

    model = make_model()
    full = {n: p.numel() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(MICRO, 2, threshold=30))
    persistent = {sp.name for sp in engine.table.values() if sp.persistent}
    released = all(sp.param.untyped_storage().nbytes() == 0
                   for sp in engine.table.values() if not sp.persistent)
    states = {sp.name: sp.state for sp in engine.table.values()}
    at_init = engine.sharded_bytes()
    x, y = make_batches(1, MICRO)[0]
    engine.backward(engine(x, y))
    engine.step()
    mid_window = engine.sharded_bytes()
    engine.backward(engine(x, y))
    engine.step()
    after_step = engine.sharded_bytes()
    return full, trainable, persistent, released, states, at_init, mid_window, after_step


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_holds_only_its_shards(world):
    from zero3.params.partition import ParamState

    for full, trainable, persistent, released, states, at_init, mid, after in run_ranks(held_memory, world):
        shard = {n: math.ceil(k / world) * 4 for n, k in full.items()}
        assert persistent == {n for n, k in full.items() if k <= 30}
        assert released
        assert all(states[n] is (ParamState.FULL if n in persistent else ParamState.SHARDED) for n in full)
        assert at_init["param_shards"] == sum(shard.values())
        assert at_init["param_shards"] <= sum(full.values()) * 4 / world + 4 * len(full)
        assert at_init["resident_params"] == sum(full[n] * 4 for n in persistent)
        assert at_init["grad_shards"] == 0 and at_init["optimizer_state"] == 0
        assert at_init["masters"] == 0  # fp32: the master is the shard itself
        # inside an accumulation window: fp32 gradient shards of the trainable parameters only
        assert mid["grad_shards"] == sum(shard[n] for n in trainable)
        # after the optimizer step: gradients gone; AdamW's two moments per trainable shard
        # plus one 4-byte `step` scalar per parameter
        assert after["grad_shards"] == 0
        assert after["optimizer_state"] == 2 * sum(shard[n] for n in trainable) + 4 * len(trainable)


def resume_run(rank: int, world: int, folder: str, steps: int):
    import zero3

    ga = 4

    def build(seed: int):
        model = make_model(seed=seed, dropout=0.2)
        optimizer = torch.optim.AdamW(two_param_groups(model))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        cfg = {**config(MICRO, ga, threshold=30), "checkpoint": {"load_rng_state": True}}  # dropout: RNG too
        engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        return engine

    def train(engine, first_step: int, count: int, losses: list):
        batches = make_batches((first_step + count) * ga * world, MICRO)
        for step in range(first_step, first_step + count):
            for micro in range(ga):
                x, y = batches[batch_index(step, micro, rank, ga, world)]
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())

    from zero3.checkpoint.export import consolidated_state_dict

    torch.manual_seed(123)
    straight = build(seed=0)
    straight_losses: list = []
    train(straight, 0, 2 * steps, straight_losses)
    straight_state = consolidated_state_dict(straight)
    straight_lr = straight.get_lr()
    straight.destroy()

    torch.manual_seed(123)
    first = build(seed=0)
    resumed_losses: list = []
    train(first, 0, steps, resumed_losses)
    first.save_checkpoint(folder, client_state={"note": "half way", "step": steps})
    first.destroy()
    second = build(seed=7)  # different initial weights: everything must come from the file
    path, client = second.load_checkpoint(folder)
    assert client == {"note": "half way", "step": steps}
    assert second.global_steps == steps and second.micro_steps == steps * ga
    train(second, steps, steps, resumed_losses)
    return straight_losses, resumed_losses, straight_state, consolidated_state_dict(second), straight_lr, second.get_lr()


@pytest.mark.parametrize("world", [1, 2])
def test_resume_is_bit_exact(tmp_path, world):
    for straight, resumed, state_a, state_b, lr_a, lr_b in run_ranks(resume_run, world, str(tmp_path), 3):
        assert straight == resumed  # bit-identical losses, every micro-step
        assert lr_a == lr_b
        for name in state_a:
            assert torch.equal(state_a[name], state_b[name]), name


def aliasing_at_world_one(rank: int, world: int, offload: bool):
    import zero3

    model = make_model()
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_param"] = {"device": "cpu"}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero})
    x, y = make_batches(1, MICRO)[0]
    before = {sp.name: sp.shard.clone() for sp in engine.table.values()}  # aliased: the parameter itself
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    sps = list(engine.table.values())
    return {
        "aliased": [sp.aliased for sp in sps],
        "same_storage": [sp.aliased and sp.shard.data_ptr() == sp.param.data_ptr() for sp in sps],
        "all_resident": engine.fetcher.all_resident,
        "hooks": len(engine.fetcher._handles),
        "units": len(engine.units),
        "changed": all(not torch.equal(before[sp.name], sp.shard) for sp in sps if sp.requires_grad),
    }


def test_world_one_parameters_are_their_shards():
    """World size 1, shards on the compute device: each parameter's storage is its shard,
    only the root unit's hooks are installed, and the optimizer's write-back updates the
    parameters directly. With offload_param the fetch path stays (shards on the host)."""
    [plain] = run_ranks(aliasing_at_world_one, 1, False)
    assert all(plain["aliased"]) and all(plain["same_storage"]), plain
    assert plain["all_resident"] and plain["hooks"] == 2 and plain["units"] > 1, plain
    assert plain["changed"], "the optimizer step did not reach the parameters"
    [offloaded] = run_ranks(aliasing_at_world_one, 1, True)
    assert not any(offloaded["aliased"]) and not offloaded["all_resident"], offloaded
    assert offloaded["hooks"] == 2 * offloaded["units"] and offloaded["changed"], offloaded


def destroyed(rank: int, world: int):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = zero3.initialize(model=model, optimizer=client, config={
        "train_micro_batch_size_per_gpu": MICRO,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    x, y = make_batches(world, MICRO)[rank]
    for _ in range(2):
        engine.backward(engine(x, y))
        engine.step()
    trained = consolidated_state_dict(engine)  # rank 0's; empty on the others
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine.destroy()
    plain = {name: p.detach().clone() for name, p in model.named_parameters()}
    return {
        "same": all(torch.equal(trained[name], plain[name]) for name in plain) if trained else rank != 0,
        "shapes": all(p.shape == shapes[name] and p.numel() == math.prod(shapes[name]) for name, p in plain.items()),
        "loss": float(model(x, y)),  # a plain forward of the whole module
        "state": len(client.state), "group_params": [len(g["params"]) for g in client.param_groups],
    }


def test_destroy_lets_go_of_the_optimizer_side_and_leaves_the_trained_module_whole():
    """destroy() drops the masters and the client optimizer's state before it gathers the
    parameters back (the gathers may use the memory the state held), and the module it
    leaves holds the trained values, whole, on every rank."""
    for r in run_ranks(destroyed, 2):
        assert r["same"] and r["shapes"] and math.isfinite(r["loss"]), r
        assert r["state"] == 0 and r["group_params"] == [0], r


def lr_through_param_groups(rank: int, world: int):
    """engine.optimizer.param_groups as DeepSpeed's: reading lr, and writing it before a step."""
    import zero3

    model = make_model()
    engine, *_ = zero3.initialize(model=model, config={**config(1, 1), "optimizer": {"type": "AdamW",
                                                                                       "params": {"lr": 1e-2}}})
    batches = make_batches(2, 1)
    seen = [group["lr"] for group in engine.optimizer.param_groups]
    from zero3.checkpoint.export import consolidated_state_dict

    before = consolidated_state_dict(engine)
    x, y = batches[0]
    engine.backward(engine(x, y))
    for group in engine.optimizer.param_groups:
        group["lr"] = 0.0
    engine.step()
    after = consolidated_state_dict(engine)
    frozen = all(torch.equal(after[n], before[n]) for n in before)
    for group in engine.optimizer.param_groups:
        group["lr"] = 1e-2
    x, y = batches[1]
    engine.backward(engine(x, y))
    engine.step()
    last = consolidated_state_dict(engine)
    moved = any(not torch.equal(last[n], before[n]) for n in before)
    return seen, frozen, moved, engine.get_lr(), len(before)


def test_optimizer_param_groups_read_and_set_lr():
    results = run_ranks(lr_through_param_groups, 2)
    seen, frozen, moved, lr, count = results[0]  # rank 0 holds the consolidated weights
    assert count > 0 and frozen and moved, "lr 0 set in param_groups kept the weights; lr 1e-2 moved them"
    assert all(r[0] == [1e-2] and r[3] == [1e-2] for r in results)
