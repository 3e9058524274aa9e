"""Parameters that get no gradient are skipped by the optimizer step, as in plain PyTorch.

A module skipped on some steps (the same on every rank) leaves its parameters' `.grad`
None in plain PyTorch, and torch optimizers then leave them alone: no momentum, no
weight decay, Adam's moments and `step` untouched. zero3 must do the same, whether the
skipped parameters have their own fetch unit (`fc2`) or sit inside a leaf unit whose
other parameters are used (`block.b`: leaf gradients are reduced with zeros from the
ranks that did not use them). A parameter used on some ranks only keeps the averaged
gradient, zeros from the other ranks included (`block.b` used on rank 0 only), as DDP.

Every scenario runs on 2 and 4 gloo ranks against single-process PyTorch on the same
global batch, at 1e-5; each launch runs all scenarios, one fresh engine each.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from common import batch_index, make_batches
from harness import run_ranks
from torch import nn

STEPS, MICRO = 4, 2


class Gate(nn.Module):
    """A leaf unit: `a` always runs, `b` only when asked."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = h + torch.tanh(self.a(h))
        return h + torch.tanh(self.b(h)) if use_b else h


class Skipper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = nn.Linear(8, 8)
        self.block = Gate()
        self.head = nn.Linear(8, 3)

    def forward(self, x, y, use_fc2: bool, use_b: bool):
        h = torch.tanh(self.fc1(x))
        if use_fc2:
            h = torch.tanh(self.fc2(h))
        return F.mse_loss(self.head(self.block(h, use_b)), y)


def make_skipper() -> Skipper:
    torch.manual_seed(0)
    return Skipper()


def batches(count: int):
    return make_batches(count, MICRO, inputs=6, outputs=3)


def uses(pattern: str, step: int, micro: int, rank: int, ga: int) -> tuple[bool, bool]:
    """(fc2 used, block.b used) on this rank in this micro-step."""
    odd = step % 2 == 1  # unused on step 0: no optimizer state exists yet at the first save
    if pattern == "alternate":
        return odd, odd
    if pattern == "window":  # used in the last micro-step of odd windows only
        used = odd and micro == ga - 1
        return used, used
    if pattern == "one_rank":  # block.b on rank 0 only, every step
        return odd, rank == 0
    raise ValueError(pattern)


def make_optimizer(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.05)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def zero3_config(sc: dict) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 8,  # biases resident, weights sharded
            "leaf_module": {"names": ["block"]},
            "stage3_prefetch_bucket_size": 50_000_000 if sc["prefetch"] else 0, **sc.get("zero", {})}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": sc["ga"],
            "gradient_clipping": sc.get("clip", 0.0), "zero_optimization": zero}


SCENARIOS = [
    {"name": "sgd", "opt": "sgd", "ga": 1, "prefetch": True, "pattern": "alternate"},
    {"name": "adamw_clip_resume", "opt": "adamw", "ga": 1, "prefetch": False, "pattern": "alternate",
     "clip": 0.05, "resume_after": (0, 0)},
    {"name": "adamw_window_resume_mid_window", "opt": "adamw", "ga": 2, "prefetch": True, "pattern": "window",
     "resume_after": (2, 0)},
    {"name": "sgd_window", "opt": "sgd", "ga": 2, "prefetch": False, "pattern": "window"},
    {"name": "adamw_one_rank", "opt": "adamw", "ga": 1, "prefetch": True, "pattern": "one_rank"},
    # the two resumed runs above, uninterrupted: a resume must be bit-exact
    {"name": "adamw_clip", "opt": "adamw", "ga": 1, "prefetch": False, "pattern": "alternate", "clip": 0.05},
    {"name": "adamw_window", "opt": "adamw", "ga": 2, "prefetch": True, "pattern": "window"},
    {"name": "adamw_host_step", "opt": "adamw", "ga": 1, "prefetch": True, "pattern": "alternate",
     "zero": {"offload_optimizer": {"device": "cpu", "overlap_step": True}, "offload_param": {"device": "cpu"}}},
    {"name": "sgd_offload_optimizer", "opt": "sgd", "ga": 2, "prefetch": True, "pattern": "window",
     "zero": {"offload_optimizer": {"device": "cpu"}}},
]


def state_key(kind: str) -> str:
    return "momentum_buffer" if kind == "sgd" else "step"


