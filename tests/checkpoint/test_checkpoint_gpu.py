"""Checkpoints on CUDA (one GPU, in one process): skipped unless a GPU is used.

CI forces the CPU (ZERO3_ACCELERATOR=cpu), so these run only on a GPU machine:

    ZERO3_ACCELERATOR=cuda python -m pytest tests/checkpoint/test_checkpoint_gpu.py
    ZERO3_ACCELERATOR=cuda python tests/checkpoint/test_checkpoint_gpu.py     (without pytest)

What the CPU suite cannot show: the CUDA RNG state is saved and restored (dropout on the
GPU draws from it), shards living on the GPU and masters in pinned host memory are
written and read back exactly, and exports from GPU shards equal the offline export.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import config, make_batches, make_model, two_param_groups  # noqa: E402

GPU = torch.cuda.is_available() and os.environ.get("ZERO3_ACCELERATOR", "").lower() != "cpu"
pytestmark = pytest.mark.skipif(not GPU, reason="needs a GPU and ZERO3_ACCELERATOR other than cpu")
MICRO, GA = 2, 2


def engine_on_gpu(seed: int, dropout: float = 0.2, **top):
    import zero3

    model = make_model(seed=seed, dropout=dropout)
    optimizer = torch.optim.AdamW(two_param_groups(model))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    cfg = {**config(MICRO, GA, threshold=30), "checkpoint": {"load_rng_state": True}}  # dropout: RNG too
    cfg.update(top)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=cfg,
                                       dist_init_required=False)
    assert engine.device.type == "cuda"
    return engine


def train(engine, first: int, count: int) -> list[float]:
    dtype = engine.compute_dtype
    batches = make_batches((first + count) * GA, MICRO)
    losses = []
    for index in range(first * GA, (first + count) * GA):
        x, y = (t.to(engine.device, dtype) for t in batches[index])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    return losses


def test_exact_resume_on_cuda_restores_the_cuda_rng(tmp_path=None):
    from zero3.checkpoint.export import consolidated_state_dict

    tmp_path = Path(tmp_path or tempfile.mkdtemp())
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)
    straight = engine_on_gpu(seed=0)
    expected = train(straight, 0, 6)
    expected_state = consolidated_state_dict(straight)
    straight.destroy()
    torch.manual_seed(1)
    torch.cuda.manual_seed(1)
    first = engine_on_gpu(seed=0)
    losses = train(first, 0, 3)
    first.save_checkpoint(tmp_path)
    first.destroy()
    torch.cuda.manual_seed(12345)  # must be undone by the load
    second = engine_on_gpu(seed=4)
    second.load_checkpoint(tmp_path)
    losses += train(second, 3, 3)
    assert losses == expected
    state = consolidated_state_dict(second)
    for name, value in expected_state.items():
        assert torch.equal(state[name], value), name


def test_bf16_pinned_offload_round_trip_and_exports_on_cuda(tmp_path=None):
    from safetensors.torch import load_file

    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.checkpoint.offline_export import export_checkpoint

    tmp_path = Path(tmp_path or tempfile.mkdtemp())
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    source = engine_on_gpu(seed=0, dropout=0.0, bf16={"enabled": True})
    pinned = engine_on_gpu(seed=0, dropout=0.0, bf16={"enabled": True},
                           zero_optimization={**config(MICRO, GA, 30)["zero_optimization"], **offload})
    for engine in (source, pinned):
        train(engine, 0, 3)
    pinned.save_checkpoint(tmp_path / "pinned")
    source.save_checkpoint(tmp_path / "plain")
    source.save_16bit_model(tmp_path, "m16.safetensors")
    masters = [m.clone() for m in pinned.optimizer.masters]
    states = [{k: v.clone() for k, v in pinned.optimizer.optimizer.state[m].items()} for m in pinned.optimizer.masters]
    back = engine_on_gpu(seed=3, dropout=0.0, bf16={"enabled": True},
                         zero_optimization={**config(MICRO, GA, 30)["zero_optimization"], **offload})
    back.load_checkpoint(tmp_path / "pinned")
    for master, saved, saved_state in zip(back.optimizer.masters, masters, states):
        state = back.optimizer.optimizer.state[master]
        assert master.device.type == "cpu" and master.is_pinned() and torch.equal(master, saved)
        for key, value in saved_state.items():
            assert state[key].device == value.device and torch.equal(state[key], value), key
    # a GPU-resident checkpoint loads into the offloaded engine too: the same numbers
    across = engine_on_gpu(seed=3, dropout=0.0, bf16={"enabled": True},
                           zero_optimization={**config(MICRO, GA, 30)["zero_optimization"], **offload})
    across.load_checkpoint(tmp_path / "plain")
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(across.optimizer.masters, source.optimizer.masters))
    engine16 = load_file(tmp_path / "m16.safetensors")
    export_checkpoint(tmp_path / "plain" / "global_step3", tmp_path / "off16.safetensors", torch.bfloat16)
    offline = load_file(tmp_path / "off16.safetensors")
    live = consolidated_state_dict(source)
    assert engine16.keys() == offline.keys() == live.keys()
    for name in live:
        assert torch.equal(engine16[name], offline[name]) and torch.equal(offline[name], live[name]), name


if __name__ == "__main__":
    if not GPU:
        sys.exit("no GPU (or ZERO3_ACCELERATOR=cpu)")
    failed = 0
    for test in (test_exact_resume_on_cuda_restores_the_cuda_rng, test_bf16_pinned_offload_round_trip_and_exports_on_cuda):
        try:
            test()
            print(f"PASS {test.__name__}")
        except Exception as exc:  # noqa: BLE001 - reported
            import traceback

            traceback.print_exc()
            print(f"FAIL {test.__name__}: {exc}")
            failed += 1
    print("CHECKS_FAILED" if failed else "CHECKS_PASSED")
    sys.exit(1 if failed else 0)
