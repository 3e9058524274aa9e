#!/usr/bin/env python
"""Offload under a GPU memory budget against the GPU-resident run, world size 1, one process.

    torchrun --standalone --nproc_per_node=1 bench/placement_bench.py --layers 26 --width 3072 \
        --intermediate 8192 --heads 24 --seq 2048 --cases auto:2 --rows rows.jsonl
    python3 bench/placement_bench.py --table rows.jsonl

Run one case per process (bench/placement_gpu.sh does): a destroyed engine's GPU memory is
not all returned while the process lives, so a case run after another sees less free memory.

A case is `kind:micro_batch`:
- `resident`: zero3 with nothing offloaded (every piece on the GPU);
- `auto`: zero3 with offload_param and offload_optimizer on the CPU and the budget left to
  zero3 (placement "auto": the first accumulation window under a provisional budget, half the
  card, and measured; then the plan made from that measurement, widened once after the second);
- `budget=<GiB>`: both offloads under that budget;
- `ds_offload`, `ds_ratio=<r>`, `ds_super`: DeepSpeed 0.19.8 with both offloads and its CPU Adam
  (the config's AdamW), with offload_optimizer.ratio r (its Twin-Flow partial offload), or
  with super_offload; `ds_opt_offload`, `ds_opt_ratio=<r>`, `ds_opt_super`: the same with only
  the optimizer offloaded (DeepSpeed's ZeRO-Offload: its CPU Adam, the bf16 parameters on the card);
- `plain_bf16`: plain PyTorch, a bf16 model with fused AdamW (the ceiling, half the bytes);
- `plain_autocast`: plain PyTorch, an fp32 model under bf16 autocast with fused AdamW (zero3's
  arithmetic);
- `plain_bf16_fwdbwd`: plain PyTorch, a bf16 model's forward and backward alone, no optimizer
  (the card's ceiling for a model whose training state does not fit it: the arithmetic any
  engine must do, with nothing moved and nothing stepped).
A zero3 or plain kind with `+compile` (`auto+compile:4`, `plain_bf16+compile:2`) runs compiled:
zero3's `engine.compile()` (each fetch unit's forward), plain PyTorch's `model.compile()`; the
warm-up steps take the compilation.
Every case builds a Llama (transformers' LlamaForCausalLM, random weights) on the GPU from the
same seed, trains on the same random tokens (decoder layers as zero3 leaf units, the config's
AdamW), `--ga N` accumulates N micro-batches per optimizer step (a step's time covers all N),
and reports the median step, tokens/s, model TFLOPS (6 * params * tokens), the peak
of allocated GPU memory after the warm-up steps, the host's resident memory, zero3's placement
line with its predicted peak (the plan's bytes and the measured reserve) beside the measured
peak, and the first losses (so that the runs can be compared: the GPU and CPU AdamW kernels
round differently).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=26)
    p.add_argument("--width", type=int, default=3072)
    p.add_argument("--intermediate", type=int, default=8192)
    p.add_argument("--heads", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ga", type=int, default=1, help="gradient accumulation: micro-steps per optimizer step")
    p.add_argument("--cases", default="resident:2,auto:2,auto:4")
    p.add_argument("--cap-gib", type=float, default=None, help="torch.cuda.set_per_process_memory_fraction")
    p.add_argument("--rows", default=None, help="append each case's result to this JSON-lines file")
    p.add_argument("--table", default=None, help="only print the table of a --rows file and exit")
    return p.parse_args()


def build_llama(args) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
                      intermediate_size=args.intermediate, num_attention_heads=args.heads,
                      max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(1234)
    with torch.device("cuda"):
        return LlamaForCausalLM(cfg)


def tokens_for(args, micro: int, step: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(step)
    return torch.randint(0, args.vocab, (micro, args.seq + 1), generator=gen).cuda()


def loss_of(model, tokens) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _rss_now_gib() -> float:
    """The process's resident set now (Linux; NaN elsewhere)."""
    try:
        line = next(x for x in open("/proc/self/status").read().splitlines() if x.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return float("nan")
    return int(line.split()[1]) / (1 << 20)


def zero3_case(args, kind: str, micro: int):
    import zero3
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = build_llama(args)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}, "steps_per_print": None,
              "zero_optimization": zero, "gradient_accumulation_steps": args.ga}
    if kind.removesuffix("+compile") != "resident":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if kind.startswith("budget="):
        config["placement"] = {"gpu_budget": int(float(kind.removesuffix("+compile").split("=")[1]) * (1 << 30))}
    model = _Wrapped(model)
    zero3.set_z3_leaf_modules(model, [LlamaDecoderLayer])
    engine, *_ = zero3.initialize(model=model, config=config)
    if kind.endswith("+compile"):
        engine.compile()

    calls = [0]

    def step(batches):
        for tokens in batches:  # the last micro-step's memory is shown: its step() is the optimizer's
            loss = engine(tokens)
            phases = [("forward", _memory())]
            engine.backward(loss)
            phases.append(("backward", _memory()))
            engine.step()
            phases.append(("step", _memory()))
        calls[0] += 1
        if calls[0] <= 3:
            print(f"  step {calls[0]}: " + ", ".join(f"after {name} {now:.2f} GiB (peak {peak:.2f})"
                                                    for name, (now, peak) in phases), flush=True)
        return loss

    def describe():
        """The plan, with its budget and predicted peak (GiB) where zero3 made one."""
        plan = getattr(getattr(engine, "placement", None), "plan", None)
        if plan is None:
            return {"plan": "placement: none (all offloaded as configured)"}
        return {"plan": plan.describe(), "predicted_peak_gib": plan.predicted_peak / (1 << 30),
                "budget_gib": None if plan.budget is None else plan.budget / (1 << 30)}

    print(f"  after initialize: {_memory()[0]:.2f} GiB allocated", flush=True)

    return step, describe, lambda: engine.destroy()


