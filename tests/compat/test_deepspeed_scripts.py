"""What real DeepSpeed scripts and DeepSpeed's own unit tests use, unchanged but for the
imports, checked on 2 gloo ranks in one launch: `from deepspeed import get_accelerator`,
`engine.tput_timer`'s epoch count, `deepspeed.moe.utils`, the config optimizer's defaults
through the engine, the RNG left alone by `load_checkpoint` (restored on request),
tensors taken from a gathered parameter keeping their values, a client scheduler on the
client optimizer, `see_memory_usage`, `ZeROOrderedDict`, `optimizer.leaf_parameters` and
`MIN_SWAPPABLE_BYTES`."""

from __future__ import annotations

import contextlib
import io
import random

import numpy as np
import pytest
import torch
from common import Block, config, make_batches, make_model
from harness import run_ranks

MICRO = 2


def _train(engine, rank: int, world: int, steps: int = 1) -> list[float]:
    losses = []
    for x, y in make_batches(world * steps, MICRO, seed=3)[rank::world]:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


# ------------------------------------------------------------ imports and helpers
def _names_and_moe_groups(rank: int, world: int) -> dict:
    import zero3 as deepspeed
    from zero3.accelerator import get_accelerator
    from zero3.moe.utils import (
        ExpertParameterError,
        configure_moe_param_groups,
        is_moe_param,
        split_params_into_different_moe_groups_for_optimizer,
    )

    out = {"get_accelerator": deepspeed.get_accelerator is get_accelerator
           and deepspeed.get_accelerator().device_name() == "cpu"}
    model = make_model()
    decay = {"params": (p for n, p in model.named_parameters() if n.endswith("weight")), "name": "decay",
             "weight_decay": 0.1}
    rest = {"params": [p for n, p in model.named_parameters() if not n.endswith("weight")], "name": "rest"}
    groups = split_params_into_different_moe_groups_for_optimizer((decay, rest))
    out["groups"] = (type(groups).__name__, [g["name"] for g in groups], [type(g["params"]).__name__ for g in groups],
                     groups[0] is decay, sum(len(g["params"]) for g in groups) == len(list(model.parameters())))
    out["single"] = [g["name"] for g in configure_moe_param_groups(list(model.parameters()))]
    out["is_moe"] = [is_moe_param(p) for p in model.head.parameters()]
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2),
                                                   config=config(MICRO, 1))
    out["trained"] = len(_train(engine, rank, world)) == 1 and len(optimizer.param_groups) == 2
    out["epochs"] = [engine.tput_timer.epoch_count]
    for _ in range(2):
        engine.tput_timer.update_epoch_count()
    out["epochs"].append(engine.tput_timer.epoch_count)
    engine.destroy()
    expert = torch.nn.Linear(3, 3)
    expert.weight.allreduce = False  # as DeepSpeed's MoE layer marks an expert parameter
    out["marked"] = is_moe_param(expert.weight)
    try:
        split_params_into_different_moe_groups_for_optimizer({"params": list(expert.parameters()), "name": "e"})
        out["refused"] = None
    except ExpertParameterError as exc:
        out["refused"] = str(exc)
    return out


