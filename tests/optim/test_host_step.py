"""The CPU optimizer update run behind the next forward (optim/host_step.py), sub_group_size,
fused clipping and overlap_comm: every variant trains bit-identically to the plain
synchronous step, and checkpoints taken while an update may be in flight resume exactly."""

from __future__ import annotations

import pytest
import torch
from common import make_batches, make_model, optimizer_tensors, train_windows, two_param_groups
from harness import run_ranks

MICRO = 4
GA = 2
STEPS = 4


def build(zero_extra: dict, offload_extra: dict | None = None, clipping: float = 0.5, seed: int = 0):
    import zero3

    model = make_model(seed=seed)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 30,
            "offload_param": {"device": "cpu"},
            "offload_optimizer": {"device": "cpu", **(offload_extra or {})}, **zero_extra}
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA,
              "gradient_clipping": clipping, "zero_optimization": zero,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.02,
                                                          "warmup_num_steps": 3}}}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                  config=config)
    return engine


def train(engine, rank: int, world: int, first: int, last: int) -> list[float]:
    return train_windows(engine, rank, world, first, last, GA, MICRO, STEPS)


def masters(engine) -> dict[str, torch.Tensor]:
    return optimizer_tensors(engine)


def variant_run(rank: int, world: int, zero_extra: dict, offload_extra: dict, folder: str):
    engine = build(zero_extra, offload_extra)
    overlapped = engine.optimizer.unit_order is not None
    losses = train(engine, rank, world, 0, 2)
    in_flight = engine.optimizer.background.busy  # the last step() returned with the update running
    engine.save_checkpoint(folder, tag="half")
    losses += train(engine, rank, world, 2, STEPS)
    groups = engine.optimizer.sub_groups()
    sizes = [sum(engine.optimizer.masters[i].numel() for i in g) for g in groups]
    first_group_resident = all(engine.optimizer.params[i].persistent for i in groups[0])
    final = masters(engine)
    resumed = build(zero_extra, offload_extra, seed=5)
    resumed.load_checkpoint(folder, tag="half")
    resumed_losses = train(resumed, rank, world, 2, STEPS)
    return {"overlapped": overlapped, "in_flight": in_flight, "losses": losses, "final": final,
            "resumed_losses": resumed_losses, "resumed": masters(resumed), "sizes": sizes,
            "first_group_resident": first_group_resident, "lr": engine.get_lr(), "resumed_lr": resumed.get_lr()}


def variants_run(rank: int, world: int, variants: dict, folder: str):
    """All variants in one process group (one spawn per rank for the whole test)."""
    return {name: variant_run(rank, world, zero_extra, offload_extra, f"{folder}/{name}")
            for name, (zero_extra, offload_extra) in variants.items()}


@pytest.mark.parametrize("world", [1, 2])
def test_overlapped_host_step_is_bit_exact(tmp_path, world):
    """overlap_step on, off, with small sub-groups, and overlap_comm off: the same losses,
    masters, optimizer state and shards, bit for bit; resume from a checkpoint saved right
    after a step() that returned with the update still running is exact."""
    variants = {
        "sync": ({}, {"overlap_step": False}),
        "overlap": ({}, {"overlap_step": True}),
        "overlap_small_groups": ({"sub_group_size": 200}, {"overlap_step": True}),
        "sync_small_groups_no_overlap_comm": ({"sub_group_size": 200, "overlap_comm": False},
                                              {"overlap_step": False}),
    }
    per_rank = run_ranks(variants_run, world, variants, str(tmp_path))
    results = {name: [ranks[name] for ranks in per_rank] for name in variants}
    for rank in range(world):
        base = results["sync"][rank]
        assert not base["overlapped"] and not base["in_flight"]
        for name, per_rank in results.items():
            got = per_rank[rank]
            assert got["overlapped"] == name.startswith("overlap"), name
            if got["overlapped"]:
                assert got["in_flight"], "step() waited for the update it should leave running"
                assert got["first_group_resident"], "resident parameters' sub-group must run first"
            assert got["losses"] == base["losses"], name
            assert got["lr"] == base["lr"], name
            for key, value in base["final"].items():
                assert torch.equal(got["final"][key], value), (name, key)
            assert got["resumed_losses"] == got["losses"][2 * GA:], name
            assert got["lr"] == got["resumed_lr"], name
            for key, value in got["final"].items():
                assert torch.equal(got["resumed"][key], value), (name, key, "after resume")
        largest_param = max(v.numel() for k, v in base["final"].items() if "/" not in k)
        assert len(results["sync"][rank]["sizes"]) == 1  # one optimizer call without sub-groups
        assert len(results["overlap"][rank]["sizes"]) > 1  # one per unit at least
        small = results["sync_small_groups_no_overlap_comm"][rank]["sizes"]
        assert len(small) > 1 and max(small) <= max(200, largest_param), small
        small = results["overlap_small_groups"][rank]["sizes"]
        assert len(small) >= len(results["overlap"][rank]["sizes"]) and max(small) <= max(200, largest_param)


