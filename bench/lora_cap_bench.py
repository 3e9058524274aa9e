#!/usr/bin/env python
"""The seed's scale: a 26.8B Llama LoRA fine-tune with the card capped at 40 GiB (issue 38,
point 5, third bullet), against the same run uncapped and DeepSpeed's offload_param on the cap.

    # one case per process (bench/placement_gpu.sh STAGE=lora27b / lora27b_ds does this):
    torchrun --standalone --nproc_per_node=1 bench/lora_cap_bench.py --case zero3_uncapped --rows rows.jsonl
    torchrun --standalone --nproc_per_node=1 bench/lora_cap_bench.py --case zero3_cap40 --rows rows.jsonl
    python3 bench/lora_cap_bench.py --table rows.jsonl [more.jsonl ...]
    # every code path on the CPU with a tiny model (no cap there):
    python bench/lora_cap_bench.py --device cpu --case zero3_cap40_budget

The model: transformers' LlamaForCausalLM from a LlamaConfig (random weights), hidden 5120,
62 layers, intermediate 20992, 40 heads (head dim 128, no GQA), vocab 32000, untied head:
26.82B parameters (26,820,592,640), bf16. PEFT LoRA r=16, alpha 32, no dropout, on q/k/v/o and
gate/up/down: 118.3M trainable parameters (0.44%); under the engines' bf16 they compute in bf16
with fp32 masters and fp32 AdamW state. Each decoder layer runs under Hugging Face's gradient
checkpointing with `use_reentrant=True` (as the seed script does; `enable_input_require_grads`
so that gradients reach the LoRA weights through the frozen embedding), micro-batch 1, seq
2048, gradient accumulation 4 (a step = 4 micro-steps = 8192 tokens), gradient clipping 1.0,
the config's AdamW (lr 1e-4), decoder layers as zero3 leaf units, DeepSpeed's default
persistence threshold. Cases (one process each; a destroyed engine's GPU memory is not all
returned while the process lives):
- `zero3_uncapped`: nothing offloaded, the whole card; the model built under `zero3.Init` on
  the GPU (each parameter made on the GPU and partitioned as soon as the next one registers,
  so nothing is built on the host);
- `zero3_cap40`: `torch.cuda.set_per_process_memory_fraction(40 GiB / total)` first thing,
  `offload_param` on the CPU (pinned), the budget left to zero3 ("auto": the first window runs
  with every shard on the host, what fits then moves to the GPU, the second window may move
  more); the model built under `zero3.Init` with that config: each parameter is made on the
  GPU (fp32, one at a time), cast to bf16 and its shard copied to pinned host memory, HF's
  weight init gathers it back for the call alone; the model never sits whole on the GPU;
- `zero3_cap40_budget`: the same with `placement.gpu_budget` = `--budget-gib` (default 30 GiB);
- `deepspeed_cap40`: DeepSpeed 0.19.8 (skipped if absent) on the same cap with `offload_param`
  (pinned), built under its own `deepspeed.zero.Init`; its optimizer is torch's AdamW
  (`torch_adam: true`: no offload_optimizer, and its FusedAdam would JIT-compile a CUDA op).
Per case: init time, warm-up step times, median step, tokens/s, model TFLOPS (6 * params *
tokens: forward + recompute + input gradients of a frozen base), peak allocated and reserved
GPU memory over the measured steps (and over the whole run), host RSS (now and peak), zero3's
placement line, the losses; the table gives each case's step against `zero3_uncapped`'s
(issue 38's target: the capped step at most 1.3x the uncapped one).

Estimates (one H100 80GB, 16 cores, 128 GiB host). A micro-step is ~6*N*T = 3.3e14 FLOP plus
attention (~2e13) = 3.5e14 (the brief's ~8*N*T = 4.4e14 bounds it); at ~350 TFLOPS 1.0-1.25 s,
so a step of 4 micro-steps is ~4-5 s (5 s at 8*N*T). Memory uncapped: 53.6 GB of bf16 base, 2.1
GB of LoRA state, ~4 GB of checkpoints, a layer's recompute and logits: ~60 GB peak. Capped:
~33 GiB of budget after the measured ~4 GiB of activations and the 2 GiB margin: ~40 of 62
layers' shards on the GPU, ~17 GiB fetched twice a micro-step (forward, backward recompute):
~35 GiB at ~40 GB/s ~ 0.9 s, mostly hidden behind the 1.0-1.25 s of compute if prefetched, so
~5-6.5 s a step; the first (all-host) window copies ~100 GiB a micro-step: ~10-11 s for its
step. Per case: ~15 s start, build under Init ~30 s (uncapped) to ~60-90 s (cap: 54 GB of pinned
host shards; each weight copied to the host twice: when partitioned, then after the weight
init gathered it back for the call), initialize ~10 s, 2 warm-up + 3 measured steps ~25 s
(uncapped) / ~45 s (cap): ~1.5 min uncapped, ~2.5-3 min capped. DeepSpeed fetches every
shard from the host twice a micro-step (~100 GiB, ~2.5-5 s): ~10-20 s a step, ~4-5 min with
its Init. Host: ~54 GB pinned (up to ~68 GB with the pinned allocator's power-of-two
rounding) in the capped cases.

On the GPU: `STAGE=lora27b bash bench/placement_gpu.sh` (uncapped, then the cap with the auto
budget; ~5 min), `STAGE=lora27b_ds` (the uncapped baseline again, then DeepSpeed; ~6-7 min,
`.whl/` carried), `STAGE=lora27b_budget` (gpu_budget beside auto; ~5-6 min), each in a 10-minute
call of its own. On the CPU (`--device cpu`: the tiny shape, gloo, no cap, the "device" and the
host one memory) every case runs through the same code; the three zero3 cases give the same
losses bit for bit, and the LoRA B probe shows the adapters train. DeepSpeed's losses are not
comparable to zero3's: its zero.Init does not gather the partitioned parameters for Hugging
Face's weight init as zero3.Init does, so its random weights differ.
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
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

ROOT = os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
GIB = 1 << 30
CASES = ("zero3_uncapped", "zero3_cap40", "zero3_cap40_budget", "deepspeed_cap40")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# (name, on cuda, on cpu): the 26.8B shape, and a tiny one that runs the same code on the CPU
SHAPES = (("layers", 62, 2), ("hidden", 5120, 128), ("intermediate", 20992, 1024), ("heads", 40, 4),
          ("kv_heads", 40, 4), ("vocab", 32000, 1024), ("seq", 2048, 32))

Step = Callable[[list[torch.Tensor]], float]


@dataclass
class Case:
    """A built case: its optimizer step, its placement line, its build/initialize times,
    and the norm of its first LoRA B matrix (zero at init: above zero once LoRA trains)."""

    step: Step
    describe: Callable[[], str]
    times: dict[str, float]
    lora_norm: Callable[[], float]
    prediction: Callable[[], dict] = dict  # zero3's budget and predicted peak, GiB


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Arguments; the model's shape defaults to the 26.8B one on cuda, a tiny one on cpu."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--case", choices=CASES, default="zero3_uncapped")
    for name, _, _ in SHAPES:
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None, help="default: cuda / cpu shape")
    p.add_argument("--micro", type=int, default=1, help="micro-batch")
    p.add_argument("--ga", type=int, default=4, help="gradient accumulation (micro-steps a step)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--cap-gib", type=float, default=40.0, help="the cap of the *_cap40 cases (cuda only)")
    p.add_argument("--budget-gib", type=float, default=None,
                   help="zero3_cap40_budget's placement.gpu_budget; default 30 on cuda, 0.0055 on cpu (the "
                   "tiny shape: 3 of its 6 units' shards on the device)")
    p.add_argument("--rows", default=None, help="append the case's result to this JSON-lines file")
    p.add_argument("--table", nargs="+", default=None, help="only print the table of --rows files and exit")
    args = p.parse_args(argv)
    for name, gpu, cpu in SHAPES:
        if getattr(args, name) is None:
            setattr(args, name, gpu if args.device == "cuda" else cpu)
    return args


# ------------------------------------------------------------------ setup
def init_process(args: argparse.Namespace) -> None:
    """The cap first (before anything is allocated on the card), then the process group
    (torchrun's, or a one-process one: nccl on the GPU, gloo on the CPU)."""
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29531")})
    if args.device == "cpu":
        os.environ["ZERO3_ACCELERATOR"] = "cpu"
        os.environ["DS_ACCELERATOR"] = "cpu"
        dist.init_process_group("gloo")
        return
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if capped(args):
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(args.cap_gib * GIB / total)
    dist.init_process_group("nccl")


def capped(args: argparse.Namespace) -> bool:
    return args.device == "cuda" and args.case != "zero3_uncapped"


def llama_config(args: argparse.Namespace):
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         intermediate_size=args.intermediate, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def count_params(args: argparse.Namespace) -> tuple[int, int]:
    """(base parameters, LoRA parameters), from a model on the meta device."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(llama_config(args))
    base = sum(p.numel() for p in model.parameters())
    lora = sum(args.lora_r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS)
    return base, lora


def add_lora(base: torch.nn.Module, args: argparse.Namespace) -> torch.nn.Module:
    """PEFT LoRA on every projection of the decoder layers (the base frozen), each decoder
    layer under reentrant activation checkpointing."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, lora_dropout=0.0,
                      target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    model = get_peft_model(base, lora)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.enable_input_require_grads()  # reentrant checkpointing needs an input that requires grad
    model.train()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    expected = count_params(args)[1]
    report(f"  LoRA: {trainable / 1e6:.2f}M trainable parameters"
           + ("" if trainable == expected else f" (WARNING: {expected / 1e6:.2f}M expected)"))
    return model


def budget_bytes(args: argparse.Namespace, base_params: int) -> int:
    if args.budget_gib is not None:
        return int(args.budget_gib * GIB)
    return 30 * GIB if args.device == "cuda" else int(0.0055 * GIB)  # cpu: 3 of the tiny model's 6 units


# ------------------------------------------------------------------ engines
def zero3_config(args: argparse.Namespace, base_params: int) -> dict:
    """The DeepSpeed-style config of a zero3 case (offload_param and the budget by case)."""
    zero: dict[str, Any] = {"stage": 3}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.ga,
        "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": None,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }
    if args.case != "zero3_uncapped":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if args.case == "zero3_cap40_budget":
        config["placement"] = {"gpu_budget": budget_bytes(args, base_params)}
    return config


