#!/usr/bin/env python
"""DeepSpeed's own bf16 master-weight example under zero3, with its two imports changed (not
collected by pytest).

DeepSpeedExamples' `training/bf16_master_weight/train.py` trains a small transformer with a
config from `configs/` (`bf16_full.json`: bf16 with bf16_master_weights_and_grads,
bf16_optimizer_states and torch_autocast; `baseline.json`: bf16 with fp32 masters). This
script reads that file from a DeepSpeedExamples checkout, changes exactly two lines

    import deepspeed                                  -> import zero3 as deepspeed
    from deepspeed.accelerator import get_accelerator -> from zero3.accelerator import get_accelerator

and runs it on the CPU: the example's CUDA-only calls (torch.cuda.set_device, manual_seed_all,
the memory statistics) are made no-ops when no GPU is present, it is shrunk by its own flags,
and it trains on its own synthetic tokens (its default without --use_real_data). The copy goes
to a temporary folder; nothing of the example is kept in this repository.

    OMP_NUM_THREADS=1 ZERO3_ACCELERATOR=cpu PYTHONPATH=. .venv/bin/python \\
        tests/deepspeed_compare/bf16_master_weight_example.py --examples /path/to/DeepSpeedExamples \\
        --world 2 --configs bf16_full,baseline

Prints, per config, the example's step lines and its SUMMARY line, then the losses side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLE = Path("training/bf16_master_weight")
IMPORTS = {
    "import deepspeed\n": "import zero3 as deepspeed\n",
    "from deepspeed.accelerator import get_accelerator\n": "from zero3.accelerator import get_accelerator\n",
}
SHRUNK = ["--hidden_dim", "64", "--num_layers", "2", "--num_heads", "4", "--vocab_size", "512",
          "--batch_size", "4", "--seq_length", "32", "--warmup_steps", "2", "--log_interval", "1"]

SHIMS = '''"""Runs the changed example with CUDA-only calls made no-ops when no GPU is present."""
import runpy, sys, torch
if not torch.cuda.is_available():
    for name in ("set_device", "manual_seed_all", "reset_peak_memory_stats"):
        setattr(torch.cuda, name, lambda *a, **k: None)
    for name in ("max_memory_allocated", "memory_allocated", "memory_reserved"):
        setattr(torch.cuda, name, lambda *a, **k: 0)
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
'''


def changed_example(examples: Path, into: Path) -> Path:
    """The example's train.py with the two imports changed, written into `into`."""
    text = (examples / EXAMPLE / "train.py").read_text()
    for old, new in IMPORTS.items():
        if text.count(old) != 1:
            raise SystemExit(f"{examples / EXAMPLE / 'train.py'}: expected the line {old.strip()!r} once")
        text = text.replace(old, new)
    target = into / "train.py"
    target.write_text(text)
    (into / "cpu_shims.py").write_text(SHIMS)
    return target


def run(examples: Path, config: str, world: int, steps: int, into: Path) -> tuple[list[float], str]:
    """The example under zero3 on `world` CPU ranks: (losses of rank 0, its output)."""
    script = changed_example(examples, into)
    env = {**os.environ, "ZERO3_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
               str(into / "cpu_shims.py"), str(script),
               "--deepspeed_config", str(examples / EXAMPLE / "configs" / f"{config}.json"),
               "--num_steps", str(steps), *SHRUNK]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise SystemExit(f"{config}: the example failed (exit {done.returncode}):\n{output[-4000:]}")
    losses = [float(m.group(1)) for m in re.finditer(r"\[Rank 0\] Step \d+: loss=([0-9.]+)", output)]
    return losses, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", default=os.environ.get("DEEPSPEED_EXAMPLES"), required=False,
                        help="a DeepSpeedExamples checkout (or $DEEPSPEED_EXAMPLES)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--configs", default="bf16_full,baseline")
    args = parser.parse_args()
    if not args.examples:
        raise SystemExit("give --examples PATH (a DeepSpeedExamples checkout) or set DEEPSPEED_EXAMPLES")
    results = {}
    for config in args.configs.split(","):
        with tempfile.TemporaryDirectory() as folder:
            losses, output = run(Path(args.examples), config, args.world, args.steps, Path(folder))
        print(f"== {config}")
        print("\n".join(line for line in output.splitlines() if "[Rank 0] Step" in line or "SUMMARY" in line))
        results[config] = losses
    names = list(results)
    print("\n| step | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for step in range(max(len(v) for v in results.values())):
        print(f"| {step} | " + " | ".join(f"{results[n][step]:.4f}" if step < len(results[n]) else "-"
                                           for n in names) + " |")


if __name__ == "__main__":
    main()
