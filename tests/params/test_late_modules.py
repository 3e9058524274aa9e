"""Modules attached after zero3.initialize work as in plain PyTorch with an optimizer built
before the attach: forward and backward exact, their parameters whole on every rank and
never stepped (a trainable one accumulates this rank's `.grad`), a one-time warning on
rank 0 naming them, and checkpoints that save and restore their values.

Reference: single-process PyTorch on the same global batch, its optimizer built before
the attach, at 1e-5, on 2 and 4 gloo ranks (one launch each for every check).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from common import make_batches
from harness import run_ranks
from torch import nn

STEPS, MICRO = 5, 2
HEAD_AT, ADAPTER_AT, SAVE_AFTER = 1, 2, 2  # steps before which the modules are attached; the save


class Trunk(nn.Module):
    """Sharded trunk; `head` (frozen) and `adapter` (trainable) come after initialize."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 8)
        self.head = None
        self.adapter = None

    def forward(self, x, y):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        if self.adapter is not None:
            h = h + torch.tanh(self.adapter(h))
        out = self.head(h) if self.head is not None else h[:, :3]
        return F.mse_loss(out, y)


def make_trunk() -> Trunk:
    torch.manual_seed(0)
    return Trunk()


def make_head(seed: int = 7) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 3).requires_grad_(False)


def make_adapter(seed: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Linear(8, 8)


def attach(model: Trunk, step: int, seed_offset: int = 0) -> None:
    if step == HEAD_AT:
        model.head = make_head(7 + seed_offset)
    if step == ADAPTER_AT:
        model.adapter = make_adapter(8 + seed_offset)


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def data(world: int):
    return make_batches(STEPS * world, MICRO, inputs=6, outputs=3)


def reference(world: int) -> dict:
    model = make_trunk()
    optimizer = optimizer_for(model)
    batches = data(world)
    losses, adapter_grad = {}, None
    for step in range(STEPS):
        attach(model, step)
        for rank in range(world):
            x, y = batches[step * world + rank]
            loss = model(x, y)
            (loss / world).backward()
            losses[(step, rank)] = loss.item()
        if step == SAVE_AFTER:
            adapter_grad = model.adapter.weight.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "adapter_grad": adapter_grad}


def late_worker(rank: int, world: int, folder: str) -> dict:
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.params.late_params import LateParameterWarning

    def build():
        model = make_trunk()
        engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer_for(model), config={
            "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
        return engine

    engine = build()
    managed = len(engine.table)
    batches = data(world)
    losses, out = {}, {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.save_checkpoint(folder, tag="before_attach")
        for step in range(STEPS):
            attach(engine.module, step)
            x, y = batches[step * world + rank]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses[(step, rank)] = loss.item()
            if step == SAVE_AFTER:
                out["adapter_grad"] = engine.module.adapter.weight.grad.clone()
                out["late_whole"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                                        for p in (*engine.module.head.parameters(), *engine.module.adapter.parameters()))
                out["late_managed"] = len(engine.table) - managed
                engine.save_checkpoint(folder, tag="with_late")
                engine.destroy()
                engine = build()
                attach(engine.module, HEAD_AT, seed_offset=100)  # other values: the load must restore them
                attach(engine.module, ADAPTER_AT, seed_offset=100)
                engine.load_checkpoint(folder, tag="with_late")
        out["params"] = consolidated_state_dict(engine)
        # a checkpoint saved before the attach leaves the late modules as they are
        head_before = engine.module.head.weight.detach().clone()
        engine.load_checkpoint(folder, tag="before_attach", load_optimizer_states=False)
        out["head_kept"] = torch.equal(engine.module.head.weight, head_before)
        # a checkpoint holding late parameters loads into a model without them
        fresh = build()
        fresh.load_checkpoint(folder, tag="with_late")
        out["fresh_loss"] = fresh(*batches[rank]).item()
    out["losses"] = losses
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, LateParameterWarning)]
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_modules_attached_after_initialize_train_as_plain_pytorch(world, tmp_path):
    ref = reference(world)
    results = run_ranks(late_worker, world, str(tmp_path), timeout=240)
    for rank, got in enumerate(results):
        for key, value in got["losses"].items():
            assert math.isclose(value, ref["losses"][key], rel_tol=1e-5, abs_tol=1e-7), (key, value, ref["losses"][key])
        assert got["late_whole"] and got["late_managed"] == 0 and got["head_kept"]
        assert math.isfinite(got["fresh_loss"])
        messages = got["warnings"]
        if rank == 0:
            attached = [m for m in messages if "attached to the model after zero3.initialize" in m]
            assert len(attached) == 3, messages  # head, adapter; both at once in the resumed engine
            assert "head.weight (3, 8) (frozen), head.bias (3,) (frozen)" in attached[0], attached[0]
            assert "adapter.weight (8, 8), adapter.bias (8,)" in attached[1], attached[1]
            assert "head.bias (3,) (frozen), adapter.weight (8, 8)" in attached[2], attached[2]
            assert "attach the module before zero3.initialize" in attached[0]
            loads = [m for m in messages if "load_checkpoint" in m]
            assert len(loads) == 2, messages
            assert "left as they are: ['head.weight (3, 8)'" in loads[0], loads[0]
            assert "were skipped: ['head.weight', 'head.bias', 'adapter.weight', 'adapter.bias']" in loads[1], loads[1]
        else:
            assert messages == [], messages
    # a trainable late parameter accumulates this rank's gradient (not averaged, as DDP for a
    # parameter it was built without): their mean over ranks is plain PyTorch's
    mean_grad = sum(got["adapter_grad"] for got in results) / world
    torch.testing.assert_close(mean_grad, ref["adapter_grad"], rtol=1e-5, atol=1e-6)
    params = results[0]["params"]
    assert set(params) == set(ref["params"])
    for name, value in ref["params"].items():
        torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=name)
    # never stepped: the late modules keep the values they were attached with
    torch.testing.assert_close(params["head.weight"], make_head().weight.detach())
    torch.testing.assert_close(params["adapter.weight"], make_adapter().weight.detach())
