"""Ulysses attention for Hugging Face models: DeepSpeed ALST's `UlyssesSPAttentionHF`.

Each rank of a sequence-parallel group holds a slice of every sequence (`seq / sp` tokens).
Around the core attention (sdpa, flash attention, flex attention: HF's attention functions)
two all-to-alls trade the slices for heads: before, every rank gets the *whole* sequence for
`heads / sp` of the query heads (and their key/value heads); after, the attention output
goes back to the sequence slices with all heads. Everything outside attention (projections,
MLP, norms, the loss) runs on the rank's slice alone.

Grouped-query attention: with at least `sp` key/value heads, each rank takes `kv / sp` of
them; with fewer (`sp % kv == 0`), each key/value head is repeated `sp / kv` times first, so
that every rank gets the one its query heads read. The core attention sees the attention
module through `_HeadView`, whose `num_key_value_groups` is the local ratio; the module
itself is not changed.

Positions: causal masking over the gathered sequence comes from the full position ids
(gathered from the group) and `is_causal`; HF's attention masks, made for the local slice,
are dropped (a 4-D mask of the full sequence would be O(seq^2)), as DeepSpeed does.

`register_with_transformers` installs the wrapper in place of the model's attention
implementation in `transformers`' `ALL_ATTENTION_FUNCTIONS` (the registry every HF model
reads at each call), makes the sequence-parallel groups, and returns DeepSpeed's `mpu`
(zero3/runtime/sequence_parallel/parallel_state_sp.py). `unregister_from_transformers` puts
the original back.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from zero3.platform import sequence_groups
from zero3.sequence.all_to_all import exchange

_UNSPLITTABLE = ("eager", "paged|eager")
_INSTALLED: dict[str, Any] = {}  # attention implementation -> the original function, while replaced


class _HeadView:
    """The attention module as the core attention sees it after the exchange: its own
    attributes, except `num_key_value_groups`, which is the local query/key-value ratio."""

    def __init__(self, module: torch.nn.Module, groups: int) -> None:
        self._module = module
        self.num_key_value_groups = groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class UlyssesSPAttentionHF(torch.nn.Module):
    """The Ulysses exchange around `attn` (an HF attention function), with DeepSpeed's
    constructor. Inputs are HF's `[batch, heads, seq_local, head_dim]`; the output is
    `[batch, seq_local, heads, head_dim]`, as HF's attention functions return."""

    def __init__(self, attn: Any, batch_size: int, attn_head_count: int, attn_head_size: int,
                 kv_head_count: int, num_hidden_layers: int, process_group: dist.ProcessGroup,
                 seq_length_is_variable: bool = False, local_seq_length: int | None = None,
                 global_seq_length: int | None = None, disable_in_eval: bool = False) -> None:
        super().__init__()
        self.attn, self.process_group = attn, process_group
        self.world_size = dist.get_world_size(process_group)
        self.sp_rank = dist.get_rank(process_group)
        self.batch_size, self.num_hidden_layers = batch_size, num_hidden_layers
        self.attn_head_count, self.attn_head_size, self.global_kv_head_count = attn_head_count, attn_head_size, kv_head_count
        self.seq_length_is_variable, self.disable_in_eval = seq_length_is_variable, disable_in_eval
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.core_attn_implementation: str | None = None
        check_heads(attn_head_count, kv_head_count, self.world_size)
        self.local_q_head_count = attn_head_count // self.world_size
        self.kv_replication_factor = max(1, self.world_size // kv_head_count)
        self.local_kv_head_count = max(1, kv_head_count // self.world_size)

    def forward(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Any, *args: Any, **kwargs: Any):
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_shapes(query, key)
        if kwargs.get("position_ids") is None:
            raise ValueError("Ulysses attention needs position_ids in every forward: each rank holds a slice of the "
                             "sequence, and its tokens' positions are not 0..len-1. Pass position_ids (the "
                             "UlyssesSPDataLoaderAdapter's batches carry them).")
        kwargs["position_ids"] = self._full_position_ids(kwargs["position_ids"])
        if self.kv_replication_factor > 1:
            key = key.repeat_interleave(self.kv_replication_factor, dim=1)
            value = value.repeat_interleave(self.kv_replication_factor, dim=1)
        # heads out, sequence in: [b, h, s/sp, d] -> [b, h/sp, s, d]
        query, key, value = (exchange(t, self.process_group, 1, 2) for t in (query, key, value))
        view = _HeadView(module, query.shape[1] // key.shape[1])
        output, weights = self.attn(view, query, key, value, None, *args, **kwargs)
        # sequence out, heads in: [b, s, h/sp, d] -> [b, s/sp, h, d]
        return exchange(output, self.process_group, 1, 2), weights

    def _check_shapes(self, query: torch.Tensor, key: torch.Tensor) -> None:
        local = query.shape[2]
        if not self.seq_length_is_variable and self.local_seq_length is not None and local != self.local_seq_length:
            raise ValueError(f"Ulysses attention: a local sequence of {local} tokens, and seq_length "
                             f"{self.global_seq_length} / sp {self.world_size} = {self.local_seq_length} was "
                             "registered. Pass seq_length_is_variable=True for sequences of varying length.")
        if query.shape[1] != self.attn_head_count or key.shape[1] != self.global_kv_head_count:
            raise ValueError(f"Ulysses attention: {query.shape[1]} query and {key.shape[1]} key/value heads reach "
                             f"attention, and {self.attn_head_count} and {self.global_kv_head_count} were registered. "
                             "Register with the model's own config.")

    def _full_position_ids(self, local: torch.Tensor) -> torch.Tensor:
        pieces = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(pieces, local.contiguous(), group=self.process_group)
        return torch.cat(pieces, dim=-1)

    @classmethod
    def register_with_transformers(cls, model_name_or_path: Any, core_attn_implementation: str,
                                   sequence_parallel_size: int, micro_batch_size: int,
                                   seq_length: int | None = None, seq_length_is_variable: bool = True,
                                   disable_in_eval: bool = False, max_length: int | None = None):
        """Replace `core_attn_implementation` in transformers' attention registry with its
        Ulysses wrapper and make the sequence-parallel groups; returns the `mpu`
        (None at sequence_parallel_size 1, when nothing is done)."""
        return register(cls, model_name_or_path, core_attn_implementation, sequence_parallel_size,
                        micro_batch_size, seq_length if seq_length is not None else max_length,
                        seq_length_is_variable, disable_in_eval)


def check_heads(heads: int, kv_heads: int, sp: int) -> None:
    """The head counts Ulysses can split over `sp` ranks (the same check on every rank)."""
    if heads % sp:
        raise ValueError(f"Ulysses sequence parallelism: {heads} attention heads do not split over "
                         f"sequence_parallel_size {sp}. Pick a degree that divides {heads}.")
    if kv_heads % sp and sp % kv_heads:
        raise ValueError(f"Ulysses sequence parallelism: {kv_heads} key/value heads and sequence_parallel_size "
                         f"{sp}: one must divide the other. Pick a degree that divides {kv_heads} or is a "
                         f"multiple of it.")


def register(cls: type, model: Any, implementation: str, sp: int, micro_batch_size: int,
             seq_length: int | None, variable: bool, disable_in_eval: bool):
    """`UlyssesSPAttentionHF.register_with_transformers`'s body."""
    from transformers import AutoConfig
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from zero3.runtime.sequence_parallel import parallel_state_sp

    if sp == 1:
        return None
    if not variable and seq_length is None:
        raise ValueError("register_with_transformers: pass seq_length (the fixed sequence length) or "
                         "seq_length_is_variable=True.")
    if implementation in _UNSPLITTABLE:
        raise ValueError(f"attn_implementation {implementation!r} cannot be split by Ulysses sequence parallelism: "
                         "it builds a 4-D attention mask of the whole sequence. Use \"sdpa\", "
                         "\"flash_attention_2\", \"flash_attention_3\" or \"flex_attention\".")
    config = model.config if hasattr(model, "config") else AutoConfig.from_pretrained(model)
    configured = getattr(config, "_attn_implementation", None)
    if configured is not None and configured != implementation:
        raise ValueError(f"core_attn_implementation={implementation!r} differs from the model config's "
                         f"attn_implementation={configured!r}. Load the model with "
                         f"attn_implementation={implementation!r}.")
    original = _INSTALLED.get(implementation)
    if original is None:
        if implementation not in ALL_ATTENTION_FUNCTIONS:
            raise ValueError(f"{implementation!r} is not an attention implementation of transformers "
                             f"(known: {ALL_ATTENTION_FUNCTIONS.valid_keys()}).")
        original = ALL_ATTENTION_FUNCTIONS[implementation]
    sequence_groups.initialize_sequence_parallel(sp)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    uattn = cls(attn=original, batch_size=micro_batch_size, attn_head_count=text.num_attention_heads,
                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                kv_head_count=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
                num_hidden_layers=text.num_hidden_layers, process_group=parallel_state_sp.get_sequence_parallel_group(),
                seq_length_is_variable=variable,
                local_seq_length=None if variable else seq_length // sp,
                global_seq_length=None if variable else seq_length, disable_in_eval=disable_in_eval)
    uattn.core_attn_implementation = implementation

    def ulysses_attention(module, query, key, value, attention_mask, *args, **kwargs):
        return uattn(module, query, key, value, attention_mask, *args, **kwargs)

    ulysses_attention.ulysses = uattn
    _INSTALLED[implementation] = original
    ALL_ATTENTION_FUNCTIONS[implementation] = ulysses_attention
    return parallel_state_sp


def installed() -> tuple[str, ...]:
    """The attention implementations replaced now."""
    return tuple(_INSTALLED)


def unregister_from_transformers(implementation: str | None = None) -> None:
    """Put back the original attention function(s) replaced by `register_with_transformers`."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in [implementation] if implementation is not None else list(_INSTALLED):
        original = _INSTALLED.pop(name, None)
        if original is not None:
            ALL_ATTENTION_FUNCTIONS[name] = original