def zero3_case(args: argparse.Namespace, base_params: int) -> Case:
    """Build under zero3.Init on the compute device, LoRA, initialize; the step function."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    import zero3

    config = zero3_config(args, base_params)
    show_placement_log()
    times = {}
    started = time.perf_counter()
    torch.manual_seed(1234)
    with torch.device(args.device), zero3.Init(config_dict_or_path=config):
        base = LlamaForCausalLM(llama_config(args))
    model = add_lora(base, args)
    times["build_s"] = time.perf_counter() - started
    report(f"  built under zero3.Init in {times['build_s']:.1f} s; {memory_line(args)}")
    zero3.set_z3_leaf_modules(model, [LlamaDecoderLayer])
    started = time.perf_counter()
    engine, *_ = zero3.initialize(model=model, config=config)
    times["initialize_s"] = time.perf_counter() - started
    report(f"  initialized in {times['initialize_s']:.1f} s; {memory_line(args)}")

    def describe() -> str:
        plan = getattr(getattr(engine, "placement", None), "plan", None)
        return plan.describe() if plan is not None else "placement: none"

    def prediction() -> dict:
        plan = getattr(getattr(engine, "placement", None), "plan", None)
        if plan is None:
            return {}
        return {"predicted_peak_gib": plan.predicted_peak / GIB,
                "budget_gib": None if plan.budget is None else plan.budget / GIB}

    return Case(engine_step(engine), describe, times, lambda: lora_b_norm(engine.module, zero3.GatheredParameters),
                prediction)


def show_placement_log() -> None:
    """zero3's log lines about the placement (each plan it makes, at initialize and at the
    measured windows' boundaries) on stdout, with their time; its other lines stay quiet."""
    import logging

    handler = logging.StreamHandler(sys.stdout)
    handler.addFilter(lambda record: "placement" in record.getMessage())
    handler.setFormatter(logging.Formatter("  [%(asctime)s] %(message)s", "%H:%M:%S"))
    logger = logging.getLogger("zero3")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def lora_b_norm(model: torch.nn.Module, gathered: Callable) -> float:
    """The first LoRA B matrix's norm, gathered by the engine's GatheredParameters."""
    weight = next(p for name, p in model.named_parameters() if "lora_B" in name)
    with gathered([weight]):
        return float(weight.detach().float().norm())


