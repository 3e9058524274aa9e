"""zero3.utils, zero3.utils.zero_to_fp32 and zero3.comm against their meaning; DeepSpeed's
checkpoint tag validation; saving inside an accumulation window."""

from __future__ import annotations

import json

import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks

MICRO = 2


def plain_reference(world: int, ga: int = 1):
    """Plain PyTorch on the first global batch: (gradients after backward, AdamW state and
    weights after the step)."""
    model = make_model()
    optimizer = torch.optim.AdamW(two_param_groups(model))
    for index, (x, y) in enumerate(make_batches(world * ga, MICRO)):
        (model(x, y) / (world * ga)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    optimizer.step()
    state = {n: {k: v.clone() for k, v in optimizer.state[p].items()} for n, p in model.named_parameters()
             if p in optimizer.state}
    return grads, state, {n: p.detach().clone() for n, p in model.named_parameters()}


def utils_functions(rank: int, world: int, folder: str):
    import pytest

    import zero3
    import zero3.comm as dscomm
    from zero3 import utils
    from zero3.utils import zero_to_fp32

    grads, state, weights = plain_reference(world)
    model = make_model()
    names = {p: n for n, p in model.named_parameters()}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(MICRO, 1))
    x, y = make_batches(world, MICRO)[rank]
    engine.backward(engine(x, y))
    for p, name in names.items():
        full = utils.safe_get_full_grad(p)
        if not p.requires_grad:
            assert full is None and utils.safe_get_full_fp32_param(p) is None
            continue
        torch.testing.assert_close(full, grads[name], rtol=1e-5, atol=1e-7)
        local = utils.safe_get_local_grad(p)
        rows = [torch.empty_like(local) for _ in range(world)]
        dscomm.all_gather(rows, local)
        assert torch.equal(torch.cat(rows)[: p.numel()].view(p.shape), full)
    engine.step()
    assert all(utils.safe_get_full_grad(p) is None for p in names)  # the step consumed them
    for p, name in names.items():
        if not p.requires_grad:
            assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None
            continue
        torch.testing.assert_close(utils.safe_get_full_fp32_param(p), weights[name], rtol=1e-5, atol=1e-7)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(utils.safe_get_full_optimizer_state(p, key), state[name][key],
                                       rtol=1e-5, atol=1e-9)
        assert float(utils.safe_get_full_optimizer_state(p, "step")) == 1.0
    # setters: every rank passes the same value; the model then computes with it
    head = model.head.weight
    new = torch.linspace(-1, 1, head.numel()).view(head.shape)
    utils.safe_set_full_fp32_param(head, new)
    assert torch.equal(utils.safe_get_full_fp32_param(head), new)
    reference = make_model()
    reference.load_state_dict({n: w for n, w in weights.items()}, strict=False)
    with torch.no_grad():
        reference.head.weight.copy_(new)
        assert torch.allclose(engine(x, y), reference(x, y), rtol=1e-5, atol=1e-7)
    utils.safe_set_full_optimizer_state(head, new * 2, "exp_avg")
    assert torch.equal(utils.safe_get_full_optimizer_state(head, "exp_avg"), new * 2)
    local = utils.safe_get_local_fp32_param(head)
    utils.safe_set_local_fp32_param(head, local + 1)
    assert torch.equal(utils.safe_get_local_fp32_param(head), local + 1)
    utils.safe_set_full_grad(head, new)
    assert torch.equal(utils.safe_get_full_grad(head), new)
    engine.zero_grad()
    with pytest.raises(zero3.compat.param_access.ParamAccessError, match="shape"):
        utils.safe_set_full_fp32_param(head, torch.zeros(3))
    # leaf modules
    leafy = make_model()
    assert utils.set_z3_leaf_modules(leafy, [type(leafy.blocks[0])]) == list(leafy.blocks)
    assert utils.z3_leaf_module(leafy.blocks[1]) and not utils.z3_leaf_module(leafy.head)
    assert utils.z3_leaf_parameter(leafy.blocks[0].linear.weight) and not utils.z3_leaf_parameter(leafy.head.weight)
    assert utils.get_z3_leaf_modules(leafy) == list(leafy.blocks)
    utils.unset_z3_leaf_modules(leafy, [type(leafy.blocks[0])])
    assert not utils.get_z3_leaf_modules(leafy)
    # zero_to_fp32 over a zero3 checkpoint: the fp32 masters, whole
    engine.save_checkpoint(folder, tag="t1")
    masters = {n: utils.safe_get_full_fp32_param(p) for p, n in names.items() if p.requires_grad}
    dscomm.barrier()
    if rank == 0:
        fp32 = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder)
        assert set(fp32) == set(make_model().state_dict())
        for name, value in masters.items():
            assert torch.equal(fp32[name], value), name
        files = zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(
            folder, f"{folder}/out", max_shard_size=2000, safe_serialization=True)
        index = json.loads(open(f"{folder}/out/model.safetensors.index.json").read())
        assert len(files) > 2 and set(index["weight_map"]) == set(fp32)
        trainable_only = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            folder, tag="t1", exclude_frozen_parameters=True)
        assert set(trainable_only) < set(fp32) and "blocks.1.linear.weight" not in trainable_only
        loaded = zero_to_fp32.load_state_dict_from_zero_checkpoint(make_model(seed=9), folder)
        assert torch.equal(loaded.head.weight.detach(), fp32["head.weight"])
        with pytest.raises(FileNotFoundError):
            zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(folder, tag="nope")
    engine.destroy()
    return True


