"""zero3 demo: LoRA fine-tuning of a small transformer, sharded over 2 CPU ranks.

Phase `first`: train 3 optimizer steps (gradient accumulation 2, activation
checkpointing, parameters offloaded to CPU, LoRA A matrices small enough to stay
resident and read outside their module as PEFT does), then save a checkpoint.
Phase `resume`: new processes load it and train 3 more steps; then the same 6 steps are
run uninterrupted from scratch, and the losses after the resume are compared bit for bit.

    torchrun --standalone --nproc_per_node=2 examples/demo.py --phase first --dir DIR
    torchrun --standalone --nproc_per_node=2 examples/demo.py --phase resume --dir DIR
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from tqdm import tqdm

import zero3 as deepspeed
from zero3.accelerator import get_accelerator

VOCAB, WIDTH, LAYERS, SEQ, MICRO, GA, STEPS = 96, 48, 3, 16, 4, 2, 5


class LoraLinear(nn.Module):
    """A frozen base projection plus a trainable low-rank update, the way PEFT builds it."""

    def __init__(self, width: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_A = nn.Linear(width, rank, bias=False)
        self.lora_B = nn.Linear(rank, width, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        x = x.to(self.lora_A.weight.dtype)  # PEFT's access outside the adapter's own module
        return result + self.lora_B(self.lora_A(x)) * 2.0


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.query, self.key, self.value = LoraLinear(width), LoraLinear(width), LoraLinear(width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.mlp.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (m(h).view(*h.shape[:2], 4, -1).transpose(1, 2) for m in (self.query, self.key, self.value))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(x.shape)
        x = x + attn
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        nn.init.normal_(self.embed.weight, std=0.5)
        self.embed.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # The embedding is frozen: make its output require grad so that reentrant
        # checkpointing sees an input with grad (PEFT's enable_input_require_grads).
        h = self.embed(tokens[:, :-1]).requires_grad_(torch.is_grad_enabled())
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=True)
        logits = F.linear(self.norm(h), self.embed.weight)  # tied output head
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": GA,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 2}},
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": WIDTH * 4,  # LoRA A/B stay resident
        "offload_param": {"device": "cpu"},
    },
}


def build_engine():
    torch.manual_seed(0)
    engine, _, _, _ = deepspeed.initialize(model=TinyLM(), config=CONFIG)
    return engine


def batch(step: int, micro: int, rank: int, world: int) -> torch.Tensor:
    """Arithmetic sequences (start + i * stride) mod VOCAB: learnable from context."""
    g = torch.Generator().manual_seed(((step * GA + micro) * world + rank) * 7919)
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    stride = torch.randint(1, 4, (MICRO, 1), generator=g)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def train(engine, first: int, count: int, label: str) -> list[float]:
    rank, world = engine.global_rank, engine.world_size
    losses = []
    bar = tqdm(range(first, first + count), desc=label, disable=rank != 0, ncols=80, leave=True)
    for step in bar:
        total = 0.0
        for micro in range(GA):
            loss = engine(batch(step, micro, rank, world))
            engine.backward(loss)
            engine.step()
            total += loss.item()
        mean = torch.tensor(total / GA)
        engine.comm.all_reduce(mean)
        losses.append(mean.item() / world)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{engine.get_lr()[0]:.1e}")
    return losses


def say(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=["first", "resume"], required=True)
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    folder = Path(args.dir)
    engine = build_engine()
    if args.phase == "first":
        total = sum(p.numel() for p in engine.module.parameters())
        trainable = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
        held = engine.sharded_bytes()
        say(f"zero3 demo: {total:,} parameters ({trainable:,} LoRA, trainable) on {engine.world_size} ranks; "
            f"this rank holds {held['param_shards']:,} bytes of parameter shards + "
            f"{held['resident_params']:,} resident")
        losses = train(engine, 0, STEPS, "train")
        engine.save_checkpoint(folder, client_state={"losses": losses})
        say(f"saved checkpoint {folder / f'global_step{engine.global_steps}'} after {engine.global_steps} steps")
        engine.destroy()
        return
    path, client = engine.load_checkpoint(folder)
    say(f"new processes loaded {path}: global step {engine.global_steps}, losses so far "
        + ", ".join(f"{x:.4f}" for x in client["losses"]))
    resumed = train(engine, STEPS, STEPS, "resume")
    engine.destroy()
    reference = build_engine()
    straight = train(reference, 0, 2 * STEPS, "uninterrupted")
    reference.destroy()
    exact = client["losses"] + resumed == straight
    say("losses before save : " + ", ".join(f"{x:.6f}" for x in client["losses"]))
    say("losses after resume: " + ", ".join(f"{x:.6f}" for x in resumed))
    say("uninterrupted run  : " + ", ".join(f"{x:.6f}" for x in straight))
    say(f"late gathers: {reference.late_gathers}; losses decreased: {straight[-1] < straight[0]}")
    say("RESUME_EXACT: the resumed run is bit-identical to the uninterrupted one" if exact
        else "RESUME_MISMATCH: the resumed run differs from the uninterrupted one")
    if not exact:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
