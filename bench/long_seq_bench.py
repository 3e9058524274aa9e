#!/usr/bin/env python
"""One long sequence a step on one GPU: the longest that trains, and its speed.

    torchrun --standalone --nproc_per_node=1 bench/long_seq_bench.py --engine zero3 \
        --seqs 32768,65536 --rows rows.jsonl
    python3 bench/long_seq_bench.py --table rows.jsonl

Engines (one process each; lengths in increasing order in that process, stopping at the
first that runs out of memory, which is recorded):
- `zero3`: what the README's long-sequence section tells a user to write: the model built
  under `zero3.Init`, both offloads with the automatic budget, the bf16 keys (bf16 masters and
  optimizer state), the config's AdamW, and the `long_sequence` section (tiled MLP, tiled
  loss, hidden states on the host); no call in the script besides initialize;
- `zero3_lora`: the same with PEFT LoRA (r 16 on every projection), the base frozen;
- `plain`: plain Hugging Face, a bf16 model's forward and backward with HF gradient
  checkpointing and its own loss, no optimizer (its out-of-memory length is the point);
- `deepspeed`: DeepSpeed 0.19.8 with its ALST pieces called as its docs show: TiledMLP
  patched into LlamaMLP.forward, TiledFusedLogitsLoss for the loss (1 GiB of fp32 logits a
  tile), HF gradient checkpointing (non-reentrant) with the checkpointed hidden states on the
  host through its `get_checkpoint_hidden_states_offloading_ctx_manager` around forward and
  backward, both offloads, the same bf16 keys and AdamW (DeepSpeedCPUAdam, built at first use).

Model: the Llama-3-8B shape (hidden 4096, 32 layers, FF 14336, 32 heads, 8 KV heads, vocab
128256; 8.03B parameters) or smaller with the flags; random weights, random tokens, batch 1,
sdpa attention. A row per length: engine, seq, step_s (the median of the measured steps, or
the single step), tokens_per_s, tflops (6 x parameters x tokens plus causal attention,
6 x layers x seq^2 x hidden, both over the step), peak_gib (GPU, max allocated), host_gib
(the process's peak resident set), loss, or error.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

GIB = 1 << 30
ROOT = os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="zero3", choices=["zero3", "zero3_lora", "plain", "deepspeed"])
    p.add_argument("--seqs", default="32768,65536")
    p.add_argument("--steps", type=int, default=2, help="steps per length; the first is a warm-up when > 1")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rows", default=None)
    p.add_argument("--deepspeed-params", default="cpu", choices=["cpu", "gpu"],
                   help="deepspeed: offload_param to the host (the zero3 config's) or its parameter shards on the "
                        "card (16 GB of bf16 at 8B: its host footprint, fp32 gradients and CPU Adam, outgrows a 128 GiB host otherwise)")
    p.add_argument("--trace", action="store_true",
                   help="zero3's placement log and each step's GPU peak after forward and backward, and what stays after the step")
    p.add_argument("--table", default=None, help="print the table of a rows file and exit")
    return p.parse_args()


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
                       intermediate_size=args.intermediate, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, max_position_embeddings=1 << 21, rope_theta=500000.0,
                       tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")


def zero3_config(lora: bool) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0, "steps_per_print": None,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5 if not lora else 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True}},
            "long_sequence": {"tiled_mlp": True, "tiled_loss": True, "offload_hidden_states": True}}


def lora_wrap(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))


def batch(args, seq: int, step: int) -> dict:
    gen = torch.Generator().manual_seed(step)
    ids = torch.randint(0, args.vocab, (1, seq), generator=gen).cuda()
    return {"input_ids": ids, "labels": ids, "position_ids": torch.arange(seq, device="cuda")[None]}


def zero3_engine(args, lora: bool):
    import zero3
    from transformers import LlamaForCausalLM

    config = zero3_config(lora)
    with zero3.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(llama_config(args))
    if lora:
        model = lora_wrap(model)
    engine, *_ = zero3.initialize(model=model, config=config)

    def step(inputs):
        loss = engine(**inputs).loss
        forward_peak = torch.cuda.max_memory_allocated()
        engine.backward(loss)
        backward_peak = torch.cuda.max_memory_allocated()  # the placement resets the peak at each step
        engine.step()
        if args.trace:
            print(f"    GPU GiB: peak after forward {forward_peak / GIB:.2f}, after backward {backward_peak / GIB:.2f}; "
                  f"held after the step {torch.cuda.memory_allocated() / GIB:.2f}", flush=True)
        return loss

    return step, sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())


def plain_engine(args):
    from transformers import LlamaForCausalLM

    with torch.device("cuda"):
        model = LlamaForCausalLM(llama_config(args)).to(torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def step(inputs):
        loss = model(**inputs).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss

    return step, sum(p.numel() for p in model.parameters())


def deepspeed_engine(args):
    import math

    import deepspeed
    from deepspeed.runtime.activation_checkpointing.offload_activations import (
        get_checkpoint_hidden_states_offloading_ctx_manager)
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    def tiled_mlp_forward(self, x):  # DeepSpeed's documented patch
        shards = math.ceil(x.shape[-2] / x.shape[-1])
        params = [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight]
        return TiledMLP.apply(lambda mod, t: mod.down_proj(mod.act_fn(mod.gate_proj(t)) * mod.up_proj(t)),
                              self, x, shards, params)

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward
    config = zero3_config(False)
    del config["long_sequence"]
    if args.deepspeed_params == "gpu":
        del config["zero_optimization"]["offload_param"]
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = LlamaForCausalLM(llama_config(args))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.train()

    def loss_fn(head, x, y):
        return torch.nn.functional.cross_entropy(head(x).float(), y, ignore_index=-100, reduction="sum")

    def step(inputs):
        with get_checkpoint_hidden_states_offloading_ctx_manager():  # the hidden states on the host
            hidden = engine.module.model(input_ids=inputs["input_ids"],
                                         position_ids=inputs["position_ids"]).last_hidden_state
            labels = torch.nn.functional.pad(inputs["labels"], (0, 1), value=-100)[..., 1:]
            shards = max(1, math.ceil(labels.numel() * args.vocab * 4 / (1 << 30)))
            total = TiledFusedLogitsLoss.apply(loss_fn, engine.module.lm_head, hidden, labels, None, shards,
                                               [engine.module.lm_head.weight], "sum")
            loss = total / (labels != -100).sum()
            engine.backward(loss)
        engine.step()
        return loss

    return step, sum(p.ds_numel for p in model.parameters())


def host_gib(field: str = "VmHWM") -> float:
    """This process's host memory from /proc/self/status: VmHWM the peak, VmRSS now."""
    try:
        line = next(x for x in open("/proc/self/status").read().splitlines() if x.startswith(field + ":"))
    except (OSError, StopIteration):
        return float("nan")
    return int(line.split()[1]) / (1 << 20)


