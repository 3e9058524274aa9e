"""Host updates started in the window's last backward (optim/early_update.py): with them on,
training is bit-identical to the overlapped host step without them, whether the early
updates stand (no clipping) or are put back (clipping below 1, a learning rate changed
between the last backward and step(), zero_grad() instead of step(), a step skipped for an
overflow); a bound of 0 bytes turns them off. A bf16 model, so that the fp32 masters are not the parameter shards (a
sub-group whose master is its shard is never updated early). One launch of 2 ranks runs every
variant."""

from __future__ import annotations

import torch
from common import make_batches, make_model, optimizer_tensors, two_param_groups
from harness import run_ranks

MICRO, GA, STEPS = 4, 2, 4


def build(early_bytes: int | None, clipping: float):
    import zero3

    zero = {"stage": 3, "stage3_param_persistence_threshold": 30, "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu", "overlap_step": True}}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
              "gradient_clipping": clipping, "zero_optimization": zero, "bf16": {"enabled": True}}
    if early_bytes is not None:  # None: the default bound
        config["placement"] = {"early_update_bytes": early_bytes}
    model = make_model()
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=config)
    return engine


def train(engine, rank: int, world: int, before_step=None) -> list[float]:
    """STEPS windows of GA micro-steps; `before_step(engine, step)` runs between the window's
    last backward and its step(), after the worker has run what that backward gave it."""
    batches = make_batches(STEPS * GA * world, MICRO)
    losses = []
    for step in range(STEPS):
        for index in range(GA):
            x, y = batches[(step * GA + index) * world + rank]
            loss = engine(x.bfloat16(), y.bfloat16())
            engine.backward(loss)
            if index == GA - 1:
                # The early updates submitted in that backward run to their end first, so that
                # the counts below do not depend on the threads' timing (results never do).
                engine.optimizer.background.wait()
                if before_step is not None:
                    before_step(engine, step)
            engine.step()
            losses.append(loss.item())
    return losses


def halve_lr(engine, step: int) -> None:
    if step == 1:
        for group in engine.optimizer.optimizer.param_groups:
            group["lr"] *= 0.5


def drop_window(engine, step: int) -> None:
    if step == 2:  # this window's gradients dropped: its step() is a no-op of the optimizer
        engine.zero_grad()


def variant(rank: int, world: int, early: int | None, clipping: float, hook) -> dict:
    engine = build(early, clipping)
    losses = train(engine, rank, world, hook)
    final = optimizer_tensors(engine)
    updates = engine.optimizer.early
    return {"losses": losses, "final": final, "committed": updates.committed, "put_back": updates.put_back,
            "enabled": updates.enabled, "skipped": engine.skipped_steps}


def overflow(engine, step: int) -> None:
    if step == 1:  # an inf in a gradient: bf16 checks for overflow and skips this step
        next(sp for sp in engine.optimizer.params if sp.grad_shard is not None).grad_shard[0] = float("inf")


VARIANTS = {  # name: (early_update_bytes, clipping, hook)
    "off": (0, 0.0, None), "on": (None, 0.0, None), "tiny_bound": (1, 0.0, None),
    "clipped_off": (0, 1e-3, None), "clipped_on": (None, 1e-3, None),
    "lr_off": (0, 0.0, halve_lr), "lr_on": (None, 0.0, halve_lr),
    "zero_grad_off": (0, 0.0, drop_window), "zero_grad_on": (None, 0.0, drop_window),
    "overflow_off": (0, 0.0, overflow), "overflow_on": (None, 0.0, overflow),
}


def all_variants(rank: int, world: int) -> dict:
    return {name: variant(rank, world, *args) for name, args in VARIANTS.items()}


def same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and a["final"].keys() == b["final"].keys() and all(
        torch.equal(a["final"][k], b["final"][k]) for k in a["final"])


def test_early_host_updates_are_bit_exact_whether_they_stand_or_are_put_back():
    for r in run_ranks(all_variants, 2, timeout=400):
        assert not r["off"]["enabled"] and r["on"]["enabled"]
        # No clipping: every early update stands, and the run is the one without them.
        assert r["on"]["committed"] > 0 and r["on"]["put_back"] == 0, (r["on"]["committed"], r["on"]["put_back"])
        assert same(r["on"], r["off"])
        # A bound smaller than any sub-group: none starts early.
        assert r["tiny_bound"]["committed"] == r["tiny_bound"]["put_back"] == 0 and same(r["tiny_bound"], r["off"])
        # Clipping below 1 at every step: every early update is put back, the result unchanged.
        assert r["clipped_on"]["put_back"] > 0 and r["clipped_on"]["committed"] == 0
        assert same(r["clipped_on"], r["clipped_off"]) and not same(r["clipped_off"], r["off"])
        # A learning rate changed after the last backward: that window's early updates are put back.
        assert r["lr_on"]["put_back"] > 0 and r["lr_on"]["committed"] > 0
        assert same(r["lr_on"], r["lr_off"]) and not same(r["lr_off"], r["off"])
        # zero_grad() instead of the step: the window's early updates are put back.
        assert r["zero_grad_on"]["put_back"] > 0 and same(r["zero_grad_on"], r["zero_grad_off"])
        # A step skipped for an overflow: its early updates are put back.
        assert r["overflow_on"]["put_back"] > 0 and same(r["overflow_on"], r["overflow_off"])
        assert r["overflow_off"]["skipped"] == 1 and not same(r["overflow_off"], r["off"])