def engine_step(engine) -> Step:
    """One optimizer step: a forward, backward and engine.step() per micro-batch."""
    def step(batches: list[torch.Tensor]) -> float:
        for tokens in batches:
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        return float(loss.item())
    return step


def deepspeed_config(args: argparse.Namespace) -> dict:
    return {
        "train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": args.ga,
        "gradient_clipping": 1.0, "bf16": {"enabled": True}, "steps_per_print": 1000,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}},
    }


def deepspeed_case(args: argparse.Namespace, base_params: int) -> Case:
    """DeepSpeed 0.19.8: built under its zero.Init (offload_param: host shards), LoRA, initialize."""
    import logging

    import deepspeed
    from transformers import LlamaForCausalLM

    deepspeed.utils.logger.setLevel(logging.WARNING)
    config = deepspeed_config(args)
    times = {}
    started = time.perf_counter()
    torch.manual_seed(1234)
    with deepspeed.zero.Init(config_dict_or_path=config):
        base = LlamaForCausalLM(llama_config(args))
    model = add_lora(base, args)
    times["build_s"] = time.perf_counter() - started
    report(f"  built under deepspeed.zero.Init in {times['build_s']:.1f} s; {memory_line(args)}")
    started = time.perf_counter()
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    times["initialize_s"] = time.perf_counter() - started
    report(f"  initialized in {times['initialize_s']:.1f} s; {memory_line(args)}")
    return Case(engine_step(engine), lambda: f"DeepSpeed {deepspeed.__version__}: offload_param cpu (pinned)", times,
                lambda: lora_b_norm(engine.module, deepspeed.zero.GatheredParameters))


