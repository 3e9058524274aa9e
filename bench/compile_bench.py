#!/usr/bin/env python
"""torch.compile side by side: zero3 compiled against plain PyTorch compiled, FSDP2 with each
block compiled (torchtitan's recipe), DeepSpeed's engine.compile() and zero3 eager.

    # 1B Llama, bf16, world size 1 (the GPU run)
    torchrun --standalone --nproc_per_node=1 bench/compile_bench.py --device cuda --dtype bf16 \\
        --model llama --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 \\
        --seq 2048 --micro-batch 2 --steps 6 --warmup 3 --rounds 2
    # 7B LoRA: add --lora 16 (LoRA r=16 on q/k/v/o, the base frozen) with the 7B shape
    # tiny CPU check
    torchrun --standalone --nproc_per_node=1 bench/compile_bench.py --model llama --width 64 \\
        --layers 2 --heads 4 --vocab 256 --seq 32 --micro-batch 2 --steps 2 --warmup 2 --rounds 1 \\
        --compile-backend aot_eager

Everything else (same seed and tokens for every peer, rounds alternating the peers, the
slowest rank's step time, the table) is bench/cpu_bench.py's, whose arguments this script
takes too. Peers:
- plain_compiled: the whole model `torch.compile`d (one process, no sharding), a bf16 model
  with bf16 AdamW state under --dtype bf16 (the ceiling: half the arithmetic's bytes);
- plain_autocast_compiled: the same, an fp32 model under bf16 autocast (zero3's arithmetic);
- fsdp2_compiled: each block `block.compile()` then `fully_shard` per block and the root;
- deepspeed_compiled: DeepSpeed ZeRO-3 and its `engine.compile()`;
- zero3_compiled: zero3 and its `engine.compile()` (each fetch unit's forward compiled);
- zero3: zero3 eager.
Compile time: the warm-up steps (and build) minus as many measured median steps: the time
the first steps spent compiling. The summary prints tokens/s and zero3 compiled's ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import cpu_bench
from cpu_bench import Peer, _adamw, _engine_peer, build_zero3, ds_config

COMPILE: dict = {}  # backend, mode: set from the command line


def _compile_kwargs() -> dict:
    return {"mode": COMPILE["mode"]} if COMPILE.get("mode") else {}


def _maybe_lora(model, args):
    """--lora R: LoRA adapters of rank R on the attention projections; the base is frozen."""
    if not getattr(args, "lora", 0):
        return model
    from peft import LoraConfig, get_peft_model
    config = LoraConfig(r=args.lora, lora_alpha=2 * args.lora, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model.lm = get_peft_model(model.lm, config)
    return model


def _install_lora_builder(args) -> None:
    import models
    plain_build = models.build_model
    models.build_model = lambda a: _maybe_lora(plain_build(a), args)


def _train_step(model, opt):
    def step(tokens):
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step


def build_plain_compiled(ctx):
    import torch
    from models import build_model
    if ctx.world > 1:
        raise RuntimeError("plain_compiled runs at world size 1 only")
    model = build_model(ctx.args).to(ctx.device)
    if ctx.args.dtype == "bf16":
        model = model.to(torch.bfloat16)
    model.compile(backend=COMPILE["backend"], **_compile_kwargs())
    opt = _adamw([p for p in model.parameters() if p.requires_grad], ctx)
    return Peer(_train_step(model, opt))


def build_plain_autocast_compiled(ctx):
    """Plain PyTorch doing zero3's default arithmetic, compiled: an fp32 model (fp32 weights,
    gradients and AdamW state) whose compiled forward runs under bf16 autocast."""
    import torch
    from models import build_model
    if ctx.world > 1:
        raise RuntimeError("plain_autocast_compiled runs at world size 1 only")
    model = build_model(ctx.args).to(ctx.device)
    model.compile(backend=COMPILE["backend"], **_compile_kwargs())
    opt = _adamw([p for p in model.parameters() if p.requires_grad], ctx)
    train = _train_step(model, opt)

    def step(tokens):
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.args.dtype == "bf16"):
            return train(tokens)
    return Peer(step)


def build_fsdp2_compiled(ctx):
    """torchtitan's recipe: each block compiled in place, then sharded per block and at the root."""
    from models import build_model
    model = build_model(ctx.args).to(ctx.device)
    for block in model.blocks():
        block.compile(backend=COMPILE["backend"], **_compile_kwargs())
    cpu_bench.fsdp2_shard(model, ctx)
    opt = _adamw([p for p in model.parameters() if p.requires_grad], ctx)
    return Peer(_train_step(model, opt))


def build_deepspeed_compiled(ctx):
    import logging

    import deepspeed
    from models import build_model
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = build_model(ctx.args)
    opt = _adamw([p for p in model.parameters() if p.requires_grad], ctx)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(ctx))
    engine.compile(backend=COMPILE["backend"], compile_kwargs=_compile_kwargs())
    return _engine_peer(engine)


def build_zero3_compiled(ctx):
    import zero3
    from models import build_model
    model = build_model(ctx.args)
    opt = _adamw([p for p in model.parameters() if p.requires_grad], ctx)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=opt, config=ds_config(ctx))
    engine.compile(backend=COMPILE["backend"], compile_kwargs=_compile_kwargs())
    return _engine_peer(engine, stats_fn=engine.comm_stats)


PEERS = {"plain_compiled": build_plain_compiled, "plain_autocast_compiled": build_plain_autocast_compiled,
         "fsdp2_compiled": build_fsdp2_compiled,
         "deepspeed_compiled": build_deepspeed_compiled, "zero3_compiled": build_zero3_compiled,
         "zero3": build_zero3}
DEFAULT_PEERS = "plain_compiled,plain_autocast_compiled,fsdp2_compiled,deepspeed_compiled,zero3_compiled,zero3"


def summary(results: dict, tokens_per_step: int) -> None:
    """tokens/s, zero3 compiled's ratio to each peer, and compile time."""
    rows = {}
    for name, res in results.items():
        if res["error"] or not res["times"]:
            print(f"# {name}: failed ({res['error']})")
            continue
        median = statistics.median(res["times"])
        warm = res["warmup"][0] if res["warmup"] else []
        compile_s = res["init"][0] + sum(warm) - len(warm) * median
        rows[name] = (tokens_per_step / median, compile_s)
    ours = rows.get("zero3_compiled")
    print("\n| peer | tokens/s | zero3_compiled / peer | compile s (build + warm-up - steady) |")
    print("|---|---:|---:|---:|")
    for name, (rate, compile_s) in rows.items():
        ratio = f"{ours[0] / rate:.2f}x" if ours else "-"
        print(f"| {name} | {rate:,.0f} | {ratio} | {compile_s:.1f} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode (no CUDA-graph modes)")
    parser.add_argument("--lora", type=int, default=0, help="LoRA rank on q/k/v/o; 0: full fine-tune")
    ours, rest = parser.parse_known_args(argv if argv is not None else sys.argv[1:])
    COMPILE.update(backend=ours.compile_backend, mode=ours.compile_mode)
    if "--peers" not in rest:
        rest += ["--peers", DEFAULT_PEERS]
    cpu_bench.BUILDERS.update(PEERS)
    _install_lora_builder(ours)
    print(f"# compile: backend {ours.compile_backend}, mode {ours.compile_mode or 'default'}, "
          f"lora r={ours.lora or '-'}", flush=True)
    out = cpu_bench.main(rest)
    if out is not None and os.environ.get("RANK", "0") == "0":
        summary(*out)


if __name__ == "__main__":
    main()
