"""DeepSpeed's contract where code written for DeepSpeed depends on it: the exception
classes its `except` clauses catch, a client optimizer beside the config's section,
backward's return value, initialize inside zero.Init."""

from __future__ import annotations

import logging

import pytest
import torch
from common import config, make_batches, make_model, two_param_groups
from harness import run_ranks

MICRO = 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _raised(call) -> BaseException | None:
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test inspects the class
        return exc
    return None


def _engine_errors(rank: int, world: int, folder: str) -> dict:
    import zero3

    out = {}
    bad = config(MICRO, 1)
    bad["checkpoint"] = {"tag_validation": "Sometimes"}
    exc = _raised(lambda: zero3.initialize(model=make_model(), config=bad))
    out["config"] = (isinstance(exc, zero3.DeepSpeedConfigError), isinstance(exc, ValueError), str(exc))
    model = make_model()
    cfg = config(MICRO, 2)
    cfg["checkpoint"] = {"tag_validation": "Fail"}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=cfg)
    x, y = make_batches(world, MICRO)[rank]
    loss = engine(x, y)
    returned = engine.backward(loss)
    out["backward_returns"] = (returned.item(), loss.item() / 2)
    vector = engine(x, y) * torch.ones(3)
    exc = _raised(lambda: engine.scale(vector))
    out["scale"] = (isinstance(exc, AssertionError), str(exc))
    exc = _raised(lambda: engine.backward(vector))
    out["backward"] = (isinstance(exc, AssertionError), str(exc))
    exc = _raised(lambda: engine.save_checkpoint(folder, tag=f"step_rank{rank}"))
    out["tags"] = (isinstance(exc, AssertionError), str(exc))
    return out


def test_exceptions_are_deepspeeds_classes(tmp_path):
    for out in run_ranks(_engine_errors, 2, str(tmp_path)):
        is_ds, is_value, message = out["config"]
        assert is_ds and is_value and "tag_validation" in message
        returned, expected = out["backward_returns"]
        assert returned == pytest.approx(expected, rel=1e-6)  # the loss divided by the accumulation steps
        for key in ("scale", "backward"):
            is_assertion, message = out[key]
            assert is_assertion and "scalar tensor" in message, (key, message)
        is_assertion, message = out["tags"]
        assert is_assertion and "different checkpoint tags" in message


def _client_and_config_sections(rank: int, world: int) -> dict:
    import zero3

    records = _Records()
    logging.getLogger("zero3").addHandler(records)
    cfg = config(MICRO, 1)
    cfg["optimizer"] = {"type": "Adam", "params": {"lr": 1e-3}}
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    model = make_model()
    client = torch.optim.SGD(model.parameters(), lr=0.05)
    schedule = torch.optim.lr_scheduler.StepLR(client, step_size=1, gamma=0.5)
    engine, optimizer, _, scheduler = zero3.initialize(model=model, optimizer=client, lr_scheduler=schedule,
                                                       config=cfg)
    x, y = make_batches(world, MICRO)[rank]
    engine.backward(engine(x, y))
    engine.step()
    return {"optimizer": type(optimizer).__name__, "scheduler": scheduler is schedule, "lr": engine.get_lr()[0],
            "warnings": records.messages}


def test_client_optimizer_wins_over_the_config_section():
    for rank, out in enumerate(run_ranks(_client_and_config_sections, 2)):
        assert out["optimizer"] == "SGD" and out["scheduler"]
        assert out["lr"] == pytest.approx(0.025)  # the client's StepLR stepped once
        ignored = [m for m in out["warnings"] if "is ignored" in m]
        if rank == 0:
            assert len(ignored) == 2 and "'optimizer'" in ignored[0] and "'scheduler'" in ignored[1], ignored
        else:
            assert not ignored


