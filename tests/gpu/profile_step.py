"""Profile zero3 training steps of a Llama-style model on one GPU (diagnostics, not CI).

    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=1 tests/gpu/profile_step.py [--layers 16]

Prints step times for plain bf16 PyTorch and zero3, then torch.profiler's top operators
for zero3 by self CUDA time and by self CPU time.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import zero3


def build(layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=layers, intermediate_size=5632, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def loss_of(model, tokens):
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class Wrapped(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        return loss_of(self.model, tokens)


def timed(step, n=6, warmup=2):
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args()
    zero3.init_distributed(dist_backend="nccl")
    device = torch.device("cuda", 0)
    tokens = torch.randint(0, 32000, (args.micro_batch, args.seq + 1), device=device)

    plain = build(args.layers).to(device, torch.bfloat16)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-4, fused=True)

    def plain_step():
        loss_of(plain, tokens).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    plain_ms = timed(plain_step)
    del plain, opt
    torch.cuda.empty_cache()

    model = Wrapped(build(args.layers))
    engine, _, _, _ = zero3.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
        config={"train_micro_batch_size_per_gpu": args.micro_batch, "bf16": {"enabled": True},
                "zero_optimization": {"stage": 3}})

    def zero3_step():
        engine.backward(engine(tokens))
        engine.step()

    zero3_ms = timed(zero3_step)
    tokens_per_step = args.micro_batch * args.seq
    print(f"plain {plain_ms:.1f} ms ({tokens_per_step / plain_ms * 1e3:,.0f} tok/s); "
          f"zero3 {zero3_ms:.1f} ms ({tokens_per_step / zero3_ms * 1e3:,.0f} tok/s); ratio {plain_ms / zero3_ms:.2f}")
    print(f"zero3 peak allocated {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            zero3_step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