def model_flops(args, params: int, seq: int, trainable_share: float) -> float:
    dense = 6 * (params - args.vocab * args.width) * seq  # the embedding table is a lookup
    attention = 6 * args.layers * seq * seq * args.width  # causal: half of 4 * seq^2 * hidden, forward and backward
    if trainable_share < 1:  # LoRA: no weight gradients for the frozen base (2/3 of the dense backward)
        dense = dense * (1 + 1 + trainable_share) / 3
    return dense + attention


def run(args) -> None:
    engines = {"zero3": lambda: zero3_engine(args, False), "zero3_lora": lambda: zero3_engine(args, True),
               "plain": lambda: plain_engine(args), "deepspeed": lambda: deepspeed_engine(args)}
    if args.trace:
        import logging

        logging.basicConfig(level=logging.WARNING, format="    %(name)s: %(message)s")
        logging.getLogger("zero3").setLevel(logging.INFO)
    start = time.perf_counter()
    step, params = engines[args.engine]()
    print(f"{args.engine}: built {params / 1e9:.2f}B parameters in {time.perf_counter() - start:.0f} s", flush=True)
    share = 1.0 if args.engine != "zero3_lora" else 0.0
    for seq in (int(s) for s in args.seqs.split(",")):
        row = {"engine": args.engine, "seq": seq, "params": params, "gpu": torch.cuda.get_device_name()}
        if args.engine == "deepspeed":
            row["offload_param"] = args.deepspeed_params == "cpu"
        try:
            times = []
            for i in range(args.steps):
                torch.cuda.synchronize()
                began = time.perf_counter()
                loss = step(batch(args, seq, i))
                torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
                print(f"  seq {seq} step {i}: {times[-1]:.1f} s, loss {loss.item():.4f}, "
                      f"host {host_gib('VmRSS'):.1f} GiB (peak {host_gib():.1f})", flush=True)
            step_s = statistics.median(times[1:] if len(times) > 1 else times)
            row.update(step_s=round(step_s, 3), tokens_per_s=round(seq / step_s, 1),
                       tflops=round(model_flops(args, params, seq, share) / step_s / 1e12, 1),
                       loss=round(loss.item(), 4), all_steps_s=[round(t, 2) for t in times])
        except torch.OutOfMemoryError as exc:
            row["error"] = "out of memory: " + str(exc).split("\n")[0][:160]
        row.update(peak_gib=round(torch.cuda.max_memory_allocated() / (1 << 30), 2), host_gib=round(host_gib(), 2))
        print(json.dumps(row), flush=True)
        if args.rows:
            with open(args.rows, "a") as handle:
                handle.write(json.dumps(row) + "\n")
        if "error" in row:
            break
        torch.cuda.reset_peak_memory_stats()


def table(path: str) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    print(f"{'engine':<12}{'seq':>9}{'step s':>9}{'tok/s':>9}{'TFLOPS':>8}{'peak GiB':>10}{'host GiB':>10}  note")
    for r in rows:
        note = r.get("error", f"loss {r.get('loss')}")
        print(f"{r['engine']:<12}{r['seq']:>9}{r.get('step_s', float('nan')):>9}{r.get('tokens_per_s', float('nan')):>9}"
              f"{r.get('tflops', float('nan')):>8}{r['peak_gib']:>10}{r['host_gib']:>10}  {note}")


if __name__ == "__main__":
    arguments = parse()
    if arguments.table:
        table(arguments.table)
    else:
        run(arguments)
