#!/usr/bin/env python
"""`zero3 checkpoint export-deepspeed` of a run trained with the config's AdamW, loaded and stepped by DeepSpeed 0.19.8.

Not collected by pytest; DeepSpeed runs only in its own venv. Three cases, each a 2-rank
gloo run of a 3-layer MLP with two param groups (weights with weight_decay 0.1; biases with
lr 5e-3 and no decay) under a config with `optimizer: AdamW` and `sub_group_size` 1000:

  fused     the config's AdamW: DeepSpeed builds FusedAdam (on the CPU accelerator its C++ op)
  cpu-adam  the same with offload_optimizer cpu: DeepSpeed builds DeepSpeedCPUAdam
  torch     the same with params.torch_adam: DeepSpeed builds torch.optim.AdamW

Steps (WORK is a scratch folder):

  # zero3's venv: train 3 steps under zero3, save, and export with no flag but --world-size
  PYTHONPATH=. ZERO3_ACCELERATOR=cpu OMP_NUM_THREADS=1 .venv/bin/python \\
      tests/deepspeed_compare/export_config_adam.py zero3 WORK CASE
  # DeepSpeed's venv: load the export, compare masters and moments with zero3's files, step once
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 DSVENV/bin/python \\
      tests/deepspeed_compare/export_config_adam.py deepspeed WORK CASE

The deepspeed step prints one JSON line: the optimizer DeepSpeed built, its param group
keys, the type of each sub-group's step, how many masters / exp_avg / exp_avg_sq equal
zero3's bit for bit (and the largest difference), and the loss and parameter change of the
step after the load. Results: RESULTS.md.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
sys.path.insert(0, str(TESTS))

import torch  # noqa: E402

CASES = ("fused", "cpu-adam", "torch")
WORLD, STEPS, BATCH = 2, 3, 4
STATE_KEYS = ("exp_avg", "exp_avg_sq")


def config(case: str) -> dict:
    """The DeepSpeed config both engines are built from."""
    params = {"lr": 1e-2, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
    zero = {"stage": 3, "sub_group_size": 1000}
    if case == "cpu-adam":
        zero["offload_optimizer"] = {"device": "cpu"}
    if case == "torch":
        params["torch_adam"] = True
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": params}, "zero_optimization": zero,
            "steps_per_print": 10_000}


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                               torch.nn.Tanh(), torch.nn.Linear(64, 8))


def param_groups(model: torch.nn.Module) -> list[dict]:
    """Weights (3 DeepSpeed sub-groups at sub_group_size 1000 on 2 ranks) and biases (1)."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0, "lr": 5e-3}]


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 32, generator=g), torch.randn(BATCH, 8, generator=g)


