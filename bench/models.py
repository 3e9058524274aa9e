"""Models for the benchmarks.

Every model's ``forward(tokens)`` takes a ``(batch, seq + 1)`` tensor of token ids and
returns the mean next-token cross-entropy loss (inputs ``tokens[:, :-1]``, targets
``tokens[:, 1:]``), so that an engine's ``engine(tokens)`` is the whole forward pass.
``blocks()`` lists the repeated layers (the units FSDP2 shards one by one).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not divisible by heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """GPT-style decoder: token embedding + learned positions, N pre-LN blocks, final LN,
    untied lm head. fp32 unless the caller casts it."""

    def __init__(self, vocab: int = 8192, width: int = 128, layers: int = 8,
                 heads: int | None = None, seq: int = 128):
        super().__init__()
        heads = heads or max(1, width // 64)
        self.seq = seq
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self._init_weights(layers)

    def _init_weights(self, layers: int) -> None:
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02
                if name.endswith("proj.weight"):  # GPT-2's scaled residual init
                    std = 0.02 / math.sqrt(2 * layers)
                nn.init.normal_(p, mean=0.0, std=std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def blocks(self) -> list[nn.Module]:
        return list(self.h)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        t = inputs.shape[1]
        pos = torch.arange(t, device=inputs.device)
        x = self.wte(inputs) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))


class LlamaLM(nn.Module):
    """A transformers ``LlamaForCausalLM`` (random weights, built from a config, no hub
    access) wrapped so that ``forward(tokens)`` returns the loss like ``GPT``."""

    def __init__(self, vocab: int, hidden: int, layers: int, intermediate: int,
                 heads: int, kv_heads: int | None, seq: int):
        super().__init__()
        try:
            from transformers import LlamaConfig, LlamaForCausalLM
        except ImportError as e:  # optional dependency
            raise ImportError("--model llama needs transformers "
                              "(WITH_HF=1 bash bench/setup.sh)") from e
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                          intermediate_size=intermediate, num_attention_heads=heads,
                          num_key_value_heads=kv_heads or heads,
                          max_position_embeddings=seq, tie_word_embeddings=False,
                          use_cache=False)
        cfg._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(cfg)

    def blocks(self) -> list[nn.Module]:
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm  # under PEFT
        return list(base.model.layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = self.lm(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                               targets.reshape(-1))


def build_model(args) -> nn.Module:
    """Build the model named by ``args.model`` in fp32 (callers move/cast): on the CPU, or,
    with ``--build-on device``, directly on ``args.device`` (the current CUDA device), where
    a 7B model's random initialisation takes seconds instead of minutes of CPU time."""
    where = args.device if getattr(args, "build_on", "cpu") == "device" else "cpu"
    with torch.device(where):
        return _build(args)


def count_parameters(args) -> int:
    """The parameter count of ``build_model(args)`` (as a caller may have wrapped it, adapters
    included), built on the meta device: no memory, no initialisation."""
    on_meta = argparse.Namespace(**{**vars(args), "device": "meta", "build_on": "device"})
    return sum(p.numel() for p in build_model(on_meta).parameters())


def _build(args) -> nn.Module:
    if args.model == "gpt":
        return GPT(vocab=args.vocab, width=args.width, layers=args.layers,
                   heads=args.heads, seq=args.seq)
    if args.model == "llama":
        heads = args.heads or max(1, args.width // 64)
        return LlamaLM(vocab=args.vocab, hidden=args.width, layers=args.layers,
                       intermediate=args.intermediate or 4 * args.width, heads=heads,
                       kv_heads=args.kv_heads, seq=args.seq)
    raise ValueError(f"unknown model {args.model!r}")
