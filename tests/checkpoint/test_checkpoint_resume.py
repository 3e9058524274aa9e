"""Exact resume at world sizes 1, 2, 4, and resharding 1->2, 2->4, 4->2, 2->1.

Four spawned runs, in an order that makes each source checkpoint exist before it is
loaded: world 2 (saves), world 1 (saves, loads 2), world 4 (saves, loads 2), world 2
(loads 1 and 4). Each saving run also checks bit-exact resume at its own world size.

Resharding runs use a fixed *global* micro-batch of 4 samples split over the ranks, so
runs at different world sizes see the same data and should train alike (up to the
order of floating-point reductions), and threshold 0, so every parameter is sharded,
including the 5-element head bias that leaves rank 3 of 4 an empty slice.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from common import batch_index, config, make_batches, make_model, two_param_groups
from harness import run_ranks

GA, MICRO = 4, 2
GLOBAL_MICRO, RESHARD_GA, SAVED_AT, MORE = 4, 2, 2, 2


# ---------------------------------------------------------------- exact resume
def exact_resume(rank: int, world: int, folder: str, steps: int = 3) -> dict:
    """2N uninterrupted steps vs N + save + load (into other initial weights) + N."""
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    def build(seed: int):
        model = make_model(seed=seed, dropout=0.2)
        optimizer = torch.optim.AdamW(two_param_groups(model))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
        cfg = {**config(MICRO, GA, threshold=30), "checkpoint": {"load_rng_state": True}}  # dropout: RNG too
        engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg)
        return engine

    def train(engine, first: int, count: int, losses: list) -> None:
        batches = make_batches((first + count) * GA * world, MICRO)
        for step in range(first, first + count):
            for micro in range(GA):
                x, y = batches[batch_index(step, micro, rank, GA, world)]
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())

    torch.manual_seed(100 + rank)
    straight = build(seed=0)
    straight_losses: list = []
    train(straight, 0, 2 * steps, straight_losses)
    result = {"straight_losses": straight_losses, "straight_state": consolidated_state_dict(straight),
              "straight_optim": optimizer_state(straight), "straight_lr": straight.get_lr()}
    straight.destroy()

    torch.manual_seed(100 + rank)
    first = build(seed=0)
    losses: list = []
    train(first, 0, steps, losses)
    client = {"note": "half way", "step": steps, "ema": torch.full((3,), 0.5), "hist": [1.5, (2, "x")]}
    first.save_checkpoint(folder, client_state=client)
    first.destroy()
    torch.manual_seed(999)  # the RNG must come from the file
    second = build(seed=7)  # different initial weights: everything must come from the file
    _, loaded_client = second.load_checkpoint(folder)
    result["client_ok"] = (loaded_client.keys() == client.keys() and torch.equal(loaded_client["ema"], client["ema"])
                           and loaded_client["hist"] == client["hist"] and loaded_client["note"] == client["note"])
    result["counters"] = (second.global_steps, second.micro_steps)
    train(second, steps, steps, losses)
    result.update({"losses": losses, "state": consolidated_state_dict(second),
                   "optim": optimizer_state(second), "lr": second.get_lr()})
    return result


def optimizer_state(engine) -> dict:
    """name -> {key: whole unpadded value} for every trainable parameter (a collective)."""
    from zero3.checkpoint.export import full_fp32_param, full_optimizer_state

    out = {}
    for name, p in engine.module.named_parameters():
        if p.requires_grad:
            out[name] = {"master": full_fp32_param(engine, p)}
            for key in ("exp_avg", "exp_avg_sq", "step"):
                out[name][key] = full_optimizer_state(engine, p, key)
    return out


# ------------------------------------------------------------------ resharding
def reshard_batches(count: int):
    return make_batches(count, GLOBAL_MICRO, seed=11)


def reshard_engine(world: int, seed: int):
    import zero3

    model = make_model(seed=seed, dropout=0.0)
    optimizer = torch.optim.AdamW(two_param_groups(model))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                       config=config(GLOBAL_MICRO // world, RESHARD_GA, threshold=0))
    return engine


def reshard_train(engine, rank: int, world: int, first: int, count: int) -> list[float]:
    """Global losses (mean over ranks of the local ones: equal-size slices) per micro-step."""
    per = GLOBAL_MICRO // world
    batches = reshard_batches((first + count) * RESHARD_GA)
    losses = []
    for step in range(first, first + count):
        for micro in range(RESHARD_GA):
            x, y = batches[step * RESHARD_GA + micro]
            loss = engine(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
            engine.backward(loss)
            engine.step()
            losses.append(sum(engine.comm.gather_objects(loss.item())) / world)
    return losses


def gathered(engine) -> dict:
    """What must survive resharding exactly: weights, masters, optimizer state, counters, lr."""
    from zero3.checkpoint.export import consolidated_state_dict

    return {"params": consolidated_state_dict(engine), "optim": optimizer_state(engine),
            "counters": (engine.global_steps, engine.micro_steps, engine.skipped_steps),
            "sched": engine.lr_scheduler.state_dict(), "lr": engine.get_lr()}


def reshard_source(rank: int, world: int, folder: str) -> dict:
    engine = reshard_engine(world, seed=0)
    reshard_train(engine, rank, world, 0, SAVED_AT)
    engine.save_checkpoint(folder, tag="reshard")
    saved = gathered(engine)
    losses = reshard_train(engine, rank, world, SAVED_AT, MORE)
    return {"saved": saved, "losses": losses, "final": gathered(engine)["params"]}


def reshard_target(rank: int, world: int, folder: str) -> dict:
    engine = reshard_engine(world, seed=5)
    engine.load_checkpoint(folder, tag="reshard")
    loaded = gathered(engine)
    losses = reshard_train(engine, rank, world, SAVED_AT, MORE)
    return {"loaded": loaded, "losses": losses, "final": gathered(engine)["params"]}


def world_run(rank: int, world: int, root: str, exact: bool, load_from: list[int]) -> dict:
    root = Path(root)
    out: dict = {}
    if exact:
        out["exact"] = exact_resume(rank, world, str(root / f"exact{world}"))
        out["source"] = reshard_source(rank, world, str(root / f"src{world}"))
    for source in load_from:
        out[f"from{source}"] = reshard_target(rank, world, str(root / f"src{source}"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("resume"))
    return {
        2: run_ranks(world_run, 2, root, True, [], timeout=400),
        1: run_ranks(world_run, 1, root, True, [2], timeout=400),
        4: run_ranks(world_run, 4, root, True, [2], timeout=400),
        "2b": run_ranks(world_run, 2, root, False, [1, 4], timeout=400),
    }


def assert_same(a, b, where: str) -> None:
    """Exact, deep equality: tensors bit for bit, with dtype and shape."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max difference {(a.double() - b.double()).abs().max().item()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{index}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_resume_is_bit_exact_with_dropout_accumulation_and_schedule(runs, world):
    for rank, result in enumerate(runs[world]):
        r = result["exact"]
        assert r["counters"] == (3, 3 * GA) and r["client_ok"]
        assert r["losses"] == r["straight_losses"], f"rank {rank}"  # every micro-step, bit for bit
        assert r["lr"] == r["straight_lr"]
        assert_same(r["state"], r["straight_state"], f"rank {rank} params")
        assert_same(r["optim"], r["straight_optim"], f"rank {rank} optimizer")
    # dropout draws differ between ranks (their RNG states were restored per rank)
    if world > 1:
        assert runs[world][0]["exact"]["losses"] != runs[world][1]["exact"]["losses"]


PAIRS = [(1, 2, "2b"), (2, 4, 4), (4, 2, "2b"), (2, 1, 1)]


@pytest.mark.parametrize("source,target,run", PAIRS, ids=[f"{s}to{t}" for s, t, _ in PAIRS])
def test_reshard_loads_exactly_and_trains_like_the_source(runs, source, target, run):
    saved = runs[source][0]["source"]  # consolidated weights are on rank 0; the rest on every rank
    assert len(runs[run]) == target
    for rank, result in enumerate(runs[run]):
        got = result[f"from{source}"]
        for key in ("optim", "counters", "sched", "lr"):
            assert_same(got["loaded"][key], saved["saved"][key], f"{source}->{target} rank {rank} {key}")
        assert len(got["losses"]) == MORE * RESHARD_GA
        for a, b in zip(got["losses"], saved["losses"]):
            assert math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7), (got["losses"], saved["losses"])
    got = runs[run][0][f"from{source}"]
    assert_same(got["loaded"]["params"], saved["saved"]["params"], f"{source}->{target} params")
    assert saved["final"].keys() == got["final"].keys()
    for name, value in saved["final"].items():
        torch.testing.assert_close(got["final"][name], value, rtol=1e-5, atol=1e-6, msg=name)
