"""zero3.initialize taking over a model built under DeepSpeed's own zero.Init (issue 37, point 4).

Run in a venv with DeepSpeed 0.19.8 and transformers installed, zero3 on PYTHONPATH:

    DS_ACCELERATOR=cpu ZERO3_ACCELERATOR=cpu OMP_NUM_THREADS=1 PYTHONPATH=. \\
        DSVENV/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        tests/deepspeed_compare/adopt_zero_init.py [--mode hf|init]

On 2 gloo CPU ranks: a small Llama is built under DeepSpeed's zero.Init (`--mode hf`:
transformers' `from_config` while an `HfDeepSpeedConfig` is alive, as a DeepSpeed script
does; `--mode init`: `with deepspeed.zero.Init(...)` around the model's constructor), its
full values are taken through DeepSpeed's GatheredParameters, then the model goes to
zero3.initialize with a client torch AdamW built on its (empty) parameters beforehand. The
checks: every adopted parameter equals DeepSpeed's gathered values exactly, nothing of
DeepSpeed is left on parameters or modules, and STEPS training steps give the losses and
final weights of plain single-process PyTorch on the same global batches. Rank 0 prints one
JSON line with the results.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging

import torch
import torch.nn.functional as F

STEPS = 4
MICRO = 2
SEQ = 16
LR = 1e-3
CHUNK_NUMEL = 20_000


def llama_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       tie_word_embeddings=False)


def ds_config() -> dict:
    """The DeepSpeed config the model is built under (fp32; memory_efficient_linear left at
    DeepSpeed's default, so zero.Init replaces torch.nn.functional.linear)."""
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 3}}


def build_under_deepspeed(mode: str):
    """The model partitioned by DeepSpeed's zero.Init, and the HfDeepSpeedConfig kept alive (or None)."""
    import deepspeed
    from transformers import AutoModelForCausalLM, LlamaForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    torch.manual_seed(0)
    if mode == "hf":
        keep = HfDeepSpeedConfig(ds_config())
        return AutoModelForCausalLM.from_config(llama_config()), keep
    with deepspeed.zero.Init(config_dict_or_path=ds_config()):
        model = LlamaForCausalLM(llama_config())
    return model, None


def batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 128, (MICRO, SEQ), generator=g) for _ in range(STEPS * world)]


def reference(values: dict[str, torch.Tensor], world: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """Plain PyTorch from DeepSpeed's gathered values on the global batches: losses[step][rank]."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config())
    model.load_state_dict(values, strict=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    data, losses = batches(world), []
    for step in range(STEPS):
        row = []
        for rank in range(world):
            ids = data[step * world + rank]
            loss = model(input_ids=ids, labels=ids).loss
            (loss / world).backward()
            row.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(row)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def leftovers(model: torch.nn.Module) -> list[str]:
    """What DeepSpeed put on parameters or modules that is still there."""
    found = [f"{n}: {k}" for n, p in model.named_parameters() for k in vars(p) if "ds_" in k or k in ("all_gather",
                                                                                                       "partition")]
    found += [f"module {n}: {k}" for n, m in model.named_modules() for k in vars(m)
              if k in ("_external_params", "ds_external_parameters", "all_parameters", "ds_id")]
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=("hf", "init"), default="hf")
    args = parser.parse_args()
    import deepspeed

    logging.getLogger("zero3").setLevel(logging.INFO)  # the adoption's note
    logging.getLogger("zero3").addHandler(logging.StreamHandler())

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, keep = build_under_deepspeed(args.mode)
    out: dict = {"mode": args.mode, "world": world, "deepspeed": deepspeed.__version__}
    params = dict(model.named_parameters())
    out["built_partitioned"] = sum(tuple(p.shape) == (0,) and hasattr(p, "ds_shape") for p in params.values())
    out["parameters"] = len(params)
    out["linear_after_build"] = F.linear.__module__
    with deepspeed.zero.GatheredParameters(list(params.values())):
        ds_values = {n: p.detach().clone() for n, p in params.items()}
    del keep
    gc.collect()
    out.update(run_zero3(model, ds_values, rank, world))
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def run_zero3(model, ds_values: dict[str, torch.Tensor], rank: int, world: int) -> dict:
    """Adopt, compare the adopted values, train, compare with the reference."""
    import zero3
    from zero3.engine_parts import deepspeed_adopt
    from zero3.runtime.zero.partition_parameters import ZeroParamStatus

    deepspeed_adopt.CHUNK_NUMEL = CHUNK_NUMEL  # several gathers on this small model

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)  # on the empty parameters
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    out: dict = {"leftovers": leftovers(model), "linear_after_initialize": F.linear.__module__}
    out["status_is_zero3s"] = all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
    named = dict(model.named_parameters())
    with zero3.GatheredParameters(list(named.values())):
        diffs = {n: (p.detach() - ds_values[n]).abs().max().item() for n, p in named.items()}
        shapes_ok = all(tuple(p.shape) == tuple(ds_values[n].shape) for n, p in named.items())
    out["adopted_equal"] = f"{sum(d == 0 for d in diffs.values())} of {len(diffs)}, max diff {max(diffs.values())}"
    out["shapes_ok"] = shapes_ok
    data, losses = batches(world), []
    for step in range(STEPS):
        ids = data[step * world + rank]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    every = [None] * world
    torch.distributed.all_gather_object(every, losses)
    expected, final = reference(ds_values, world)
    got = [[every[r][s] for r in range(world)] for s in range(STEPS)]
    out["losses_zero3"], out["losses_reference"] = got, expected
    out["max_loss_diff"] = max(abs(a - b) for g, e in zip(got, expected) for a, b in zip(g, e))
    with zero3.GatheredParameters(list(named.values())):
        out["max_weight_diff_after_training"] = max((p.detach() - final[n]).abs().max().item()
                                                    for n, p in named.items())
    engine.destroy()
    return out


if __name__ == "__main__":
    main()
