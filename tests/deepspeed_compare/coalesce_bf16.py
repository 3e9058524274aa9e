#!/usr/bin/env python
"""coalesce_grad_reduction() in bf16 under DeepSpeed 0.19.8 (not collected by pytest).

The setup of tests/compat/test_deepspeed_contract.py::test_coalesced_reduction_keeps_bf16_precision
(4 layers of 64, reduce bucket 8192 elements, four bf16 backwards, one SGD step at lr 0.5,
gradient_accumulation_steps 1 with the boundary set on the last backward), run by DeepSpeed:
reduced after every backward, under one coalesced reduction, and after every backward with
fp32 communication. Prints the largest differences of the full gradients and of the fp32
weights after the step, pairwise.

    DS_ACCELERATOR=cpu OMP_NUM_THREADS=1 VENV/bin/python -m torch.distributed.run --standalone \\
        --nproc_per_node=2 tests/deepspeed_compare/coalesce_bf16.py
"""

import contextlib
import json
import sys
from pathlib import Path

import deepspeed
import torch
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import make_batches, make_model  # noqa: E402

MICRO = 2


def one_run(kind: str, rank: int, world: int) -> tuple[dict, dict]:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 8192},
              "bf16": {"enabled": True}, "zero_allow_untested_optimizer": True}
    if kind == "reference":
        config["communication_data_type"] = "fp32"
    model = make_model(inputs=64, width=64, depth=4, outputs=64, freeze_block=None)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5), config=config)
    chunks = make_batches(4 * world, MICRO, seed=7, inputs=64, outputs=64)
    with engine.coalesce_grad_reduction() if kind == "coalesced" else contextlib.nullcontext():
        for i in range(4):
            x, y = chunks[i * world + rank]
            if kind != "coalesced":
                engine.set_gradient_accumulation_boundary(i == 3)
            engine.backward(engine(x.bfloat16(), y.bfloat16()))
    grads = {n: safe_get_full_grad(p).float().clone() for n, p in model.named_parameters()}
    engine.step()
    return grads, {n: safe_get_full_fp32_param(p).clone() for n, p in model.named_parameters()}


def main() -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    runs = {kind: one_run(kind, rank, world) for kind in ("uncoalesced", "coalesced", "reference")}

    def largest(a: str, b: str, which: int) -> float:
        return max((runs[a][which][n] - runs[b][which][n]).abs().max().item() for n in runs[a][which])

    out = {f"{a} vs {b} ({kind})": largest(a, b, which)
           for a, b in (("coalesced", "uncoalesced"), ("coalesced", "reference"), ("uncoalesced", "reference"))
           for which, kind in ((0, "gradients"), (1, "fp32 weights after one step"))}
    if rank == 0:
        print("DeepSpeed", deepspeed.__version__, json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
