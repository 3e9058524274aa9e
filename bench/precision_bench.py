#!/usr/bin/env python
"""Half the bytes: bf16 masters and optimizer state, and torch_autocast, against the plain
PyTorch run that does the same arithmetic, FSDP2 and DeepSpeed (world size 1, one case a
process).

    # one case (bench/precision_gpu.sh runs the list, one process each, then the table)
    python3 bench/precision_bench.py --case zero3_bf16 --rows rows.jsonl
    python3 bench/precision_bench.py --table rows.jsonl
    # the CPU check of everything but the CUDA specifics (a 2-layer Llama)
    python3 bench/precision_bench.py --device cpu --layers 2 --width 64 --intermediate 128 --heads 4 \\
        --vocab 256 --seq 32 --micro-batch 2 --steps 2 --warmup 1 --case zero3_bf16_compiled \\
        --compile-backend eager --rows /tmp/rows.jsonl

A case is `<peer>_<mode>[_compiled]`:
- mode `bf16` (8 bytes a parameter): zero3 and DeepSpeed with `bf16.enabled`,
  `bf16_master_weights_and_grads` and `bf16_optimizer_states`; plain PyTorch and FSDP2 with a
  bf16 model (FSDP2: bf16 parameters and reduction, no mixed-precision policy) and torch's
  fused AdamW, whose state is then bf16: the same arithmetic;
- mode `autocast` (16 bytes): zero3 and DeepSpeed with `torch_autocast` (bfloat16, fp32
  parameters); plain PyTorch and FSDP2 with an fp32 model whose forward runs under
  `torch.autocast(bfloat16)`, fused AdamW on fp32 state;
- `_compiled`: each decoder layer compiled, torchtitan's way (plain and FSDP2: `layer.compile()`,
  FSDP2 before `fully_shard`; zero3 and DeepSpeed: `engine.compile()`, zero3 compiling each
  fetch unit, here one per decoder layer).
Peers: `plain`, `zero3`, `fsdp2`, `deepspeed` (skipped with a line when DeepSpeed is not
installed). zero3 and DeepSpeed take the decoder layers as ZeRO-3 leaf modules (one coalesced
gather a layer); every peer gets a client `torch.optim.AdamW(lr 1e-5, weight_decay 0, fused)`
and gradient clipping 1.0 (plain and FSDP2: `clip_grad_norm_`).

Each case builds the model (transformers' LlamaForCausalLM, random weights, seed 1234; on the
device with `--build-on device`, in bf16 directly for the bf16 mode), trains `--warmup` steps
then `--steps` measured ones on the same random tokens, and reports the median step, tokens/s,
model TFLOPS (6 * parameters * tokens / step, attention not counted), the peak of allocated
device memory over the measured steps (CUDA only), the build + warm-up time and the losses.
The table (`--table`) prints each case and the ratios: zero3 over the plain run of its mode and
compile setting, and over FSDP2 and DeepSpeed of the same.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PEERS = ("plain", "zero3", "fsdp2", "deepspeed")
MODES = ("bf16", "autocast")
LR = 1e-5
CLIP = 1.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--build-on", default="device", choices=("device", "cpu"))
    p.add_argument("--compile-backend", default="inductor")
    p.add_argument("--case", default=None, help="<peer>_<mode>[_compiled], e.g. zero3_bf16_compiled")
    p.add_argument("--label", default="", help="a name for the model in the table (e.g. 1b, 7b)")
    p.add_argument("--rows", default=None, help="append the case's result to this JSON-lines file")
    p.add_argument("--table", default=None, help="only print the table of a --rows file and exit")
    return p.parse_args(argv)


def parse_case(case: str) -> tuple[str, str, bool]:
    """(peer, mode, compiled) of a case name; ValueError naming the accepted forms."""
    parts = case.split("_")
    compiled = parts[-1] == "compiled"
    if compiled:
        parts = parts[:-1]
    if len(parts) != 2 or parts[0] not in PEERS or parts[1] not in MODES:
        raise ValueError(f"case {case!r}: expected <peer>_<mode>[_compiled] with peer in {PEERS} and mode in {MODES}")
    return parts[0], parts[1], compiled


# ------------------------------------------------------------------ the model
def llama_config(args):
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.width, num_hidden_layers=args.layers,
                      intermediate_size=args.intermediate, num_attention_heads=args.heads,
                      max_position_embeddings=args.seq, tie_word_embeddings=False, use_cache=False)
    cfg._attn_implementation = "sdpa"
    return cfg


class LM(torch.nn.Module):
    """LlamaForCausalLM whose forward(tokens) returns the next-token loss (fp32 logits)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def layers(self) -> list[torch.nn.Module]:
        return list(self.lm.model.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.lm(input_ids=tokens[:, :-1], use_cache=False).logits
        return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))


