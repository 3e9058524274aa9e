"""Activation bytes of a decoder-only transformer at one sequence length, per rank.

A model of what training a causal LM holds besides its state, by the pieces the
`long_sequence` section changes, so that `zero3 estimate --seq` (and a user choosing the
section's keys) sees how memory grows with the sequence. `T` below is a rank's tokens:
micro-batch x seq / sequence_parallel_size; `w` the compute dtype's width.

- checkpointed layer inputs: one `T x hidden` tensor per decoder layer (HF gradient
  checkpointing keeps them on the device; `offload_hidden_states` keeps them on the host);
  without any checkpointing every layer's intermediates stay (`layer_working` each);
- one layer's working set in its backward (the recomputation and its gradients): the
  residual stream and its gradient (4 `T x hidden`), the query, key, value and attention
  output with their gradients (after the Ulysses exchange the same numbers of elements:
  2 x T x (2 hidden + 2 kv_hidden)), and the MLP's gate, up and product with gradients
  (6 x T x intermediate), or 6 x tile x intermediate with `tiled_mlp` (tile: hidden tokens
  unless `mlp_tiles` says otherwise);
- the loss: fp32 logits, their softmax gradient and the compute-dtype logits (T x vocab x
  (8 + w)), or one tile's with `tiled_loss` (`loss_tile_bytes` x 2 plus a tile's compute-dtype
  logits). The loss's tensors are gone before the layers' backward starts, so the device peak
  is what is kept plus the larger of the two (without checkpointing: every layer's working set
  plus the loss).

It is an upper-bound style count of the large tensors (attention kernels' own scratch, which
flash/efficient sdpa keep O(T), and allocator fragmentation are not in it); the engine's
automatic budget measures the real reserve in its first window regardless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only causal LM that activations depend on."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def kv_hidden(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    @classmethod
    def of_hf_config(cls, config) -> "ModelShape":
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(layers=text.num_hidden_layers, hidden=text.hidden_size, intermediate=text.intermediate_size,
                   heads=text.num_attention_heads,
                   kv_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                   vocab=text.vocab_size)


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes per rank: on the device at the peak (one layer's backward plus what is kept),
    and on the host (the offloaded layer inputs)."""

    tokens: int
    kept_inputs: int
    layer_working: int
    loss: int
    device: int
    host: int


def estimate_activations(shape: ModelShape, seq: int, micro_batch: int = 1, width: int = 2,
                         sequence_parallel: int = 1, checkpointing: bool = True, tiled_mlp: bool = False,
                         mlp_tiles: int | None = None, tiled_loss: bool = False, loss_tile_bytes: int = 1 << 30,
                         offload_hidden_states: bool = False) -> ActivationEstimate:
    """The module docstring's count. `checkpointing`: HF gradient checkpointing (or
    `offload_hidden_states`, which checkpoints too)."""
    tokens = micro_batch * seq // sequence_parallel
    h = shape.hidden
    inputs = shape.layers * tokens * h * width
    mlp_tokens = tokens if not tiled_mlp else math.ceil(tokens / (mlp_tiles or max(1, math.ceil(tokens / h))))
    working = (4 * tokens * h + 2 * tokens * (2 * h + 2 * shape.kv_hidden) + 6 * mlp_tokens * shape.intermediate) * width
    if tiled_loss:
        tile_tokens = max(1, loss_tile_bytes // (4 * shape.vocab))
        loss = 2 * loss_tile_bytes + min(tile_tokens, tokens) * shape.vocab * width
    else:
        loss = tokens * shape.vocab * (8 + width)
    checkpointed = checkpointing or offload_hidden_states
    kept_on_device = 0 if offload_hidden_states else (inputs if checkpointed else shape.layers * working)
    return ActivationEstimate(tokens=tokens, kept_inputs=inputs, layer_working=working, loss=loss,
                              device=kept_on_device + (max(working, loss) if checkpointed else loss),
                              host=inputs if offload_hidden_states else 0)