def _memory() -> tuple[float, float]:
    return torch.cuda.memory_allocated() / (1 << 30), torch.cuda.max_memory_allocated() / (1 << 30)


class _Wrapped(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return loss_of(self.lm, tokens)


def deepspeed_case(args, kind: str, micro: int):
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = _Wrapped(build_llama(args))
    optimizer_only = kind.startswith("ds_opt_")  # ZeRO-Offload: the bf16 parameters stay on the card
    variant = kind.removeprefix("ds_opt_" if optimizer_only else "ds_")
    offload_optimizer = {"device": "cpu", "pin_memory": True}
    if variant.startswith("ratio="):
        offload_optimizer["ratio"] = float(variant.split("=")[1])
    if variant == "super":
        offload_optimizer["super_offload"] = True
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "gradient_accumulation_steps": args.ga,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0}}, "steps_per_print": 1000,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                    "offload_param": {"device": "cpu", "pin_memory": True},
                                    "offload_optimizer": offload_optimizer}}
    if optimizer_only:
        del config["zero_optimization"]["offload_param"]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step(batches):
        for tokens in batches:
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
        return loss

    return step, lambda: {"plan": f"DeepSpeed {deepspeed.__version__}, offload_optimizer {offload_optimizer}"}, lambda: None


def plain_case(args, kind: str, micro: int):
    model = build_llama(args)
    if kind.startswith("plain_bf16"):
        model = model.to(torch.bfloat16)
    if kind.endswith("+compile"):
        model.compile()
    stepped = not kind.startswith("plain_bf16_fwdbwd")  # fwdbwd: the arithmetic alone, no optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True) if stepped else None

    def step(batches):
        for tokens in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=kind.startswith("plain_autocast")):
                loss = loss_of(model, tokens)
            (loss / len(batches)).backward()
        if opt is None:
            model.zero_grad(set_to_none=True)
            return loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    plan = "everything on the GPU" if stepped else "forward and backward only"
    return step, lambda: {"plan": f"placement: plain PyTorch, {plan}"}, lambda: None