def comm_functions(rank: int, world: int):
    import os

    import zero3.comm as dscomm
    from zero3.accelerator import get_accelerator

    assert dscomm.is_initialized() and dscomm.get_rank() == rank and dscomm.get_world_size() == world
    assert dscomm.get_local_rank() == int(os.environ["LOCAL_RANK"]) == rank
    assert get_accelerator().device_count() == world and get_accelerator().current_device() == rank
    t = torch.tensor([float(rank + 1)])
    dscomm.all_reduce(t)
    assert t.item() == world * (world + 1) / 2
    out = torch.empty(world)
    dscomm.all_gather_into_tensor(out, torch.tensor([float(rank)]))
    assert out.tolist() == [float(r) for r in range(world)]
    b = torch.tensor([float(rank)])
    dscomm.broadcast(b, src=world - 1)
    assert b.item() == world - 1
    piece = torch.empty(1)
    dscomm.reduce_scatter_tensor(piece, torch.arange(world, dtype=torch.float32))
    assert piece.item() == rank * world
    dscomm.barrier()
    return True


def test_utils_zero_to_fp32_and_comm(tmp_path):
    assert run_ranks(utils_functions, 2, str(tmp_path)) == [True, True]
    assert run_ranks(comm_functions, 4) == [True] * 4


def tag_validation(rank: int, world: int, folder: str):
    import logging

    import pytest

    import zero3

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("zero3").addHandler(Keep())
    outcomes = {}
    for mode in ("Warn", "Ignore", "Fail"):
        model = make_model()
        cfg = {**config(MICRO, 1), "checkpoint": {"tag_validation": mode}}
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                           config=cfg)
        records.clear()
        target = f"{folder}/{mode}"
        if mode == "Fail":
            with pytest.raises(zero3.CheckpointError, match="different checkpoint tags"):
                engine.save_checkpoint(target, tag=f"step-r{rank}")
        else:
            engine.save_checkpoint(target, tag=f"step-r{rank}")
            path, _ = engine.load_checkpoint(target)
            assert path.endswith("step-r0")
        outcomes[mode] = [m for m in records if "different checkpoint tags" in m]
        for bad in (None, ""):
            with pytest.raises(ValueError, match="save_dir"):
                engine.save_checkpoint(bad)
        engine.destroy()
    return outcomes


def test_checkpoint_tag_validation_modes(tmp_path):
    import os

    results = run_ranks(tag_validation, 2, str(tmp_path))
    assert len(results[0]["Warn"]) == 1 and not results[1]["Warn"]  # rank 0 warns once
    assert not results[0]["Ignore"] and not results[1]["Ignore"]
    assert sorted(os.listdir(tmp_path / "Warn")) == ["latest", "step-r0"]
    assert not (tmp_path / "Fail").exists()  # refused before anything was written


def mid_window_resume(rank: int, world: int, folder: str, ga: int, steps: int, save_at: int | None,
                      extra: dict | None = None):
    """Train `steps` optimizer steps; with `save_at` set, save after that many micro-steps
    and finish in a new engine loaded from the checkpoint. `extra`: more config (with bf16
    the batches are cast to it)."""
    import zero3

    batches = make_batches(steps * ga * world, MICRO, seed=4)

    def build():
        model = make_model(dropout=0.1)  # dropout: the resumed run needs the saved RNG too
        return zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                config={**config(MICRO, ga), "checkpoint": {"load_rng_state": True},
                                        **(extra or {})})[0]

    engine = build()
    losses = []
    total = steps * ga
    for micro_step in range(total):
        if save_at is not None and micro_step == save_at:
            engine.save_checkpoint(folder, tag="mid")
            engine.destroy()
            engine = build()
            engine.load_checkpoint(folder)
            assert engine.micro_steps == save_at
        x, y = batches[micro_step * world + rank]
        if extra and "bf16" in extra:
            x, y = x.bfloat16(), y.bfloat16()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in engine.state_dict().items()}
    engine.destroy()
    return losses, state


def test_save_inside_an_accumulation_window_resumes_exactly(tmp_path):
    for world in (2, 4):
        straight = run_ranks(mid_window_resume, world, str(tmp_path / f"a{world}"), 4, 2, None)
        resumed = run_ranks(mid_window_resume, world, str(tmp_path / f"b{world}"), 4, 2, 6)
        manifest = json.loads((tmp_path / f"b{world}" / "mid" / "manifest.json").read_text())
        assert any(entry.get("grad") for entry in manifest["params"].values())
        for (losses_a, state_a), (losses_b, state_b) in zip(straight, resumed):
            assert losses_a == losses_b
            for key, value in state_a.items():
                assert torch.equal(state_b[key], value), key


def test_bf16_accumulation_saved_inside_a_window_resumes_exactly(tmp_path):
    """data_types.grad_accum_dtype "bf16": the gradient shards are bf16, saved so, and a load
    goes on summing in bf16 (the same sums as the run that did not stop)."""
    extra = {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "bf16"}}
    straight = run_ranks(mid_window_resume, 2, str(tmp_path / "a"), 4, 2, None, extra)
    resumed = run_ranks(mid_window_resume, 2, str(tmp_path / "b"), 4, 2, 6, extra)
    default = run_ranks(mid_window_resume, 2, str(tmp_path / "c"), 4, 2, None, {"bf16": {"enabled": True}})
    from safetensors import safe_open
    with safe_open(str(next((tmp_path / "b" / "mid").glob("*rank0*.safetensors"))), "pt") as saved:
        grads = [saved.get_tensor(k).dtype for k in saved.keys() if k.startswith("grad/")]
    assert grads and set(grads) == {torch.bfloat16}
    for (losses_a, state_a), (losses_b, state_b) in zip(straight, resumed):
        assert losses_a == losses_b
        for key, value in state_a.items():
            assert torch.equal(state_b[key], value), key
    assert any(not torch.equal(default[0][1][k], straight[0][1][k]) for k in straight[0][1]), \
        "fp32 and bf16 sums should differ somewhere, or this test shows nothing"
