"""Small models, data and a plain-PyTorch reference for the engine tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(torch.tanh(self.linear(self.norm(x))))


class Net(nn.Module):
    """Uneven parameter sizes (7 x 13 input layer, 5-way head), a frozen block, biases."""

    def __init__(self, inputs: int = 13, width: int = 24, depth: int = 3, outputs: int = 5,
                 dropout: float = 0.0, freeze_block: int | None = 1) -> None:
        super().__init__()
        self.embed = nn.Linear(inputs, width)
        self.blocks = nn.ModuleList(Block(width, dropout) for _ in range(depth))
        self.head = nn.Linear(width, outputs)
        if freeze_block is not None:
            self.blocks[freeze_block].requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return F.mse_loss(self.head(h), y)


class Chain(nn.Module):
    """Three bias-free layers of uneven sizes (221, 187 and 33 elements): every parameter
    partitioned, easy arithmetic for distances and bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(13, 17, bias=False)
        self.l2 = nn.Linear(17, 11, bias=False)
        self.l3 = nn.Linear(11, 3, bias=False)

    def forward(self, x):
        return self.l3(torch.relu(self.l2(torch.relu(self.l1(x))))).square().mean()


def make_model(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def make_batches(count: int, micro_batch: int, inputs: int = 13, outputs: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(micro_batch, inputs, generator=g), torch.randn(micro_batch, outputs, generator=g))
            for _ in range(count)]


def two_param_groups(model: nn.Module, lr: float = 1e-2) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and n.endswith("weight") and p.dim() > 1]
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not (n.endswith("weight") and p.dim() > 1)]
    return [{"params": decay, "lr": lr, "weight_decay": 0.1},
            {"params": rest, "lr": lr / 2, "weight_decay": 0.0}]


def batch_index(step: int, micro: int, rank: int, ga: int, world: int) -> int:
    """The global batch of optimizer step `step` is split over micro-steps and ranks."""
    return (step * ga + micro) * world + rank


def reference_training(steps: int, ga: int, world: int, micro_batch: int, lr: float = 1e-2,
                       model_kwargs: dict | None = None):
    """Plain single-process PyTorch on the same global batches: (losses, state_dict).

    losses[(step, micro, rank)] is the loss of the micro-batch that rank would see.
    """
    model = make_model(**(model_kwargs or {}))
    optimizer = torch.optim.AdamW(two_param_groups(model, lr))
    batches = make_batches(steps * ga * world, micro_batch)
    losses = {}
    for step in range(steps):
        for micro in range(ga):
            for rank in range(world):
                x, y = batches[batch_index(step, micro, rank, ga, world)]
                loss = model(x, y)
                (loss / (ga * world)).backward()
                losses[(step, micro, rank)] = loss.item()
        optimizer.step()
        optimizer.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def config(micro_batch: int, ga: int, threshold: int = 30, **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold, **zero},
    }


def train_windows(engine, rank: int, world: int, first: int, last: int, ga: int, micro: int, steps: int) -> list[float]:
    """Optimizer steps `first` to `last` (each `ga` micro-steps) on this rank's slice of
    `make_batches(steps * ga * world, micro)`; the losses of every micro-step."""
    batches = make_batches(steps * ga * world, micro)
    losses = []
    for step in range(first, last):
        for index in range(ga):
            x, y = batches[(step * ga + index) * world + rank]
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def optimizer_tensors(engine) -> dict[str, torch.Tensor]:
    """Copies of every master, its optimizer state and its shard, by parameter name (after
    the update in flight)."""
    opt = engine.optimizer
    opt.wait()
    out = {}
    for sp, master in zip(opt.params, opt.masters):
        out[sp.name] = master.clone()
        for key, value in opt.optimizer.state[master].items():
            out[f"{sp.name}/{key}"] = value.clone()
        out[f"{sp.name}/shard"] = sp.shard.clone()
    return out
