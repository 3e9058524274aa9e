"""The config's `long_sequence` section applied to a Hugging Face causal LM.

Three independent pieces, each turned on by its key, each changing no value beyond rounding:
- `tiled_mlp`: every decoder layer's MLP runs over tiles of its tokens (sequence/tiled.py's
  TiledMLP): the 3.5x-wide intermediates of one tile at a time. Tiles: `mlp_tiles`, or
  "auto": ceil(tokens / hidden_size), ALST's rule, from the token count that every rank agrees
  on at the start of each forward (the largest), so all ranks run the same number of tiles.
- `tiled_loss`: with labels (or shift_labels), the CausalLM's forward computes the hidden
  states, then the loss over tiles of tokens (TiledFusedLogitsLoss): never more than one tile
  of logits (`loss_tile_bytes` of fp32 logits a tile, 1 GiB by default). The loss is HF's
  (`ForCausalLMLoss`: mean over non-ignored shifted labels, or the sum over
  `num_items_in_batch`), the output's `logits` None. Without labels (generation, evaluation
  asking for logits) the model's own forward runs.
- `offload_hidden_states`: every decoder layer is checkpointed with its input on the host
  (sequence/host_checkpoint.py), up to `host_bytes`, the earliest layers' inputs beyond it in
  swap files under `nvme_path` (sequence/hidden_spill.py); it takes the place of HF gradient
  checkpointing for those layers (GradientCheckpointingLayer's own checkpoint is bypassed,
  not stacked).

How: the module's class is swapped for a subclass made once per class (the way FSDP2's
`fully_shard` changes a module's class), whose `forward` adds the piece and then runs the
original; parameters, names, state dicts and hooks are untouched, and `revert` puts the
classes back. A model with none of the known shapes (no decoder layer list, an MLP with
experts, logits post-processing such as soft-capping) is refused for the piece asked for,
naming the module and the fix.
"""

from __future__ import annotations

import contextvars
import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from zero3.sequence.hidden_spill import SpillSettings
from zero3.sequence.host_checkpoint import HostStore, checkpoint_on_host
from zero3.sequence.tiled import TiledFusedLogitsLoss, TiledMLP

IGNORE_INDEX = -100
DEFAULT_LOSS_TILE_BYTES = 1 << 30
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("zero3_recomputing_layer", default=False)
_SWAPPED_CLASSES: dict[tuple[type, str], type] = {}
_STATES: "weakref.WeakKeyDictionary[nn.Module, LongSequenceState]" = weakref.WeakKeyDictionary()
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class LongSequenceError(ValueError):
    """A long_sequence setting that this model's shape cannot take."""


@dataclass
class LongSequenceSettings:
    """The `long_sequence` section (config.py), resolved against one model."""

    tiled_mlp: bool = False
    mlp_tiles: int | None = None          # None: "auto"
    tiled_loss: bool = False
    loss_tile_bytes: int = DEFAULT_LOSS_TILE_BYTES
    offload_hidden_states: bool = False
    host_bytes: int | None = None         # None: "auto"
    spill: SpillSettings | None = None    # the NVMe tier of the hidden states, or none

    @property
    def any(self) -> bool:
        return self.tiled_mlp or self.tiled_loss or self.offload_hidden_states


@dataclass
class LongSequenceState:
    """What `apply` changed, shared by the swapped modules of one model."""

    settings: LongSequenceSettings
    hidden_size: int
    agreed_tokens: int = 0
    store: HostStore | None = None
    swapped: list[tuple[nn.Module, type]] | None = None

    def mlp_tiles(self, tokens: int) -> int:
        if self.settings.mlp_tiles is not None:
            return self.settings.mlp_tiles
        return max(1, math.ceil(max(tokens, self.agreed_tokens) / self.hidden_size))


def _swap(module: nn.Module, mixin: type, state: LongSequenceState, swapped: list) -> None:
    base = type(module)
    key = (base, mixin.__name__)
    cls = _SWAPPED_CLASSES.get(key)
    if cls is None:
        cls = type(f"{mixin.prefix}{base.__name__}", (mixin, base), {})
        _SWAPPED_CLASSES[key] = cls
    swapped.append((module, base))
    module.__class__ = cls
    _STATES[module] = state  # read by the mixin's forward; dropped by revert