def _initialize_inside_init(rank: int, world: int) -> list[float]:
    import zero3

    losses = []
    for inside in (False, True):
        if inside:
            with zero3.zero.Init():
                model = make_model()
                engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                                   config=config(MICRO, 1))
                extra = torch.nn.Linear(4, 4)  # built after initialize, still in the context: partitioned
            assert extra.weight.numel() == 16 and extra.weight.untyped_storage().nbytes() == 0
        else:
            model = make_model()
            engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                               config=config(MICRO, 1))
        for x, y in make_batches(2 * world, MICRO)[rank::world]:
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        engine.destroy()
    return losses


def test_initialize_inside_zero_init():
    for losses in run_ranks(_initialize_inside_init, 2):
        assert losses[:2] == losses[2:]


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = torch.nn.Linear(6, 6)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))).square().mean()


def _train(engine, rank: int, world: int, steps: int, seed: int = 1) -> None:
    for x, y in make_batches(steps * world, MICRO, seed=seed)[rank::world]:
        engine.backward(engine(x, y))
        engine.step()


def _gathered_contract(rank: int, world: int, folder: str) -> dict:
    import zero3
    from zero3.utils import safe_get_full_fp32_param
    from zero3.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint

    out: dict = {}
    # NumPy views kept from inside the block, on a model built in zero.Init, then under the engine
    with zero3.zero.Init():
        model = make_model()
    with zero3.GatheredParameters(list(model.parameters())):
        arrays = [p.detach().cpu().numpy() for p in model.parameters()]
        copies = [p.detach().clone() for p in model.parameters()]
    out["numpy_init"] = all(torch.equal(torch.from_numpy(a.copy()), c) for a, c in zip(arrays, copies))
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(MICRO, 1))
    _train(engine, rank, world, 1)
    with zero3.GatheredParameters(list(model.parameters())):
        arrays = [p.detach().cpu().numpy() for p in model.parameters()]
        copies = [p.detach().clone() for p in model.parameters()]
    _train(engine, rank, world, 1, seed=2)
    out["numpy_engine"] = all(torch.equal(torch.from_numpy(a.copy()), c)  # resident ones are updated in place
                              for a, c, p in zip(arrays, copies, model.parameters()) if p.numel() > 30)
    with zero3.GatheredParameters(list(model.parameters())):
        out["moved_on"] = not all(torch.equal(p.detach(), c) for p, c in zip(model.parameters(), copies))
    # an in-place write that leaves the values equal, on the last rank only
    weight = model.embed.weight
    with zero3.GatheredParameters([weight]):
        before = weight.detach().clone()
    try:
        with zero3.GatheredParameters([weight, model.head.bias], modifier_rank=None):
            if rank == world - 1:
                with torch.no_grad():
                    weight.add_(0.0)
                    model.head.bias.add_(1.0)  # resident: undone too
        out["in_place"] = None
    except RuntimeError as exc:
        out["in_place"] = str(exc)
    with zero3.GatheredParameters([weight, model.head.bias]):
        out["in_place_kept_values"] = torch.equal(weight.detach(), before)
        out["bias"] = model.head.bias.detach().clone()
    engine.destroy()
    # load_state_dict_from_zero_checkpoint on the live model, one and two param groups
    for groups in (1, 2):
        model = make_model()
        params = two_param_groups(model) if groups == 2 else [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(params), config=config(MICRO, 1))
        _train(engine, rank, world, 2)
        engine.save_checkpoint(f"{folder}/groups{groups}", tag="saved")
        saved = get_fp32_state_dict_from_zero_checkpoint(f"{folder}/groups{groups}")
        with torch.no_grad():  # the frozen block moves too, so loading it back is seen
            with zero3.GatheredParameters(list(model.blocks[1].parameters()), modifier_rank=0):
                for p in model.blocks[1].parameters():
                    p.fill_(0.5)
        _train(engine, rank, world, 2, seed=3)
        with zero3.GatheredParameters(list(model.parameters()), modifier_rank=None):
            load_state_dict_from_zero_checkpoint(engine.module, f"{folder}/groups{groups}")
            inside = {n: torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters()}
        after = {n: torch.equal(safe_get_full_fp32_param(p), saved[n]) for n, p in model.named_parameters()
                 if p.requires_grad}
        with zero3.GatheredParameters(list(model.parameters())):
            after.update({f"{n} (weights)": torch.equal(p.detach(), saved[n]) for n, p in model.named_parameters()})
        out[f"live_load_{groups}"] = (inside, after)
        engine.destroy()
    # tied weights: one tensor object under both names
    torch.manual_seed(0)
    tied = _Tied()
    engine, _, _, _ = zero3.initialize(model=tied, optimizer=torch.optim.AdamW(tied.parameters()),
                                       config=config(MICRO, 1, threshold=0))
    engine.backward(engine(torch.randn(MICRO, 6)))
    engine.step()
    engine.save_checkpoint(f"{folder}/tied", tag="t")
    state = get_fp32_state_dict_from_zero_checkpoint(f"{folder}/tied")
    out["tied"] = id(state["a.weight"]) == id(state["b.weight"])
    return out