def train_step(engine, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    loss = torch.nn.functional.mse_loss(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


# ------------------------------------------------------------------ zero3 side
def zero3_worker(rank: int, world: int, save_dir: str, case: str) -> list[float]:
    import zero3

    model = build_model()
    engine, _, _, _ = zero3.initialize(model=model, model_parameters=param_groups(model), config=config(case))
    losses = [train_step(engine, rank, step) for step in range(STEPS)]
    engine.save_checkpoint(save_dir)
    return losses + [train_step(engine, rank, STEPS)]  # zero3's own next step, for DeepSpeed's to match


def run_zero3(work: Path, case: str) -> None:
    from harness import run_ranks

    source, exported = work / case / "zero3", work / case / "exported"
    losses = run_ranks(zero3_worker, WORLD, str(source), case, timeout=600)
    command = [sys.executable, "-m", "zero3.cli", "checkpoint", "export-deepspeed", str(source), str(exported),
               "--world-size", str(WORLD)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    result = {"case": case, "zero3_losses": losses, "export": done.stdout.strip(),
              "export_error": done.stderr.strip()[-2000:], "rc": done.returncode}
    (work / case / "zero3_run.json").write_text(json.dumps(result))
    print(json.dumps(result))


# ------------------------------------------------------------------ DeepSpeed side
def deepspeed_worker(rank: int, world: int, exported: str, case: str) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    model = build_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=param_groups(model), config=config(case))
    path, _ = engine.load_checkpoint(exported)
    loaded = {}
    for name, param in engine.module.named_parameters():
        loaded[f"fp32/{name}"] = safe_get_full_fp32_param(param).clone()
        for key in STATE_KEYS:
            loaded[f"{key}/{name}"] = safe_get_full_optimizer_state(param, key).clone()
    inner = engine.optimizer.optimizer  # the torch-style optimizer DeepSpeed's ZeRO-3 steps per sub-group
    steps = [inner.state[flat]["step"] for flat in engine.optimizer.fp32_partitioned_groups_flat]
    info = {"loaded": path is not None, "optimizer": type(inner).__name__,
            "group_keys": [sorted(k for k in g if k != "params") for g in inner.param_groups],
            "sub_groups": len(engine.optimizer.fp32_partitioned_groups_flat),
            "steps": [[type(s).__name__, float(s)] for s in steps]}
    before = {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}
    try:
        info["loss_after_load"] = train_step(engine, rank, STEPS)
        after = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
        info["max_update"] = max(float((after[n] - before[n]).abs().max()) for n in before)
        info["steps_after"] = [float(engine.optimizer.optimizer.state[f]["step"])
                               for f in engine.optimizer.fp32_partitioned_groups_flat]
    except Exception as exc:  # noqa: BLE001 - reported
        info["step_error"] = f"{type(exc).__name__}: {exc}"
    return {"info": info, "tensors": loaded if rank == 0 else None}


def zero3_saved(source: Path) -> dict[str, torch.Tensor]:
    """zero3's fp32 masters and moments, whole, from the checkpoint's safetensors files."""
    from safetensors import safe_open

    folder = source / (source / "latest").read_text().strip()
    manifest = json.loads((folder / "manifest.json").read_text())
    world = manifest["world_size"]
    handles = [safe_open(str(folder / f"rank{r:05d}-of-{world:05d}.safetensors"), framework="pt")
               for r in range(world)]

    def whole(key: str, shape: list[int]) -> torch.Tensor:
        return torch.cat([h.get_tensor(key) for h in handles if key in h.keys()]).reshape(shape)

    out = {}
    for name, entry in manifest["params"].items():
        out[f"fp32/{name}"] = whole(f"{'master' if entry['master'] else 'param'}/{name}", entry["shape"])
        for key in STATE_KEYS:
            out[f"{key}/{name}"] = whole(f"optim/{name}/{key}", entry["shape"])
    return out


def run_deepspeed(work: Path, case: str) -> None:
    import deepspeed
    from harness import run_ranks

    results = run_ranks(deepspeed_worker, WORLD, str(work / case / "exported"), case, timeout=900,
                        env={"DS_ACCELERATOR": "cpu"})
    theirs, ours = results[0]["tensors"], zero3_saved(work / case / "zero3")
    equal = sorted(k for k in ours if k in theirs and torch.equal(ours[k].float(), theirs[k].float()))
    diff = max(float((ours[k].float() - theirs[k].float()).abs().max()) for k in ours if k in theirs)
    zero3_next = [losses[STEPS] for losses in json.loads((work / case / "zero3_run.json").read_text())["zero3_losses"]]
    deepspeed_next = [r["info"].get("loss_after_load") for r in results]
    print(json.dumps({"case": case, "deepspeed": deepspeed.__version__, "torch": torch.__version__,
                      "compared": len(ours), "equal": len(equal), "max_abs_diff": diff,
                      "next_loss_zero3": zero3_next, "next_loss_deepspeed": deepspeed_next,
                      "ranks": [r["info"] for r in results]}))


if __name__ == "__main__":
    side, work_dir, which = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    assert which in CASES, f"case {which!r}: one of {CASES}"
    (run_zero3 if side == "zero3" else run_deepspeed)(work_dir, which)