def _config_optimizer_defaults(rank: int, world: int) -> dict:
    """The config's Adam without weight_decay, through the engine, with and without offload."""
    import zero3

    out = {}
    for offload in (False, True):
        cfg = {**config(MICRO, 1), "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
        model = make_model()
        engine, optimizer, _, _ = zero3.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        _train(engine, rank, world)
        group = optimizer.param_groups[0]
        out[offload] = (type(optimizer).__name__, group["weight_decay"], group["eps"], group["betas"])
        engine.destroy()
    return out


# ----------------------------------------------------------------------- RNG
def _rng_states() -> tuple:
    return random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state()


def _same_rng(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and torch.equal(a[2], b[2])


def _rng_on_load(rank: int, world: int, folder: str) -> dict:
    import zero3

    def engine_with(**checkpoint):
        model = make_model()
        cfg = {**config(MICRO, 1), **({"checkpoint": checkpoint} if checkpoint else {})}
        return zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)[0]

    engine = engine_with()
    _train(engine, rank, world)
    random.seed(10 + rank), np.random.seed(10 + rank), torch.manual_seed(10 + rank)
    saved = _rng_states()
    engine.save_checkpoint(folder, tag="rng")
    engine.destroy()
    out = {}
    for name, checkpoint in (("default", {}), ("load_rng_state", {"load_rng_state": True})):
        engine = engine_with(**checkpoint)
        random.seed(99), np.random.seed(99), torch.manual_seed(99)
        before = _rng_states()
        engine.load_checkpoint(folder, tag="rng")
        after = _rng_states()
        out[name] = (_same_rng(after, before), _same_rng(after, saved))
        engine.destroy()
    return out


# ------------------------------------------------------- gathered parameters
def _tensors_taken_inside_gathered_parameters(rank: int, world: int) -> dict:
    """`p.detach().cpu()` (the same storage on the CPU), `p.data` and a view taken inside
    GatheredParameters keep their values after it; the parameter is sharded again."""
    import zero3
    from zero3.params.released import is_released

    out = {}
    with zero3.zero.Init(config_dict_or_path=config(MICRO, 1)):
        model = make_model()
    weight = model.embed.weight
    with zero3.GatheredParameters([weight]):
        taken, copy = weight.detach().cpu(), weight.detach().clone()
    out["init"] = (torch.equal(taken, copy), is_released(weight))
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=config(MICRO, 1))
    _train(engine, rank, world)
    weights = [model.embed.weight, model.blocks[0].linear.weight]
    with zero3.GatheredParameters(weights):
        taken = [w.detach().cpu() for w in weights] + [weights[0].data, weights[1][1:3]]
        copies = [w.detach().clone() for w in weights]
    expected = copies + [copies[0], copies[1][1:3]]
    out["engine"] = ([torch.equal(t, c) for t, c in zip(taken, expected)], [is_released(w) for w in weights],
                     [taken[0].data_ptr() != w.untyped_storage().data_ptr() for w in weights[:1]])
    sp = engine.table[weights[0]]
    out["views_found"] = engine.fetcher.discovery.owner_of(weights[0].data) is sp
    storage = weights[0].untyped_storage()._cdata
    with zero3.GatheredParameters(weights):
        sums = [float(w.detach().sum()) for w in weights]  # nothing taken: freed in place, not moved
    out["freed_in_place"] = (weights[0].untyped_storage()._cdata == storage, is_released(weights[0]), len(sums))
    with zero3.GatheredParameters(weights):
        out["values_back"] = [torch.equal(w.detach(), c) for w, c in zip(weights, copies)]
    losses = _train(engine, rank, world, steps=2)
    out["trains"] = len(losses) == 2 and all(loss == loss for loss in losses)
    out["still_kept"] = torch.equal(taken[0], copies[0])
    engine.destroy()
    return out


# ------------------------------------------------------------- the scheduler
def _client_scheduler_on_client_optimizer(rank: int, world: int) -> dict:
    """As DeepSpeed's tests/unit/runtime/test_ds_initialize.py builds it: the client optimizer
    on model.parameters(), a LambdaLR on it, both given to initialize."""
    import zero3 as deepspeed
    from torch.optim.lr_scheduler import LambdaLR

    model = make_model()
    client_optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    client_scheduler = LambdaLR(client_optimizer, lambda step: 0.5 ** step)
    engine, optimizer, _, ds_lr_scheduler = deepspeed.initialize(
        config=config(MICRO, 1), model=model, model_parameters=list(model.parameters()),
        optimizer=client_optimizer, lr_scheduler=client_scheduler)
    lrs = [engine.get_lr()[0]]
    for _ in range(3):
        _train(engine, rank, world)
        lrs.append(engine.get_lr()[0])
    out = {"same": (ds_lr_scheduler is client_scheduler, optimizer is client_optimizer), "lrs": lrs,
           "client_lr": client_optimizer.param_groups[0]["lr"]}
    engine.destroy()
    return out