# ------------------------------------------------------------------ measuring
def report(line: str) -> None:
    print(line, flush=True)


def sync(args: argparse.Namespace) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def host_rss_gib() -> tuple[float, float]:
    """(resident now, peak) of this process, GiB."""
    with open("/proc/self/statm") as f:
        now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return now / GIB, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)


def gpu_gib() -> dict[str, float]:
    """Allocated / reserved now and at their peaks, GiB."""
    return {"allocated": torch.cuda.memory_allocated() / GIB, "reserved": torch.cuda.memory_reserved() / GIB,
            "peak_allocated": torch.cuda.max_memory_allocated() / GIB,
            "peak_reserved": torch.cuda.max_memory_reserved() / GIB}


def memory_line(args: argparse.Namespace) -> str:
    now, peak = host_rss_gib()
    host = f"host RSS {now:.1f} GiB (peak {peak:.1f})"
    if args.device != "cuda":
        return host
    g = gpu_gib()
    return (f"GPU {g['allocated']:.2f} GiB allocated (peak {g['peak_allocated']:.2f}), {g['reserved']:.2f} "
            f"reserved (peak {g['peak_reserved']:.2f}); {host}")


def tokens_for(args: argparse.Namespace, index: int) -> torch.Tensor:
    """Micro-batch `index`'s token ids (the same in every case)."""
    gen = torch.Generator(device="cpu").manual_seed(index)
    return torch.randint(0, args.vocab, (args.micro, args.seq), generator=gen).to(args.device)