class _TiledMLPMixin:
    prefix = "Tiled"
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        state = _STATES[self]
        if args or kwargs:
            return super().forward(x, *args, **kwargs)
        tokens = x.numel() // x.shape[-1]
        base_forward = super().forward
        return TiledMLP.apply(lambda module, tile: base_forward(tile), self, x, state.mlp_tiles(tokens), None)


class _HostCheckpointMixin:
    prefix = "HostCheckpointed"
    __call__ = nn.Module.__call__  # not GradientCheckpointingLayer's: this layer checkpoints itself

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        state = _STATES[self]
        base_forward = super().forward
        if _RECOMPUTING.get() or not (torch.is_grad_enabled() and self.training):
            return base_forward(hidden_states, *args, **kwargs)
        kwargs = _without_cache(kwargs)

        def recompute(hidden: torch.Tensor) -> Any:
            token = _RECOMPUTING.set(True)
            try:
                return self(hidden, *args, **kwargs)  # through the module's hooks (the engine's gathers)
            finally:
                _RECOMPUTING.reset(token)

        return checkpoint_on_host(lambda hidden: base_forward(hidden, *args, **kwargs), recompute,
                                  hidden_states, state.store)


def _without_cache(kwargs: dict) -> dict:
    """A checkpointed layer runs twice: a KV cache would take its keys twice (as HF's
    GradientCheckpointingLayer, training drops the cache)."""
    kwargs = dict(kwargs)
    for key in ("past_key_values", "past_key_value", "layer_past"):
        if kwargs.get(key) is not None:
            kwargs[key] = None
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    return kwargs


class _TiledLossMixin:
    prefix = "TiledLoss"
    def forward(self, input_ids: Any = None, attention_mask: Any = None, position_ids: Any = None,
                past_key_values: Any = None, inputs_embeds: Any = None, labels: Any = None,
                use_cache: Any = None, logits_to_keep: Any = 0, **kwargs: Any) -> Any:
        state = _STATES[self]
        shift_labels = kwargs.pop("shift_labels", None)
        num_items = kwargs.pop("num_items_in_batch", None)
        _agree_tokens(state, input_ids if input_ids is not None else inputs_embeds)
        if not state.settings.tiled_loss or (labels is None and shift_labels is None):
            kwargs.update({k: v for k, v in (("shift_labels", shift_labels), ("num_items_in_batch", num_items))
                           if v is not None})
            return super().forward(labels=labels, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                   use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             **kwargs)
        targets = shift_labels if shift_labels is not None else _shifted(labels)
        loss = tiled_causal_lm_loss(self.lm_head, outputs.last_hidden_state, targets, state.settings.loss_tile_bytes,
                                    self.config.get_text_config().vocab_size, num_items)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        return CausalLMOutputWithPast(loss=loss, logits=None, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states, attentions=outputs.attentions)


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()