# ---------------------------------------------------- DeepSpeed's helper names
def _helpers(rank: int, world: int) -> dict:
    import zero3
    from zero3.runtime.swap_tensor import MIN_SWAPPABLE_BYTES
    from zero3.runtime.utils import see_memory_usage
    from zero3.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    out = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        see_memory_usage("quiet")
        see_memory_usage("before init", force=True)
    out["memory"] = printed.getvalue()
    model = make_model()
    zero3.set_z3_leaf_modules(model, [Block])
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  config=config(MICRO, 1, threshold=0))
    leaves = engine.optimizer.leaf_parameters
    out["leaves"] = sorted((next(n for n, m in model.named_modules() if m is module), len(params))
                           for module, params in leaves.items())
    out["dicts"] = [isinstance(m._parameters, ZeROOrderedDict) for m in (model, model.embed, model.blocks[0])]
    first = model.embed._parameters
    _train(engine, rank, world)
    late = torch.nn.Linear(5, 5)
    late._parameters = dict(late._parameters)
    engine.module.late = late
    _train(engine, rank, world)
    out["after_forward"] = (model.embed._parameters is first, isinstance(late._parameters, ZeROOrderedDict))
    engine.destroy()
    plain = torch.nn.Linear(4, 4)
    plain._parameters = dict(plain._parameters)
    ensure_zero_ordered_dict(plain)
    out["ensured"] = (isinstance(plain._parameters, ZeROOrderedDict), sorted(plain._parameters),
                      plain(torch.ones(1, 4)).shape == (1, 4))
    out["min_swappable"] = MIN_SWAPPABLE_BYTES
    return out


def _all(rank: int, world: int, folder: str) -> dict:
    return {"names": _names_and_moe_groups(rank, world), "defaults": _config_optimizer_defaults(rank, world),
            "rng": _rng_on_load(rank, world, folder), "gathered": _tensors_taken_inside_gathered_parameters(rank, world),
            "scheduler": _client_scheduler_on_client_optimizer(rank, world), "helpers": _helpers(rank, world)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(_all, 2, str(tmp_path_factory.mktemp("rng")), timeout=300)


def test_get_accelerator_epoch_count_and_moe_groups(results):
    for out in results:
        names = out["names"]
        assert names["get_accelerator"] and names["epochs"] == [0, 2] and names["trained"]
        assert names["groups"] == ("list", ["decay", "rest"], ["list", "list"], True, True)
        assert names["single"] == ["dense-params"] and names["is_moe"] == [False, False]
        assert names["marked"] and "expert" in names["refused"] and "allreduce=False" in names["refused"]


def test_config_adam_defaults_to_deepspeeds_no_weight_decay(results):
    for out in results:
        for offload in (False, True):
            assert out["defaults"][offload] == ("AdamW", 0.0, 1e-8, (0.9, 0.999)), offload


def test_load_checkpoint_leaves_the_rng_unless_asked(results):
    for out in results:
        assert out["rng"]["default"] == (True, False)  # as DeepSpeed: untouched
        assert out["rng"]["load_rng_state"] == (False, True)  # this rank's saved states


def test_tensors_taken_inside_gathered_parameters_keep_their_values(results):
    for out in results:
        checks = out["gathered"]
        assert checks["init"] == (True, True)
        kept, released, moved = checks["engine"]
        assert kept == [True] * 4 and released == [True, True] and moved == [True]
        assert checks["views_found"] and checks["values_back"] == [True, True]
        assert checks["freed_in_place"] == (True, True, 2)
        assert checks["trains"] and checks["still_kept"]


def test_a_client_scheduler_on_the_client_optimizer_is_stepped(results):
    for out in results:
        checks = out["scheduler"]
        assert checks["same"] == (True, True)
        assert checks["lrs"] == pytest.approx([0.01, 0.005, 0.0025, 0.00125])
        assert checks["client_lr"] == pytest.approx(0.00125)


def test_deepspeed_helper_names(results):
    first, second = results
    assert "before init" in first["helpers"]["memory"] and "MA " in first["helpers"]["memory"]
    assert "quiet" not in first["helpers"]["memory"] and second["helpers"]["memory"] == ""  # rank 0 only
    for out in results:
        helpers = out["helpers"]
        assert helpers["leaves"] == [("blocks.0", 4), ("blocks.2", 4)]  # blocks.1 is frozen: not stepped
        assert helpers["dicts"] == [True, True, True] and helpers["after_forward"] == (True, True)
        assert helpers["ensured"] == (True, ["bias", "weight"], True)
        assert helpers["min_swappable"] == 1024 ** 2