def failing_update(rank: int, world: int):
    from zero3.optim.host_step import HostStepError

    engine = build({}, {"overlap_step": True})
    x, y = make_batches(1, MICRO)[0]
    for _ in range(GA):
        engine.backward(engine(x, y))
        engine.step()
    engine.optimizer.wait()
    # A corrupted optimizer state: the next update fails on the worker thread.
    master = engine.optimizer.masters[0]
    engine.optimizer.optimizer.state[master]["exp_avg"] = torch.zeros(master.numel(), dtype=torch.float64)
    engine.backward(engine(x, y))
    engine.step()
    engine.backward(engine(x, y))
    messages = []
    # The boundary: the update starts on the worker and fails; the error surfaces at the
    # first wait (the step's own re-gather of resident parameters, or the next forward),
    # and again at every later one: the engine stays unusable.
    for call in (engine.step, lambda: engine(x, y), lambda: engine(x, y)):
        try:
            call()
        except HostStepError as exc:
            messages.append(str(exc))
    return messages


def test_failed_background_update_is_raised_on_the_next_forward():
    [messages] = run_ranks(failing_update, 1)
    assert len(messages) >= 2, messages
    assert "optimizer step running on the CPU" in messages[0] and "load the last checkpoint" in messages[0]


def bad_overlap_setting(rank: int, world: int, zero_extra: dict, offload_extra: dict):
    import zero3

    model = make_model()
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", **offload_extra}, **zero_extra}
    try:
        zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()),
                         config={"train_micro_batch_size_per_gpu": MICRO, "zero_optimization": zero})
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def overlap_settings(rank: int, world: int, cases: list[tuple[dict, dict]]) -> list[str]:
    return [bad_overlap_setting(rank, world, zero_extra, offload_extra) for zero_extra, offload_extra in cases]


def test_overlap_step_errors():
    host = {"offload_param": {"device": "cpu"}}
    [[params_on_device, bad_value, auto_on_cpu]] = run_ranks(
        overlap_settings, 1, [({}, {"overlap_step": True}), (host, {"overlap_step": "sometimes"}), (host, {})])
    # Parameter shards on the device, optimizer side on the host: the host update writes
    # the device shards back from the worker (optim/masters.py: _upload on a GPU).
    assert params_on_device == "no error", params_on_device
    assert "ConfigError" in bad_value and "overlap_step" in bad_value and "sometimes" in bad_value, bad_value
    assert auto_on_cpu == "no error"


def fp16_overflow_run(rank: int, world: int, overlap: bool):
    import zero3

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0,
              "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30,
                                    "offload_param": {"device": "cpu"},
                                    "offload_optimizer": {"device": "cpu", "overlap_step": overlap}}}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=config)
    batches = make_batches(6 * world, MICRO)
    losses, scales, skipped = [], [], []
    for step in range(6):
        x, y = batches[step * world + rank]
        loss = engine(x.half(), y.half())
        if step == 3 and rank == world - 1:
            loss = loss * float("inf")  # one rank overflows: every rank skips that step
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
        scales.append(engine.loss_scale)
        skipped.append(engine.skipped_steps)
    return losses, scales, skipped, masters(engine)


def fp16_overflow_both(rank: int, world: int):
    return {overlap: fp16_overflow_run(rank, world, overlap) for overlap in (False, True)}


def test_overlapped_host_step_under_fp16_overflow():
    """fp16 loss scaling with the update behind the forward: the overflowing step is
    skipped on every rank and the run matches the synchronous one bit for bit."""
    per_rank = run_ranks(fp16_overflow_both, 2)
    sync = [runs[False] for runs in per_rank]
    overlapped = [runs[True] for runs in per_rank]
    for (losses, scales, skipped, final), (losses_o, scales_o, skipped_o, final_o) in zip(sync, overlapped):
        assert skipped == skipped_o == [0, 0, 0, 1, 1, 1]
        assert scales == scales_o and losses[:3] == losses_o[:3] and losses[4:] == losses_o[4:]
        for key, value in final.items():
            assert torch.equal(final_o[key], value), key
