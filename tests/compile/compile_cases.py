"""A small pre-norm transformer and the training loops the compile tests share.

Each check runs on every rank of one launch (the tests share it, since compiling is slow
on CPU) and returns plain values (losses, parameters, dynamo's counters) for the tests to
compare against the same run in eager mode.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, DEPTH, SEQ, MICRO = 48, 32, 4, 2, 8, 2
BACKEND = "aot_eager"


class Block(nn.Module):
    """Pre-norm attention and MLP; `foreign` (a callable giving a module outside the block,
    not a child) lets the block read a parameter of another unit once `read_foreign` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.foreign = None
        self.read_foreign = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, WIDTH)
        x = x + self.proj(attn)
        x = x + self.out(F.gelu(self.fc(self.n2(x))))
        if self.read_foreign:
            x = x + 0.1 * self.foreign().weight[:t].unsqueeze(0)
        return x


class Transformer(nn.Module):
    def __init__(self, checkpointing: str | None = None) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.checkpointing = checkpointing  # None, "reentrant" or "non_reentrant"
        for block in self.blocks:
            block.foreign = lambda: self.emb

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        for block in self.blocks:
            if self.checkpointing is None:
                h = block(h)
            else:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.checkpointing == "reentrant")
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())


def make_model(seed: int = 0, **kwargs) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(**kwargs)


def config(ga: int = 1, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": ga,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              **extra.pop("zero_optimization", {})},
        **extra,
    }


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def graphs() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def graph_breaks() -> dict:
    from torch._dynamo.utils import counters
    return dict(counters["graph_break"])


def build(mode: str, rank: int, model: nn.Module | None = None, backend: str = BACKEND, **config_extra):
    """An engine over a fresh model, compiled the way `mode` names (eager, block, wrapped, engine)."""
    import zero3

    model = model if model is not None else make_model()
    if mode == "block":
        for block in model.blocks:
            block.compile(backend=backend)
    if mode == "wrapped":
        model = torch.compile(model, backend=backend)
    engine, *_ = zero3.initialize(model=model, config=config(**config_extra))
    if mode == "engine":
        engine.compile(backend=backend)
    return engine


def train(engine, rank: int, steps, on_step=None) -> tuple[list[float], list[int]]:
    """Optimizer steps over `steps` (their indices): (losses, graphs compiled after each)."""
    losses, counts = [], []
    ga = engine.gradient_accumulation_steps()
    for step in steps:
        if on_step is not None:
            on_step(engine, step)
        for micro in range(ga):
            loss = engine(batch(rank, step * ga + micro))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        counts.append(graphs())
    return losses, counts


def parameters(engine) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in engine.state_dict().items()}
