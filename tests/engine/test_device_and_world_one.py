"""Which CUDA device a process takes, and world size 1 on the path of world size N.

- The device rule (zero3/platform/device.py): the visible count, a device the process
  chose itself and LOCAL_RANK decide; a LOCAL_RANK no visible GPU answers to is a named
  error. The rule reads torch.cuda's answers only, so it is checked here by giving it
  those answers (this machine has no GPU; tests/gpu/sharded_checks.py runs it on one).
- ZERO3_COLLECTIVES_AT_WORLD_SIZE_1=1: one rank issues the same all-gathers and
  reduce-scatters as N ranks would, with bit-identical results to the default path, which
  issues none.
"""

from __future__ import annotations

import pytest
import torch
from common import batch_index, config, make_batches, make_model, two_param_groups
from harness import run_ranks

from zero3.platform import device as device_rule


@pytest.mark.parametrize("visible, initialised, current, local_rank, expected", [
    (1, False, None, 3, 0),   # one visible GPU is every rank's (scheduler binding, or gloo sharing)
    (4, False, None, 2, 2),   # LOCAL_RANK's device
    (4, True, 3, 1, 3),       # a device the process chose itself is kept
    (4, True, 0, 2, 2),       # the default device 0 is no choice: LOCAL_RANK's
    (2, True, 0, 5, 0),       # LOCAL_RANK beyond the visible GPUs, CUDA already on device 0: kept
])
def test_device_rule(monkeypatch, visible, initialised, current, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    assert device_rule.choose_cuda_device() == expected


def test_device_rule_names_an_unseen_local_rank(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with pytest.raises(device_rule.DeviceChoiceError,
                       match=r"LOCAL_RANK=5 .* sees 2 device\(s\) \(CUDA_VISIBLE_DEVICES=4,5\).*set_device"):
        device_rule.choose_cuda_device()


STEPS, MICRO, GA = 3, 4, 2


def _train(rank: int, world: int, offload: bool) -> dict:
    import zero3

    model = make_model()
    optimizer = torch.optim.AdamW(two_param_groups(model))
    extra = {"offload_param": {"device": "cpu"}} if offload else {}
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=config(MICRO, GA, threshold=30, **extra))
    batches = make_batches(STEPS * GA * world, MICRO)
    losses = []
    for step in range(STEPS):
        for micro in range(GA):
            x, y = batches[batch_index(step, micro, rank, GA, world)]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    params = {name: p.clone() for name, p in zero3.checkpoint.export.consolidated_state_dict(engine).items()}
    return {"losses": losses, "params": params, "counters": engine.comm.counters.snapshot(),
            "active": engine.comm.active, "late": engine.late_gathers}


def _both_paths(rank: int, world: int) -> dict:
    import os

    import zero3.checkpoint.export  # noqa: F401 - consolidated_state_dict

    out = {}
    for offload in (False, True):
        os.environ.pop("ZERO3_COLLECTIVES_AT_WORLD_SIZE_1", None)
        out[("default", offload)] = _train(rank, world, offload)
        os.environ["ZERO3_COLLECTIVES_AT_WORLD_SIZE_1"] = "1"
        out[("collectives", offload)] = _train(rank, world, offload)
    return out


def test_world_size_one_takes_the_path_of_world_size_n():
    (out,) = run_ranks(_both_paths, 1)
    for offload in (False, True):
        default, real = out[("default", offload)], out[("collectives", offload)]
        assert not default["active"] and real["active"]
        assert default["counters"] == {}, default["counters"]  # nothing issued by default
        calls = {op: c for op, (c, _) in real["counters"].items()}
        assert calls.get("all_gather", 0) > 0 and calls.get("reduce_scatter", 0) > 0, calls
        assert real["losses"] == default["losses"]  # bit for bit
        assert all(torch.equal(real["params"][k], default["params"][k]) for k in default["params"])
        assert real["late"] == default["late"] == 0
