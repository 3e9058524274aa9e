"""The engine as DeepSpeed's: an nn.Module wrapping the model, its queries and config view."""

from __future__ import annotations

import contextlib

import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks

MICRO = 2


def engine_as_a_module(rank: int, world: int):
    import pytest
    from torch import nn

    import zero3

    model = make_model()
    model.id = 7  # an attribute of the model only
    reference = make_model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    cfg = config(MICRO, 1, threshold=30, stage3_gather_16bit_weights_on_model_save=True)
    engine, optimizer, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                               config=cfg)
    assert isinstance(engine, nn.Module) and engine.module is model
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n in names]
    assert all(a is b for a, b in zip(engine.parameters(), params))
    assert engine.id == 7 and engine.blocks is model.blocks
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        engine.nothing_here
    engine.eval()
    assert not model.training and not engine.training
    engine.train()
    assert model.training
    assert engine.to("cpu") is engine and engine.float() is engine
    with pytest.raises(RuntimeError, match="sharded on cpu in torch.float32"):
        engine.half()
    # config queries and the config view
    assert engine.zero_optimization_stage() == 3 and engine.zero_optimization_partition_weights()
    assert engine.zero_gather_16bit_weights_on_model_save() is True
    assert engine.config["zero_optimization"]["stage"] == 3 and engine.config.get("bf16") is None
    assert engine.get_lr() == [1e-2, 5e-3] and engine.get_mom() == [(0.9, 0.999), (0.9, 0.999)]
    assert engine.train_batch_size() == MICRO * world and engine.gradient_accumulation_steps() == 1
    # state_dict: whole values under module. keys, on every rank
    state = engine.state_dict()
    expected = reference.state_dict()
    assert list(state) == [f"module.{k}" for k in expected]
    for key, value in expected.items():
        assert torch.equal(state[f"module.{key}"], value), key
    consolidated = engine._zero3_consolidated_16bit_state_dict()
    assert (consolidated is None) == (rank != 0)
    if rank == 0:
        assert set(consolidated) == set(expected)
    # load_state_dict writes shards and masters: the engine then computes what the loaded weights give
    torch.manual_seed(5)
    other = make_model(seed=3)
    result = engine.load_state_dict({f"module.{k}": v for k, v in other.state_dict().items()})
    assert not result.missing_keys and not result.unexpected_keys
    x, y = make_batches(1, MICRO)[0]
    with torch.no_grad():
        assert torch.allclose(engine(x, y), other(x, y), rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="missing keys"):
        engine.load_state_dict({"module.head.bias": other.head.bias.detach()})
    engine.empty_partition_cache()  # then training goes on
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    assert engine.was_step_applied() and engine.get_global_grad_norm() > 0
    # DeepSpeed's read-only status, and unwrap_model_for_generation
    from zero3.runtime.zero import unwrap_model_for_generation
    from zero3.runtime.zero.partition_parameters import ZeroParamStatus

    weight, bias = model.head.weight, model.head.bias  # 120 elements: partitioned; 5: resident
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE and bias.ds_status is ZeroParamStatus.AVAILABLE
    assert weight.ds_shape == weight.shape and weight.ds_numel == 120 and isinstance(weight, nn.Parameter)
    with pytest.raises(AttributeError):
        weight.ds_status = ZeroParamStatus.AVAILABLE
    calls = engine.comm_stats()
    with unwrap_model_for_generation(engine) as unwrapped:
        assert unwrapped is engine and weight.ds_status is ZeroParamStatus.AVAILABLE
        gathered = engine.comm_stats()
        with torch.no_grad():
            engine(x, y)
        assert engine.comm_stats() == gathered  # no collective while unwrapped
    assert gathered != calls and weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    engine.destroy()
    assert weight.ds_status is ZeroParamStatus.AVAILABLE  # whole again
    return True


def test_engine_is_a_module_with_deepspeeds_queries():
    assert run_ranks(engine_as_a_module, 2) == [True, True]


def accumulation_loops(rank: int, world: int, ga: int, steps: int):
    """One model trained three ways: DeepSpeed's loop, Accelerate's, and loss.backward()."""
    import zero3

    batches = make_batches(steps * ga * world, MICRO)
    results = {}
    for style in ("deepspeed", "accelerate", "direct"):
        model = make_model()
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                           config=config(MICRO, ga))
        applied = []
        for step in range(steps):
            for micro in range(ga):
                x, y = batches[(step * ga + micro) * world + rank]
                last = micro == ga - 1
                if style == "accelerate":
                    engine.set_gradient_accumulation_boundary(last)
                    assert engine.is_gradient_accumulation_boundary() == last
                loss = engine(x, y)
                if style == "direct":
                    loss.backward()
                else:
                    engine.backward(loss)
                if style != "accelerate" or last:
                    engine.step()
                    applied.append(engine.was_step_applied())
        counters = (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps)
        results[style] = (counters, applied, {k: v.clone() for k, v in engine.state_dict().items()})
        engine.destroy()
    return results