def test_gathered_parameters_contract(tmp_path):
    for rank, out in enumerate(run_ranks(_gathered_contract, 2, str(tmp_path))):
        assert out["numpy_init"] and out["numpy_engine"] and out["moved_on"]
        assert out["in_place"] is not None and "in-place modification" in out["in_place"], out["in_place"]
        assert "rank 1" in out["in_place"] and "embed.weight" in out["in_place"]
        assert out["in_place_kept_values"]
        for groups in (1, 2):
            inside, after = out[f"live_load_{groups}"]
            assert all(inside.values()) and all(after.values()), (groups, inside, after)
            assert any("blocks.1" in name for name in inside)  # frozen parameters included
        assert out["tied"]


class _WithExperts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(2))
        self.router = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(e(self.router(x)) for e in self.experts).square().mean()


def _names_and_status(rank: int, world: int) -> dict:
    import zero3
    from zero3.runtime import config as ds_config
    from zero3.runtime import lr_schedules
    from zero3.runtime.zero.offload_config import OffloadDeviceEnum
    from zero3.utils import safe_get_full_grad, safe_update_full_grad_vectorized, z3_leaf_module
    from zero3.utils.torch import required_torch_version

    out = {}
    # names scripts import
    model = make_model()
    engine, optimizer, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                               config=config(MICRO, 1))
    schedule = lr_schedules.WarmupLR(optimizer, warmup_num_steps=4, warmup_max_lr=0.01)
    out["names"] = (lr_schedules.WARMUP_LR, lr_schedules.ONE_CYCLE, lr_schedules.WARMUP_DECAY_LR,
                    ds_config.ADAM_OPTIMIZER, ds_config.ADAMW_OPTIMIZER, OffloadDeviceEnum("cpu").value,
                    required_torch_version(min_version=1.0), required_torch_version(max_version="1.0"),
                    type(schedule).__name__, issubclass(ds_config.DeepSpeedConfigError, Exception))
    # the vectorized gradient update: the whole gradient halved
    x, y = make_batches(world, MICRO)[rank]
    engine.backward(engine(x, y))
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [safe_get_full_grad(p) for p in trainable]
    safe_update_full_grad_vectorized(list(model.parameters()), lambda grad, param: grad * 0.5)
    out["halved"] = all(torch.equal(safe_get_full_grad(p), g * 0.5) for p, g in zip(trainable, before))
    # ds_persist on every managed parameter
    out["persist"] = [(p.numel(), p.ds_persist) for p in model.parameters()]
    engine.destroy()
    # leaf modules declared in the config
    cfg = config(MICRO, 1)
    cfg["zero_optimization"]["leaf_module"] = {"classes": ["ModuleList"], "name_suffixes": ["router"]}
    experts = _WithExperts()
    engine, _, _, _ = zero3.initialize(model=experts, optimizer=torch.optim.AdamW(experts.parameters()), config=cfg)
    out["leaves"] = (z3_leaf_module(experts.experts), z3_leaf_module(experts.router), z3_leaf_module(experts))
    return out