def reference(sc: dict, world: int) -> dict:
    """Plain PyTorch, one process, the same global batches."""
    model = make_skipper()
    optimizer = make_optimizer(sc["opt"], model.parameters())
    ga = sc["ga"]
    data = batches(STEPS * ga * world)
    losses = {}
    for step in range(STEPS):
        for micro in range(ga):
            for rank in range(world):
                x, y = data[batch_index(step, micro, rank, ga, world)]
                loss = model(x, y, *uses(sc["pattern"], step, micro, rank, ga))
                (loss / (ga * world)).backward()
                losses[(step, micro, rank)] = loss.item()
        if sc.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), sc["clip"])
        optimizer.step()
        optimizer.zero_grad()
    key = state_key(sc["opt"])
    states = {n: _plain(optimizer.state.get(p, {}).get(key)) for n, p in model.named_parameters()}
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "states": states}


def _plain(value):
    return None if value is None else value.detach().clone().float()


def run_scenario(rank: int, world: int, sc: dict, folder: str) -> dict:
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict, full_optimizer_state

    def build():
        model = make_skipper()
        engine, _, _, _ = zero3.initialize(model=model, optimizer=make_optimizer(sc["opt"], model.parameters()),
                                           config=zero3_config(sc))
        return engine

    engine = build()
    ga = sc["ga"]
    data = batches(STEPS * ga * world)
    losses, step_all_reduces = {}, []
    for step in range(STEPS):
        for micro in range(ga):
            x, y = data[batch_index(step, micro, rank, ga, world)]
            loss = engine(x, y, *uses(sc["pattern"], step, micro, rank, ga))
            engine.backward(loss)
            before = engine.comm_stats().get("all_reduce", (0, 0))
            engine.step()
            after = engine.comm_stats().get("all_reduce", (0, 0))
            if micro == ga - 1:
                step_all_reduces.append((after[0] - before[0], after[1] - before[1]))
            losses[(step, micro, rank)] = loss.item()
            if (step, micro) == sc.get("resume_after"):
                engine.save_checkpoint(folder, tag=sc["name"])
                engine.destroy()
                engine = build()
                engine.load_checkpoint(folder, tag=sc["name"])
    key = state_key(sc["opt"])
    states = {n: _plain(full_optimizer_state(engine, p, key)) for n, p in engine.module.named_parameters()}
    params = consolidated_state_dict(engine)
    engine.destroy()
    return {"losses": losses, "params": params, "states": states, "step_all_reduces": step_all_reduces}


def run_all(rank: int, world: int, folder: str) -> list[dict]:
    return [run_scenario(rank, world, sc, folder) for sc in SCENARIOS]


@pytest.mark.parametrize("world", [2, 4])
def test_unused_parameters_are_skipped_as_in_plain_pytorch(world, tmp_path):
    results = run_ranks(run_all, world, str(tmp_path), timeout=300)
    for index, sc in enumerate(SCENARIOS):
        ref = reference(sc, world)
        for rank_results in results:
            got = rank_results[index]
            for key, value in got["losses"].items():
                assert math.isclose(value, ref["losses"][key], rel_tol=1e-5, abs_tol=1e-7), (
                    sc["name"], key, value, ref["losses"][key])
            for name, ref_state in ref["states"].items():
                state = got["states"][name]
                assert (state is None) == (ref_state is None), (sc["name"], name, state, ref_state)
                if ref_state is not None:
                    torch.testing.assert_close(state.reshape(ref_state.shape), ref_state, rtol=1e-5, atol=1e-6,
                                               msg=f"{sc['name']}: {name}")
            # the cost: no extra collective; the gradient-norm all-reduce (one float64) carries
            # one more float64 per trainable parameter of the leaf unit (block.a, block.b: 4)
            assert got["step_all_reduces"] == [(1, 8 * (1 + 4))] * STEPS, (sc["name"], got["step_all_reduces"])
        params = results[0][index]["params"]
        for name, ref_param in ref["params"].items():
            torch.testing.assert_close(params[name], ref_param, rtol=1e-5, atol=1e-6, msg=f"{sc['name']}: {name}")
    by_name = {sc["name"]: index for index, sc in enumerate(SCENARIOS)}
    for resumed, plain in (("adamw_clip_resume", "adamw_clip"), ("adamw_window_resume_mid_window", "adamw_window")):
        for rank_results in results:
            a, b = rank_results[by_name[resumed]], rank_results[by_name[plain]]
            assert a["losses"] == b["losses"], resumed
        a, b = results[0][by_name[resumed]]["params"], results[0][by_name[plain]]["params"]
        assert all(torch.equal(a[name], b[name]) for name in b), resumed
    # the skips happened: fc2 and block.b were stepped on half of the steps only
    sgd_steps = reference(SCENARIOS[1], world)["states"]
    assert int(sgd_steps["fc2.weight"]) == STEPS // 2 and int(sgd_steps["fc1.weight"]) == STEPS
    assert int(sgd_steps["block.b.weight"]) == STEPS // 2
