"""What DeepSpeed's own ZeRO-3 tests assert of `zero.Init` parameters and `initialize`,
checked on zero3: DeepSpeed's per-parameter attributes on parameters built in nested or
dynamic `zero.Init` contexts (before any engine), and a scheduler that would drive an
optimizer the engine never steps."""

from __future__ import annotations

import math

import torch
from common import config, make_batches, make_model
from harness import run_ranks

MICRO = 2


class _Parent(torch.nn.Module):
    """A parent that re-initialises its child's weight in its own __init__ (rank-dependent
    values: the partition keeps rank 0's)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(12, 1)
        with torch.no_grad():
            self.linear.weight.fill_(1.0 + torch.distributed.get_rank())


def _init_attributes(rank: int, world: int) -> dict:
    import zero3 as deepspeed
    from zero3.runtime.zero.partition_parameters import ZeroParamStatus

    out: dict = {}
    ds_config = {"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": {"stage": 3}}
    with deepspeed.zero.Init(config_dict_or_path=ds_config):
        class Declared(torch.nn.Module):  # a class declared inside the outer context
            def __init__(self) -> None:
                super().__init__()
                self.fc = torch.nn.Linear(6, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(x).square().mean()

        with deepspeed.zero.Init(config_dict_or_path=ds_config):
            nested = Declared()
        outer = Declared()
        parent = _Parent()
    plain = torch.nn.Linear(6, 3)
    weight = nested.fc.weight
    out["has_ds_id"] = [hasattr(p, "ds_id") for p in (weight, nested.fc.bias, outer.fc.weight, parent.linear.weight)]
    out["plain_has_status"] = hasattr(plain.weight, "ds_status") or hasattr(plain.weight, "ds_id")
    out["ids"] = [p.ds_id for p in (weight, nested.fc.bias, outer.fc.weight, outer.fc.bias)]
    out["status_outside"] = weight.ds_status == ZeroParamStatus.NOT_AVAILABLE
    out["shape"] = (tuple(weight.ds_shape), weight.ds_numel, weight.ds_persist)
    out["ds_tensor"] = (weight.ds_tensor.numel(), parent.linear.weight.ds_tensor.numel(),
                        parent.linear.weight.ds_tensor[:math.ceil(12 / world)].tolist())
    with deepspeed.zero.GatheredParameters(weight):  # one parameter, not a list
        out["status_inside"] = weight.ds_status == ZeroParamStatus.AVAILABLE
    with deepspeed.zero.GatheredParameters(weight, modifier_rank=1):
        if rank == 1:
            with torch.no_grad():
                weight.zero_()
    with deepspeed.zero.GatheredParameters(weight):
        out["rank1_edit_everywhere"] = bool((weight == 0).all())
    engine, *_ = deepspeed.initialize(model=nested, config_params={**ds_config, "optimizer": {
        "type": "Adam", "params": {"lr": 1e-2}}})
    out["ids_after_initialize"] = [p.ds_id for p in (weight, nested.fc.bias)]
    # under DeepSpeed's default persistence threshold (1e5 elements) the engine keeps it resident
    out["engine_ds_tensor"] = (weight.ds_tensor.numel(), weight.ds_persist, weight.ds_status == ZeroParamStatus.AVAILABLE)
    engine.backward(engine(torch.randn(MICRO, 6)))
    engine.step()
    out["stepped"] = engine.global_steps
    engine.destroy()
    return out


def test_zero_init_parameters_carry_deepspeeds_attributes():
    results = run_ranks(_init_attributes, 2)
    for out in results:
        assert out["has_ds_id"] == [True] * 4 and not out["plain_has_status"]
        assert len(set(out["ids"])) == 4 and out["status_outside"] and out["status_inside"]
        assert out["shape"] == ((3, 6), 18, False)
        assert out["ds_tensor"] == (9, 6, [1.0] * 6)  # ceil(numel / 2) each; rank 0's fill
        assert out["rank1_edit_everywhere"]
        assert out["ids_after_initialize"] == out["ids"][:2]
        assert out["engine_ds_tensor"] == (9, True, True) and out["stepped"] == 1
    assert results[0]["ids"] == results[1]["ids"]  # the same ids on every rank


def _scheduler_of_another_optimizer(rank: int, world: int) -> dict:
    import warnings

    import zero3

    out = {}
    x, y = make_batches(world, MICRO)[rank]
    for name, optimizer, cfg in (
            ("config optimizer", None, {**config(MICRO, 1), "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}),
            ("factory", lambda params: torch.optim.AdamW(params, lr=1e-3), config(MICRO, 1)),
            ("another instance", "instance", config(MICRO, 1))):
        model = make_model()
        if optimizer == "instance":
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        stray = torch.optim.lr_scheduler.LambdaLR(torch.optim.Adam(model.parameters(), lr=0.5),
                                                  lambda step: 0.5 ** step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine, _, _, scheduler = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=stray,
                                                       config=cfg)
            lrs = []
            for _ in range(2):
                engine.backward(engine(x, y))
                engine.step()
                lrs.append(engine.get_lr()[0])
        out[name] = {"same": scheduler is stray, "lrs": lrs,
                     "warned": [str(w.message) for w in caught if "now drives" in str(w.message)],
                     "order_warning": any("lr_scheduler.step()" in str(w.message) for w in caught)}
    old_style = torch.optim.lr_scheduler.StepLR(torch.optim.Adam(make_model().parameters()), step_size=1)
    old_style.__class__ = type("OldStyle", (torch.optim.lr_scheduler._LRScheduler,), {
        "get_lr": torch.optim.lr_scheduler.StepLR.get_lr})
    try:
        zero3.initialize(model=make_model(), lr_scheduler=old_style,
                         config={**config(MICRO, 1), "optimizer": {"type": "Adam"}})
        out["old style"] = None
    except AssertionError as exc:
        out["old style"] = str(exc)
    client = torch.optim.AdamW(make_model().parameters(), lr=0.1)
    own = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    model = make_model()
    client = torch.optim.AdamW(model.parameters(), lr=0.1)
    own = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    engine, _, _, scheduler = zero3.initialize(model=model, optimizer=client, lr_scheduler=own,
                                               config=config(MICRO, 1))
    engine.backward(engine(x, y))
    engine.step()
    out["own"] = (scheduler is own, engine.get_lr()[0])
    return out


def test_a_scheduler_of_another_optimizer_drives_the_engines():
    """A scheduler instance built on an optimizer the engine does not step is accepted, as
    DeepSpeed accepts it, and rebound so its learning rates reach training, with a warning;
    DeepSpeed's assert stays for an old-style `_LRScheduler` with no optimizer instance."""
    for out in run_ranks(_scheduler_of_another_optimizer, 2):
        for name in ("config optimizer", "factory", "another instance"):
            case = out[name]
            assert case["same"] and case["lrs"] == [0.25, 0.125], (name, case)
            assert len(case["warned"]) == 1 and "LambdaLR" in case["warned"][0], (name, case)
            assert not case["order_warning"], (name, case)
        assert out["old style"] is not None and "OldStyle" in out["old style"] and "optimizer=" in out["old style"]
        assert out["own"] == (True, 0.05)


def test_deepspeed_names_for_checkpoint_helpers():
    from zero3.checkpoint.utils import clone_tensors_for_torch_save
    from zero3.runtime.zero.utils import ZeRORuntimeException

    base = torch.arange(10.0)
    state = {"a": base[2:4], "nested": [base[:1], (base[5:6], "tag")], "n": 3}
    cloned = clone_tensors_for_torch_save(state)
    assert torch.equal(cloned["a"], base[2:4]) and cloned["a"].untyped_storage().nbytes() == 8
    assert cloned["nested"][1][1] == "tag" and cloned["n"] == 3 and torch.equal(cloned["nested"][1][0], base[5:6])
    assert issubclass(ZeRORuntimeException, Exception)