def test_deepspeed_names_and_parameter_status():
    for out in run_ranks(_names_and_status, 2):
        assert out["names"] == ("WarmupLR", "OneCycle", "WarmupDecayLR", "adam", "adamw", "cpu", True, False,
                                "WarmupLR", True)
        assert out["halved"]
        assert all(persist == (numel <= 30) for numel, persist in out["persist"]), out["persist"]
        assert out["leaves"] == (True, True, False)


def _save_on_one_rank(rank: int, world: int, folder: str) -> float | None:
    import datetime
    import time


    import zero3
    from zero3.checkpoint.arrival import default_store

    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                       config=config(MICRO, 1))  # checkpoint.arrival_timeout: 60 s
    store = default_store()
    if rank == 1:
        store.wait(["test/saver_done"], datetime.timedelta(seconds=150))
        return None
    start = time.monotonic()
    try:
        engine.save_checkpoint(folder)
    except zero3.CheckpointError as exc:
        assert "process group's timeout" in str(exc), str(exc)
    finally:
        store.set("test/saver_done", b"1")
    return time.monotonic() - start


def test_check_in_waits_no_longer_than_the_process_group(tmp_path):
    waited = run_ranks(_save_on_one_rank, 2, str(tmp_path), collective_timeout=8.0)[0]
    assert 7.0 <= waited < 30.0, waited  # the group's 8 s, not checkpoint.arrival_timeout's 60 s



def _coalesced_bf16(rank: int, world: int) -> dict:
    """One bf16 step after four backwards: reduced after each backward (bf16 communication,
    fp32 accumulation), under one coalesced reduction, and after each backward with fp32
    communication (the reference: no rounding after autograd's own)."""
    import contextlib

    import zero3
    from zero3.utils import safe_get_full_fp32_param, safe_get_full_grad

    chunks = make_batches(4 * world, MICRO, seed=7, inputs=64, outputs=64)
    runs = {}
    for run in ("uncoalesced", "coalesced", "reference"):
        cfg = config(MICRO, 1, threshold=0, reduce_bucket_size=8192)
        cfg["bf16"] = {"enabled": True}
        if run == "reference":
            cfg["communication_data_type"] = "fp32"
        model = make_model(inputs=64, width=64, depth=4, outputs=64, freeze_block=None)
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                           config=cfg)
        with engine.coalesce_grad_reduction() if run == "coalesced" else contextlib.nullcontext():
            for i in range(4):
                x, y = chunks[i * world + rank]
                engine.set_gradient_accumulation_boundary(i == 3)
                engine.backward(engine(x.bfloat16(), y.bfloat16()))
        grads = {n: safe_get_full_grad(p) for n, p in model.named_parameters()}
        engine.step()
        runs[run] = (grads, {n: safe_get_full_fp32_param(p) for n, p in model.named_parameters()})
        engine.destroy()

    def largest(a: str, b: str, which: int) -> float:
        return max((runs[a][which][n] - runs[b][which][n]).abs().max().item() for n in runs[a][which])

    return {f"{a} vs {b} ({kind})": largest(a, b, which) for a, b in
            (("coalesced", "uncoalesced"), ("coalesced", "reference"), ("uncoalesced", "reference"))
            for which, kind in ((0, "gradients"), (1, "fp32 weights after one step"))}


def test_coalesced_reduction_keeps_bf16_precision():
    for out in run_ranks(_coalesced_bf16, 2):
        print("largest differences:", out)
        assert out["coalesced vs reference (gradients)"] < 5e-6, out  # summed in fp32, as grad_shard is
        assert out["coalesced vs reference (fp32 weights after one step)"] < 5e-6, out
        assert out["uncoalesced vs reference (gradients)"] < 1e-2, out  # bf16 communication's rounding only