def run_case(args, kind: str, micro: int, params: int) -> dict:
    builder = plain_case if kind.startswith("plain") else deepspeed_case if kind.startswith("ds_") else zero3_case
    if kind.endswith("+compile") and builder is deepspeed_case:
        raise ValueError(f"{kind}: +compile is for the zero3 and plain kinds")
    torch.cuda.empty_cache()
    started = time.perf_counter()
    step, describe, close = builder(args, kind, micro)
    init_s = time.perf_counter() - started
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        batches = [tokens_for(args, micro, i * args.ga + j) for j in range(args.ga)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step(batches)
        losses.append(float(loss.item()))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[args.warmup:])
    tokens = micro * args.seq * args.ga
    result = {"kind": kind, "micro": micro, "ga": args.ga, "step_ms": median * 1e3, "tokens_s": tokens / median,
              "tflops": 6 * params * tokens / median / 1e12,
              "peak_gib": torch.cuda.max_memory_allocated() / (1 << 30),
              "host_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20),  # lifetime peak
              "host_rss_now_gib": _rss_now_gib(),  # after the measured steps: the final plan's host side
              "init_s": init_s, "first_steps_ms": [round(t * 1e3) for t in times[:args.warmup]],
              "losses": losses, **describe()}
    close()
    gc.collect()
    torch.cuda.empty_cache()
    return result


def predicted_against_peak(row: dict) -> str:
    """zero3's predicted device peak (its plan's bytes and the measured or stated reserve)
    against the measured peak, and its budget; "-" for the peers."""
    if row.get("predicted_peak_gib") is None:
        return "-"
    budget = "none" if row.get("budget_gib") is None else f"{row['budget_gib']:.2f}"
    return f"{row['predicted_peak_gib']:.2f} ({row['peak_gib'] / row['predicted_peak_gib']:.3f}), budget {budget}"


def print_table(rows: list[dict]) -> None:
    """Each case against the resident run at its micro-batch (or the largest resident one)."""
    base = {r["micro"]: r for r in rows if r["kind"] == "resident"}
    print("\n| case | micro | GA | ms/step | tokens/s | TFLOPS | peak GiB | tokens/s vs resident (its micro, else the largest) "
          "| predicted peak GiB (peak / predicted), budget GiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = base.get(r["micro"]) or (base[max(base)] if base else None)
        ratio = f"{r['tokens_s'] / ref['tokens_s']:.3f} (resident micro {ref['micro']})" if ref else "-"
        print(f"| {r['kind']} | {r['micro']} | {r.get('ga', 1)} | {r['step_ms']:.1f} | {r['tokens_s']:.0f} | {r['tflops']:.1f} | "
              f"{r['peak_gib']:.2f} | {ratio} | {predicted_against_peak(r)} |")


def main() -> None:
    args = parse()
    if args.table:
        with open(args.table) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    if args.cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * (1 << 30) / total)
    with torch.device("meta"):
        from transformers import LlamaConfig, LlamaForCausalLM
        params = sum(p.numel() for p in LlamaForCausalLM(LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
            intermediate_size=args.intermediate, num_attention_heads=args.heads, tie_word_embeddings=False)).parameters())
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}, Llama {params / 1e9:.2f}B, seq {args.seq}, "
          f"{args.warmup} warm-up + {args.steps} measured steps of {args.ga} micro-batches, cap {args.cap_gib} GiB",
          flush=True)
    rows = []
    for case in args.cases.split(","):
        kind, micro = case.rsplit(":", 1)
        try:
            row = run_case(args, kind, int(micro), params)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            print(f"{case}: failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            gc.collect()
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        print(f"{case}: {row['step_ms']:.1f} ms/step, {row['tokens_s']:.0f} tokens/s, {row['tflops']:.1f} TFLOPS, "
              f"peak {row['peak_gib']:.2f} GiB, host RSS {row['host_rss_now_gib']:.1f} GiB at the end "
              f"({row['host_rss_gib']:.1f} at its peak), init {row['init_s']:.1f} s, "
              f"warm-up steps {row['first_steps_ms']} ms\n  {row['plan']}\n  losses {[round(x, 4) for x in row['losses']]}",
              flush=True)
    if args.rows:
        with open(args.rows, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    print_table(rows)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