def _agree_tokens(state: LongSequenceState, tokens_of: Any) -> None:
    """The largest token count of this forward over all ranks (one small all-reduce), so the
    automatic MLP tile count is the same everywhere."""
    if tokens_of is None or not state.settings.tiled_mlp or state.settings.mlp_tiles is not None:
        return
    tokens = tokens_of.shape[0] * tokens_of.shape[1]
    if dist.is_initialized() and dist.get_world_size() > 1:
        count = torch.tensor([tokens], dtype=torch.int64, device=tokens_of.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        tokens = int(count.item())
    state.agreed_tokens = tokens


def _tile_loss(lm_head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = lm_head(hidden).float()
    return torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")


def tiled_causal_lm_loss(lm_head: nn.Module, hidden: torch.Tensor, shift_labels: torch.Tensor, tile_bytes: int,
                         vocab_size: int, num_items_in_batch: Any = None) -> torch.Tensor:
    """HF's causal-LM loss of `lm_head(hidden)` against `shift_labels`, over tiles of tokens
    of at most `tile_bytes` of fp32 logits: the sum of the token losses over
    `num_items_in_batch`, or over the non-ignored tokens (their mean)."""
    tokens = hidden.shape[0] * hidden.shape[1]
    tiles = max(1, math.ceil(tokens * vocab_size * 4 / tile_bytes))
    total = TiledFusedLogitsLoss.apply(lambda head, x, y: _tile_loss(head, x, y), lm_head, hidden,
                                       shift_labels.to(hidden.device), None, tiles, None, "sum")
    if num_items_in_batch is None:
        count = (shift_labels != IGNORE_INDEX).sum()
    else:
        count = num_items_in_batch
    if torch.is_tensor(count):
        count = count.to(total.device)
    return total / count


def _causal_lm(model: nn.Module) -> nn.Module | None:
    """The module that owns `lm_head` and the decoder (`model`): the model, or inside a PEFT wrapper."""
    for module in model.modules():  # its own children, not a wrapper's forwarded attributes
        if "lm_head" in module._modules and "model" in module._modules and hasattr(module, "config"):
            return module
    return None


def _decoder_layers(causal_lm: nn.Module) -> list[nn.Module]:
    decoder = causal_lm.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise LongSequenceError(f"long_sequence: {type(decoder).__name__} has no `layers` list of decoder layers. "
                                "Turn off tiled_mlp and offload_hidden_states for this model.")
    return list(layers)


def _mlp_of(layer: nn.Module) -> nn.Module:
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        raise LongSequenceError(f"long_sequence.tiled_mlp: {type(layer).__name__} has no `mlp` submodule. "
                                "Turn off tiled_mlp for this model.")
    if hasattr(mlp, "experts") or hasattr(mlp, "gate") and not hasattr(mlp, "gate_proj"):
        raise LongSequenceError(f"long_sequence.tiled_mlp: {type(mlp).__name__} routes tokens to experts; tiling "
                                "it is not supported. Turn off tiled_mlp for this model.")
    return mlp


def _check_plain_logits(causal_lm: nn.Module) -> None:
    config = causal_lm.config.get_text_config()
    for name in _LOGIT_POSTPROCESSING:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0, False, 0):
            raise LongSequenceError(f"long_sequence.tiled_loss: {type(causal_lm).__name__} post-processes its logits "
                                    f"({name}={value}), which the tiled loss does not reproduce. Turn off tiled_loss "
                                    "for this model.")


def apply(model: nn.Module, settings: LongSequenceSettings) -> LongSequenceState | None:
    """Install the pieces `settings` asks for on `model` (nothing when it asks for none)."""
    if not settings.any:
        return None
    causal_lm = _causal_lm(model)
    if causal_lm is None:
        raise LongSequenceError(f"long_sequence: {type(model).__name__} is not a Hugging Face causal LM (no module "
                                "with lm_head and model). The section applies to such models; for others call "
                                "zero3.runtime.sequence_parallel.ulysses_sp's TiledMLP / TiledFusedLogitsLoss in "
                                "the model's code.")
    hidden = causal_lm.config.get_text_config().hidden_size
    if settings.tiled_loss:
        _check_plain_logits(causal_lm)
    layers = _decoder_layers(causal_lm) if settings.tiled_mlp or settings.offload_hidden_states else []
    store = HostStore(len(layers), settings.host_bytes, settings.spill) if settings.offload_hidden_states else None
    state = LongSequenceState(settings=settings, hidden_size=hidden, store=store, swapped=[])
    mlps = [_mlp_of(layer) for layer in layers] if settings.tiled_mlp else []
    for mlp in mlps:
        _swap(mlp, _TiledMLPMixin, state, state.swapped)
    if settings.offload_hidden_states:
        for layer in layers:
            _swap(layer, _HostCheckpointMixin, state, state.swapped)
    if settings.tiled_loss or settings.tiled_mlp:
        _swap(causal_lm, _TiledLossMixin, state, state.swapped)
    return state


def revert(state: LongSequenceState | None) -> None:
    """Put every swapped module's class back and end the host store (its NVMe files removed)."""
    if state is None:
        return
    if state.store is not None:
        state.store.close()
    if not state.swapped:
        return
    for module, base in reversed(state.swapped):
        module.__class__ = base
        _STATES.pop(module, None)
    state.swapped = []
