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