def timed_steps(args: argparse.Namespace, step: Step) -> tuple[list[float], list[float], float]:
    """Warm-up then measured steps: (step seconds, losses, peak GiB allocated before the
    measured steps, which the peak counters are reset for)."""
    times, losses, peak_before = [], [], 0.0
    for i in range(args.warmup + args.steps):
        if i == args.warmup and args.device == "cuda":
            sync(args)
            peak_before = torch.cuda.max_memory_allocated() / GIB
            torch.cuda.reset_peak_memory_stats()
        batches = [tokens_for(args, i * args.ga + j) for j in range(args.ga)]
        sync(args)
        started = time.perf_counter()
        losses.append(step(batches))
        sync(args)
        times.append(time.perf_counter() - started)
        report(f"  step {i + 1}{' (warm-up)' if i < args.warmup else ''}: {times[-1] * 1e3:.0f} ms, "
               f"loss {losses[-1]:.4f}; {memory_line(args)}")
    return times, losses, peak_before


def run_case(args: argparse.Namespace, base_params: int, lora_params: int) -> dict:
    """Build, warm up, measure one case; its row."""
    builder = deepspeed_case if args.case.startswith("deepspeed") else zero3_case
    started = time.perf_counter()
    case = builder(args, base_params)
    init_s = time.perf_counter() - started
    times, losses, peak_before = timed_steps(args, case.step)
    median = statistics.median(times[args.warmup:])
    tokens = args.micro * args.seq * args.ga
    now, peak_rss = host_rss_gib()
    row = {"case": args.case, "device": device_name(args), "params": base_params, "lora_params": lora_params,
           "seq": args.seq, "micro": args.micro, "ga": args.ga,
           "cap_gib": args.cap_gib if capped(args) else None,
           "step_ms": median * 1e3, "tokens_s": tokens / median,
           "tflops": 6 * (base_params + lora_params) * tokens / median / 1e12,
           "init_s": init_s, **case.times, "lora_b_norm": guarded_norm(case),
           "warmup_ms": [round(t * 1e3) for t in times[:args.warmup]],
           "measured_ms": [round(t * 1e3) for t in times[args.warmup:]],
           "host_rss_gib": now, "host_rss_peak_gib": peak_rss, "plan": case.describe(), "losses": losses,
           **case.prediction()}
    if args.device == "cuda":
        g = gpu_gib()
        row.update(peak_gib=g["peak_allocated"], peak_reserved_gib=g["peak_reserved"],
                   peak_run_gib=max(peak_before, g["peak_allocated"]))
    return row


def guarded_norm(case: Case) -> float:
    """The LoRA B probe; NaN (and a line) if gathering it fails, so the measured row stays."""
    try:
        return case.lora_norm()
    except Exception as exc:  # noqa: BLE001 - a probe, not the measurement
        report(f"  LoRA B probe failed: {type(exc).__name__}: {str(exc)[:200]}")
        return float("nan")


def device_name(args: argparse.Namespace) -> str:
    return torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"


def print_row(row: dict) -> None:
    peak = (f"peak {row['peak_gib']:.2f} GiB allocated ({row['peak_reserved_gib']:.2f} reserved; "
            f"{row['peak_run_gib']:.2f} over the run), " if "peak_gib" in row else "")
    report(f"{row['case']}: {row['step_ms']:.0f} ms/step, {row['tokens_s']:.0f} tokens/s, {row['tflops']:.1f} TFLOPS, "
           f"{peak}host RSS {row['host_rss_gib']:.1f} GiB (peak {row['host_rss_peak_gib']:.1f}), "
           f"init {row['init_s']:.1f} s, LoRA B norm {row['lora_b_norm']:.3g}, warm-up steps {row['warmup_ms']} ms, "
           f"measured {row['measured_ms']} ms\n"
           f"  {row['plan']}\n  losses {[round(x, 4) for x in row['losses']]}"
           + (f"\n  predicted peak {row['predicted_peak_gib']:.2f} GiB (measured/predicted "
              f"{row['peak_gib'] / row['predicted_peak_gib']:.3f}), budget {row['budget_gib']}"
              if row.get("predicted_peak_gib") and "peak_gib" in row else ""))