def build(args, dtype: torch.dtype) -> LM:
    """The model in `dtype`, built where --build-on says, from one seed."""
    from transformers import LlamaForCausalLM
    torch.manual_seed(1234)
    where = args.device if args.build_on == "device" else "cpu"
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # a 7B model never exists in fp32 when bf16 is asked
    try:
        with torch.device(where):
            model = LM(LlamaForCausalLM(llama_config(args)))
    finally:
        torch.set_default_dtype(previous)
    return model.to(args.device)


def parameter_count(args) -> int:
    from transformers import LlamaForCausalLM
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(llama_config(args)).parameters())


def adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0, fused=True)


def autocast(args, mode: str):
    if mode != "autocast":
        return contextlib.nullcontext()
    return torch.autocast(args.device, dtype=torch.bfloat16)


# ------------------------------------------------------------------ the peers
def plain_case(args, mode: str, compiled: bool):
    model = build(args, torch.bfloat16 if mode == "bf16" else torch.float32)
    if compiled:
        for layer in model.layers():
            layer.compile(backend=args.compile_backend)
    opt = adamw(model.parameters())

    def step(tokens):
        with autocast(args, mode):
            loss = model(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, "plain PyTorch", lambda: None


def fsdp2_case(args, mode: str, compiled: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = build(args, torch.bfloat16 if mode == "bf16" else torch.float32)
    mesh = init_device_mesh(args.device, (dist.get_world_size(),))
    for layer in model.layers():
        if compiled:
            layer.compile(backend=args.compile_backend)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = adamw(model.parameters())

    def step(tokens):
        with autocast(args, mode):
            loss = model(tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, "FSDP2, fully_shard per decoder layer and the root", lambda: None


def deepspeed_config(args, mode: str) -> dict:
    """The DeepSpeed config both zero3 and DeepSpeed get for `mode`."""
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_clipping": CLIP,
              "steps_per_print": 1000000, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    if mode == "bf16":
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    else:
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    return config


def engine_step(engine):
    def step(tokens):
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss
    return step


def zero3_case(args, mode: str, compiled: bool):
    import zero3
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model = build(args, torch.bfloat16 if mode == "bf16" else torch.float32)
    zero3.set_z3_leaf_modules(model, [LlamaDecoderLayer])
    engine, *_ = zero3.initialize(model=model, optimizer=adamw(model.parameters()),
                                  config=deepspeed_config(args, mode))
    if compiled:
        engine.compile(backend=args.compile_backend)
    opt = engine.optimizer
    note = (f"zero3: masters {sorted({str(m.dtype) for m in opt.masters})}, masters are the shards: "
            f"{all(m is sp.shard for sp, m in zip(opt.params, opt.masters))}")
    return engine_step(engine), note, engine.destroy


def deepspeed_case(args, mode: str, compiled: bool):
    import logging

    import deepspeed  # absent: the caller reports the case as skipped
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = build(args, torch.bfloat16 if mode == "bf16" else torch.float32)
    deepspeed.utils.set_z3_leaf_modules(model, [LlamaDecoderLayer])
    engine, *_ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()),
                                      config=deepspeed_config(args, mode))
    if compiled:
        engine.compile(backend=args.compile_backend)
    return engine_step(engine), f"DeepSpeed {deepspeed.__version__}", engine.destroy


BUILDERS = {"plain": plain_case, "zero3": zero3_case, "fsdp2": fsdp2_case, "deepspeed": deepspeed_case}


# ------------------------------------------------------------------ measuring
def tokens_for(args, step: int) -> torch.Tensor:
    gen = torch.Generator(device="cpu").manual_seed(step)
    return torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen).to(args.device)


