"""Where a step's time goes with both offloads on one GPU (diagnostics, not CI).

    PYTHONPATH=$PWD torchrun --standalone --nproc_per_node=1 tests/gpu/offload_breakdown.py [--layers 8]

A Llama-style model of the 3B width (hidden 3072, intermediate 8192), offload_param and
offload_optimizer to pinned CPU memory; prints forward, backward (to complete host
gradients) and optimizer-step times, each up to a synchronize, and the step's parts.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import zero3


class Wrapped(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, tokens):
        logits = self.model(input_ids=tokens[:, :-1]).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    args = parser.parse_args()
    zero3.init_distributed(dist_backend="nccl")
    cfg = LlamaConfig(hidden_size=3072, num_hidden_layers=args.layers, intermediate_size=8192,
                      num_attention_heads=24, num_key_value_heads=24, vocab_size=32000,
                      max_position_embeddings=2048, attn_implementation="sdpa")
    config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                    "offload_optimizer": {"device": "cpu", "pin_memory": True, "overlap_step": False}}}
    with zero3.Init(config_dict_or_path=config):
        model = Wrapped(LlamaForCausalLM(cfg))
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                       config=config)
    numel = sum(p.numel() for p in model.parameters())
    tokens = torch.randint(0, 32000, (1, 2049), device="cuda")
    for step in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = engine(tokens)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        engine.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        opt = engine.optimizer
        for sp, master in zip(opt.params, opt.masters):
            master.grad = sp.grad_shard
        t3 = time.perf_counter()
        squared = opt.global_grad_norm_squared()
        opt.optimizer.grad_scale = opt._clip_divisor(squared)  # clipping to 1.0, inside the kernel
        t4 = time.perf_counter()
        opt.optimizer.step()
        opt.optimizer.grad_scale = None
        t5 = time.perf_counter()
        opt._write_back_shards(list(range(len(opt.params))))
        t6 = time.perf_counter()
        opt.zero_grad()
        engine.micro_steps += 1
        engine.global_steps += 1
        print(f"step {step}: {numel / 1e9:.2f}B params, {torch.get_num_threads()} threads; forward {1e3 * (t1 - t0):.0f} ms, backward "
              f"{1e3 * (t2 - t1):.0f} ms, grad norm {1e3 * (t4 - t3):.0f} ms, clipped adamw {1e3 * (t5 - t4):.0f} ms, "
              f"write-back {1e3 * (t6 - t5):.0f} ms; loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