def print_table(rows: list[dict]) -> None:
    """Each case's step against zero3_uncapped's on the same device (target: at most 1.3x)."""
    base = {r["device"]: r for r in rows if r["case"] == "zero3_uncapped" and "error" not in r}
    report("\n| case | device | cap GiB | ms/step | tokens/s | TFLOPS | peak GiB (reserved) | host RSS GiB (peak) "
           "| init s | step vs zero3_uncapped | predicted peak GiB (peak / predicted), budget GiB |")
    report("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            report(f"| {r['case']} | {r['device']} | failed: {r['error'][:160]} | | | | | | | | |")
            continue
        ref = base.get(r["device"])
        ratio = f"{r['step_ms'] / ref['step_ms']:.2f}x" if ref else "-"
        peak = f"{r['peak_gib']:.2f} ({r['peak_reserved_gib']:.2f})" if "peak_gib" in r else "n/a"
        report(f"| {r['case']} | {r['device']} | {r['cap_gib'] or '-'} | {r['step_ms']:.0f} | {r['tokens_s']:.0f} | "
               f"{r['tflops']:.1f} | {peak} | {r['host_rss_gib']:.1f} ({r['host_rss_peak_gib']:.1f}) | "
               f"{r['init_s']:.0f} | {ratio} | {predicted_against_peak(r)} |")


def predicted_against_peak(row: dict) -> str:
    """zero3's predicted device peak against the measured one, and its budget; "-" otherwise."""
    if not row.get("predicted_peak_gib") or "peak_gib" not in row:
        return "-"
    budget = "none" if row.get("budget_gib") is None else f"{row['budget_gib']:.2f}"
    return f"{row['predicted_peak_gib']:.2f} ({row['peak_gib'] / row['predicted_peak_gib']:.3f}), budget {budget}"


def read_rows(paths: list[str]) -> list[dict]:
    rows = []
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                rows += [json.loads(line) for line in f if line.strip()]
    return rows


def main() -> None:
    args = parse()
    if args.table:
        print_table(read_rows(args.table))
        return
    init_process(args)
    base_params, lora_params = count_params(args)
    report(f"# {device_name(args)}, torch {torch.__version__}, case {args.case}: Llama {base_params / 1e9:.2f}B "
           f"({args.layers} layers, hidden {args.hidden}, intermediate {args.intermediate}, heads {args.heads}/"
           f"{args.kv_heads}, vocab {args.vocab}), LoRA r={args.lora_r} {lora_params / 1e6:.1f}M, seq {args.seq}, "
           f"micro-batch {args.micro}, GA {args.ga}, {args.warmup} warm-up + {args.steps} measured steps, "
           f"cap {f'{args.cap_gib} GiB' if capped(args) else 'none'}")
    row = guarded_run(args, base_params, lora_params)
    if row is not None:
        if "error" not in row:
            print_row(row)
        if args.rows:
            with open(args.rows, "a") as f:
                f.write(json.dumps(row) + "\n")
        print_table([row])
    gc.collect()
    dist.destroy_process_group()


def guarded_run(args: argparse.Namespace, base_params: int, lora_params: int) -> dict | None:
    """run_case; a case whose engine is not installed is skipped (None), one that fails
    (out of memory under the cap, say) gives a row with its error, for the table."""
    try:
        return run_case(args, base_params, lora_params)
    except ImportError as exc:
        report(f"{args.case}: skipped: {exc}")
        return None
    except Exception as exc:  # noqa: BLE001 - one shot on the GPU: reported, not raised
        import traceback

        traceback.print_exc()
        error = f"{type(exc).__name__}: {str(exc)[:600]}"
        report(f"{args.case}: failed: {error}\n  {memory_line(args)}")
        return {"case": args.case, "device": device_name(args), "error": error}


if __name__ == "__main__":
    main()
