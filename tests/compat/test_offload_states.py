"""DeepSpeed's engine.offload_states() / reload_states() on 2 gloo ranks: offloaded inside an
accumulation window (gradient shards held), training refused until the reload, then
bit-identical to the run that never offloaded. (On a CPU run the host is the device: the
moves keep their places; the GPU run measures what they free.)"""

from __future__ import annotations

import torch
from common import make_batches, make_model, optimizer_tensors, train_windows, two_param_groups
from harness import run_ranks

MICRO, GA, STEPS = 4, 2, 4


def build():
    import zero3

    model = make_model()
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GA, "gradient_clipping": 0.5,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 30}}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=config)
    return engine


def offload_run(rank: int, world: int) -> dict:
    from zero3.engine_parts.build import EngineUsageError
    from zero3.engine_parts.state_offload import StateOffloadError
    from zero3.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    reference = build()
    expected_losses = train_windows(reference, rank, world, 0, STEPS, GA, MICRO, STEPS)
    expected = optimizer_tensors(reference)

    engine = build()
    losses = train_windows(engine, rank, world, 0, 2, GA, MICRO, STEPS)
    losses.append(micro_step(engine, rank, world, 2, 0))  # inside the window: gradient shards held
    held = sum(sp.grad_shard is not None for sp in engine.table.values())
    engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params])
    partial = sorted(engine.state_offload.offloaded)
    engine.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=True, non_blocking=True)  # the rest
    everything = sorted(engine.state_offload.offloaded)
    try:
        micro_step(engine, rank, world, 2, 1)
        refused = "no error"
    except EngineUsageError as exc:
        refused = str(exc)
    engine.reload_states()
    losses.append(micro_step(engine, rank, world, 2, 1))
    losses += train_windows(engine, rank, world, 3, STEPS, GA, MICRO, STEPS)
    got = optimizer_tensors(engine)
    errors = []
    for kwargs in ({"include": ["weights"]}, {"device": "nvme"}):
        try:
            engine.offload_states(**kwargs)
            errors.append("no error")
        except StateOffloadError as exc:
            errors.append(str(exc))
    return {"expected_losses": expected_losses, "losses": losses, "partial": partial, "everything": everything,
            "refused": refused, "differ": [k for k in expected if not torch.equal(expected[k], got[k])],
            "errors": errors, "after_reload": sorted(engine.state_offload.offloaded), "held": held}


def micro_step(engine, rank: int, world: int, step: int, index: int) -> float:
    x, y = make_batches(STEPS * GA * world, MICRO)[(step * GA + index) * world + rank]
    loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.item()


def test_offload_states_round_trip_is_exact_and_training_waits_for_the_reload():
    for r in run_ranks(offload_run, 2):
        assert r["losses"] == r["expected_losses"] and r["differ"] == []
        assert r["partial"] == ["hp_params", "optim_states"]
        assert r["everything"] == ["contiguous_grad_buffer", "hp_params", "lp_grads", "lp_params", "optim_states"]
        assert "reload_states()" in r["refused"] and "optim_states" in r["refused"]
        assert "unknown state kinds ['weights']" in r["errors"][0] and "CPU only" in r["errors"][1]
        assert r["after_reload"] == [] and r["held"] > 0