def check_accumulation(world: int, ga: int, steps: int):
    for result in run_ranks(accumulation_loops, world, ga, steps):
        ds_counters, ds_applied, ds_state = result["deepspeed"]
        acc_counters, acc_applied, acc_state = result["accelerate"]
        direct_counters, direct_applied, direct_state = result["direct"]
        batch = MICRO * ga * world
        assert ds_counters == (steps, steps * ga, steps * batch, 0)
        assert acc_counters == (steps, steps, steps * batch, 0)  # step() called once a window
        assert direct_counters == ds_counters
        assert ds_applied == ([False] * (ga - 1) + [True]) * steps and acc_applied == [True] * steps
        for key, value in ds_state.items():
            assert torch.equal(acc_state[key], value), key
            assert torch.equal(direct_state[key], value), key  # ga and world are powers of two: exact


def test_accelerate_style_loop_and_direct_backward_match_deepspeeds_loop():
    check_accumulation(2, 4, 2)


def test_accelerate_style_loop_and_direct_backward_at_four_ranks():
    check_accumulation(4, 2, 2)


def fp16_direct_backward(rank: int, world: int):
    import pytest

    import zero3

    model = make_model()
    cfg = {**config(MICRO, 2), "fp16": {"enabled": True, "initial_scale_power": 4}}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config=cfg)
    x, y = make_batches(1, MICRO)[0]
    with pytest.raises(zero3.EngineError, match=r"engine.scale\(loss\).backward\(\)"):
        engine(x.half(), y.half()).float().backward()
    assert all(sp.grad_shard is None for sp in engine.table.values())  # nothing was kept
    engine.zero_grad()
    loss = engine(x.half(), y.half())
    scaled = engine.scale(loss)
    assert torch.equal(scaled, loss * 16.0)
    scaled.backward()
    grads = [sp.grad_shard.clone() for sp in engine.table.values() if sp.grad_shard is not None]
    engine.zero_grad()
    engine.backward(engine(x.half(), y.half()))
    same = [sp.grad_shard for sp in engine.table.values() if sp.grad_shard is not None]
    assert len(grads) == len(same) and all(torch.equal(a, b) for a, b in zip(grads, same))
    engine.destroy()
    return True


def test_fp16_direct_backward_needs_engine_scale():
    assert run_ranks(fp16_direct_backward, 2) == [True, True]


def coalesced_reduction(rank: int, world: int):
    """DeepSpeed's pattern: 4 chunks, the boundary set on the last, one step; with and
    without coalesce_grad_reduction, through engine.backward and loss.backward()."""
    import pytest

    import zero3

    chunks = make_batches(4 * world, MICRO, seed=7)
    results = {}
    for coalesce in (False, True):
        for direct in (False, True):
            model = make_model()
            engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                               config=config(MICRO, 1))
            for step in range(2):
                context = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
                with context:
                    for i in range(4):
                        x, y = chunks[i * world + rank]
                        loss = engine(x, y + step)
                        engine.set_gradient_accumulation_boundary(i == 3)
                        loss.backward() if direct else engine.backward(loss)
                    if coalesce:
                        assert all(sp.grad_shard is None for sp in engine.table.values())  # nothing reduced yet
                        with pytest.raises(zero3.EngineError, match="inside coalesce_grad_reduction"):
                            engine.step()
                engine.step()
            results[(coalesce, direct)] = {k: v.clone() for k, v in engine.state_dict().items()}
            with pytest.raises(zero3.EngineError, match="no_sync"):
                with engine.no_sync():
                    pass
            engine.destroy()
    reference = results[(False, False)]
    for key, state in results.items():
        for name, value in reference.items():
            assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), (key, name, (state[name] - value).abs().max().item())
    return True


def test_coalesce_grad_reduction_matches_reducing_every_backward():
    assert run_ranks(coalesced_reduction, 2) == [True, True]


def test_deepspeed_script_helpers_ops_and_arguments(tmp_path):
    """`deepspeed.add_config_arguments`, `initialize(args=...)` reading --deepspeed_config, and
    `deepspeed.ops.adam`'s optimizers as torch's (in one process: world size 1)."""
    import argparse
    import json

    import zero3 as deepspeed

    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config(MICRO, 1)))
    args = deepspeed.add_config_arguments(argparse.ArgumentParser()).parse_args(
        ["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed and args.deepspeed_config == str(path)
    model = make_model()
    optimizer = deepspeed.ops.adam.FusedAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["weight_decay"] == 0.01
    cpu_adam = deepspeed.ops.adam.DeepSpeedCPUAdam(make_model().parameters(), adamw_mode=False)
    assert type(cpu_adam) is torch.optim.Adam
    engine, client, _, _ = deepspeed.initialize(args=args, model=model, optimizer=optimizer, dist_init_required=False)
    assert client is optimizer and engine.train_micro_batch_size_per_gpu() == MICRO
    x, y = make_batches(1, MICRO)[0]
    engine.backward(engine(x, y))
    engine.step()
    assert engine.global_steps == 1 and engine.was_step_applied()
    engine.destroy()