def sync(args) -> None:
    if args.device == "cuda":
        torch.cuda.synchronize()


def peak_gib(args) -> float | None:
    return torch.cuda.max_memory_allocated() / (1 << 30) if args.device == "cuda" else None


def run_case(args, case: str, params: int) -> dict:
    peer, mode, compiled = parse_case(case)
    started = time.perf_counter()
    step, note, close = BUILDERS[peer](args, mode, compiled)
    built_s = time.perf_counter() - started
    losses, times = [], []
    for i in range(args.warmup + args.steps):
        if i == args.warmup and args.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        tokens = tokens_for(args, i)
        sync(args)
        t0 = time.perf_counter()
        loss = step(tokens)
        losses.append(float(loss.item()))
        sync(args)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times[args.warmup:])
    tokens = args.micro_batch * args.seq
    row = {"case": case, "peer": peer, "mode": mode, "compiled": compiled, "label": args.label,
           "params": params, "step_ms": median * 1e3, "tokens_s": tokens / median,
           "tflops": 6 * params * tokens / median / 1e12, "peak_gib": peak_gib(args),
           "build_s": built_s, "warmup_s": sum(times[:args.warmup]), "note": note, "losses": losses}
    close()
    return row


# ------------------------------------------------------------------ the table
def ratio(row: dict, rows: list[dict], peer: str) -> str:
    """row's tokens/s over `peer`'s of the same model, mode and compile setting."""
    for other in rows:
        if (other["peer"], other["mode"], other["compiled"], other.get("label")) == \
                (peer, row["mode"], row["compiled"], row.get("label")):
            return f"{row['tokens_s'] / other['tokens_s']:.3f}x"
    return "-"


def print_table(rows: list[dict]) -> None:
    print("\n| model | case | ms/step | tokens/s | TFLOPS | peak GiB | build + warm-up s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        print(f"| {r.get('label') or '-'} | {r['case']} | {r['step_ms']:.1f} | {r['tokens_s']:,.0f} | "
              f"{r['tflops']:.1f} | {peak} | {r['build_s'] + r['warmup_s']:.1f} |")
    ours = [r for r in rows if r["peer"] == "zero3"]
    if ours:
        print("\n| model | zero3 case | / plain (same arithmetic) | / fsdp2 | / deepspeed |")
        print("|---|---|---:|---:|---:|")
        for r in ours:
            print(f"| {r.get('label') or '-'} | {r['case']} | {ratio(r, rows, 'plain')} | {ratio(r, rows, 'fsdp2')} | "
                  f"{ratio(r, rows, 'deepspeed')} |")


def init_world_one(args) -> None:
    """A process group of one (no torchrun needed): nccl on CUDA, gloo on the CPU."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    if args.device == "cpu":
        os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.table:
        with open(args.table) as f:
            print_table([json.loads(line) for line in f if line.strip()])
        return 0
    if args.case is None:
        print("--case is required (or --table)", file=sys.stderr)
        return 2
    peer, _, _ = parse_case(args.case)
    if peer == "deepspeed":
        try:
            import deepspeed  # noqa: F401
        except ImportError as error:
            print(f"{args.case}: skipped: DeepSpeed is not installed ({error})", flush=True)
            return 0
    init_world_one(args)
    params = parameter_count(args)
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# {where}, torch {torch.__version__}, Llama {params / 1e9:.2f}B, seq {args.seq}, micro-batch "
          f"{args.micro_batch}, {args.warmup} warm-up + {args.steps} measured steps", flush=True)
    try:
        row = run_case(args, args.case, params)
    finally:
        gc.collect()
        dist.destroy_process_group()
    peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.2f} GiB"
    print(f"{args.case}: {row['step_ms']:.1f} ms/step, {row['tokens_s']:,.0f} tokens/s, {row['tflops']:.1f} TFLOPS, "
          f"peak {peak}, build {row['build_s']:.1f} s, warm-up {row['warmup_s']:.1f} s\n  {row['note']}\n"
          f"  losses {[round(x, 4) for x in row['losses']]}", flush=True)
    if args.rows:
        with open(args.rows, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
