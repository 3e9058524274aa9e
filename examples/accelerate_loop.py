"""An Accelerate custom loop with a DeepSpeed ZeRO-3 config, on zero3 by one import.

The loop is Accelerate's own idiom: `prepare`, `accumulate`, `backward`, `clip_grad_norm_`,
`optimizer.step()` / `scheduler.step()` / `zero_grad()`, `save_state` / `load_state` with
`skip_first_batches`, `get_state_dict`, `save_model`, `free_memory`. A small Llama with
random weights and dropout (so an exact resume needs the saved RNG) learns generated token
sequences. With `--engine deepspeed` the same loop runs on `accelerate.Accelerator` with
DeepSpeed installed (DeepSpeed's numbers for the same loop).

    torchrun --standalone --nproc_per_node=2 examples/accelerate_loop.py --dir DIR
    (the yaml route: zero3 launch --config_file ds_zero3.yaml examples/accelerate_loop.py --dir DIR)

It trains `--steps` optimizer steps, saving the state after `--save-at` of them, then trains
the rest again from that save in a new Accelerator and compares the losses bit for bit.
tests/hf/test_accelerator.py runs these functions.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch

MICRO, ACCUMULATION, SEQ, VOCAB = 2, 2, 16, 96

DS_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": True},
    "bf16": {"enabled": "auto"}, "steps_per_print": float("inf"),
}


def build_model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attention_dropout=0.1, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def dataset(count: int) -> list[dict[str, torch.Tensor]]:
    """Sequences of a learnable pattern: each token is the previous plus a per-sequence step."""
    g = torch.Generator().manual_seed(11)
    rows = []
    for _ in range(count):
        start, step = torch.randint(0, VOCAB, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
        ids = (start + step * torch.arange(SEQ)) % VOCAB
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def make_accelerator(engine: str, mixed_precision: str, accelerate_cpu: bool | None = None) -> Any:
    """accelerate_cpu (default: on a machine without CUDA) is Accelerator(cpu=...): with it,
    Accelerate forms its multi-process CPU setup and shards the loaders; without it on a CPU
    machine its state is one process (how Accelerate 1.16 runs DeepSpeed's CPU accelerator:
    every rank reads every batch) while the engine still spans the ranks."""
    cpu = (not torch.cuda.is_available()) if accelerate_cpu is None else accelerate_cpu
    if engine == "deepspeed":
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DeepSpeedPlugin

        if AcceleratorState._shared_state:  # a second Accelerator shares the first one's plugin
            return Accelerator(gradient_accumulation_steps=ACCUMULATION)
        if cpu and not torch.cuda.is_available():
            raise SystemExit("Accelerate runs DeepSpeed only without cpu=True; pass --no-accelerate-cpu")

        plugin = DeepSpeedPlugin(hf_ds_config=json.loads(json.dumps(DS_CONFIG)))
        return Accelerator(deepspeed_plugin=plugin, gradient_accumulation_steps=ACCUMULATION,
                           mixed_precision=mixed_precision)  # on a CPU machine DeepSpeed runs on its CPU accelerator
    from zero3.hf import Accelerator

    if engine == "zero3_launched":  # the DeepSpeed settings from `zero3 launch --config_file ds.yaml`
        return Accelerator(gradient_accumulation_steps=ACCUMULATION, mixed_precision=mixed_precision, cpu=cpu)
    # cpu=True: Accelerate forms its multi-process CPU setup (gloo) only when told to run on the CPU
    return Accelerator(zero3_config=json.loads(json.dumps(DS_CONFIG)), gradient_accumulation_steps=ACCUMULATION,
                       mixed_precision=mixed_precision, cpu=cpu)


def train(engine: str, folder: str, steps: int, first: int, resume_from: str | None = None,
          save_at: int | None = None, mixed_precision: str = "no", accelerate_cpu: bool | None = None) -> dict[str, Any]:
    """Optimizer steps `first`..`steps` of the loop (from the state in `resume_from` when
    given), saving the state into `folder/state` after `save_at` steps. Returns the losses
    of every micro-batch, the learning rates, the clipped norms and what the Accelerator
    reported about skipped steps."""
    from transformers import get_linear_schedule_with_warmup

    accelerator = make_accelerator(engine, mixed_precision, accelerate_cpu)
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    loader = torch.utils.data.DataLoader(dataset(steps * ACCUMULATION * MICRO * accelerator.num_processes),
                                         batch_size=MICRO, shuffle=True, generator=torch.Generator().manual_seed(5))
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=steps * 4)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    if resume_from is not None:
        loader = accelerator.skip_first_batches(loader, first * ACCUMULATION)
    batches = iter(loader)  # starting an epoch draws from the global RNG: before the state it resumes
    if resume_from is not None:
        accelerator.load_state(resume_from)
    out: dict[str, Any] = {"losses": [], "lrs": [], "norms": [], "skipped": []}
    model.train()
    done = first
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                out["norms"].append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        out["losses"].append(loss.item())
        if accelerator.sync_gradients:
            done += 1
            out["lrs"].append(scheduler.get_last_lr()[0])
            out["skipped"].append(accelerator.optimizer_step_was_skipped)
            if save_at is not None and done == save_at:
                accelerator.save_state(str(Path(folder) / "state"))
        if done == steps:
            break
    state = accelerator.get_state_dict(model)
    out["state"] = None if state is None else {k: v.float().clone() for k, v in state.items()}
    out["unwrapped"] = type(accelerator.unwrap_model(model)).__name__
    accelerator.save_model(model, str(Path(folder) / "model"))
    accelerator.free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--engine", default="zero3", choices=["zero3", "zero3_launched", "deepspeed"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=3)
    parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    parser.add_argument("--no-accelerate-cpu", dest="accelerate_cpu", action="store_false", default=None,
                        help="Accelerator(cpu=False) on a CPU machine (see make_accelerator)")
    parser.add_argument("--out", default=None, help="write the losses as JSON here (rank 0)")
    args = parser.parse_args()
    common = {"mixed_precision": args.mixed_precision, "accelerate_cpu": args.accelerate_cpu}
    straight = train(args.engine, args.dir, args.steps, 0, save_at=args.save_at, **common)
    resumed = train(args.engine, args.dir, args.steps, args.save_at, resume_from=str(Path(args.dir) / "state"),
                    **common)
    tail = straight["losses"][args.save_at * ACCUMULATION:]
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"losses {['%.6f' % x for x in straight['losses']]}")
        print(f"after the resume {'the same' if resumed['losses'] == tail else 'DIFFERENT'}: "
              f"{['%.6f' % x for x in resumed['losses']]}")
        if args.out:
            Path(args.out).write_text(json.dumps({k: straight[k] for k in ("losses", "lrs", "norms")}))


if __name__ == "__main__":
    main()
