"""What the engine does at initialize for long sequences (on every rank, before the model
is sharded): the sequence-parallel groups of `sequence_parallel_size`, Ulysses attention for
a Hugging Face model whose attention is not yet registered (so a config key turns it on, with
no call in the script), and the `long_sequence` section's pieces (long_context.py)."""

from __future__ import annotations

from typing import Any

from torch import nn

from zero3.config import Zero3Config
from zero3.nvme.io import IssueSettings
from zero3.platform import sequence_groups
from zero3.sequence import long_context, ulysses
from zero3.sequence.hidden_spill import SpillSettings


def settings_of(config: Zero3Config) -> long_context.LongSequenceSettings:
    section, aio = config.long_sequence, config.aio
    spill = None
    if section.nvme_path is not None:
        spill = SpillSettings(section.nvme_path, IssueSettings(aio.block_size, aio.queue_depth, aio.intra_op_parallelism,
                                                               aio.single_submit, aio.overlap_events))
    return long_context.LongSequenceSettings(
        tiled_mlp=section.tiled_mlp, mlp_tiles=section.mlp_tiles, tiled_loss=section.tiled_loss,
        loss_tile_bytes=section.loss_tile_bytes or long_context.DEFAULT_LOSS_TILE_BYTES,
        offload_hidden_states=section.offload_hidden_states, host_bytes=section.host_bytes, spill=spill)


def prepare(model: Any, config: Zero3Config) -> long_context.LongSequenceState | None:
    """Groups, attention and the section's pieces for `model`; returns what to revert at destroy."""
    if config.sequence_parallel_size > 1:
        sequence_groups.initialize_sequence_parallel(config.sequence_parallel_size)
        if isinstance(model, nn.Module):
            _register_hf_attention(model, config)
    if not isinstance(model, nn.Module):
        return None
    return long_context.apply(model, settings_of(config))


def _register_hf_attention(model: nn.Module, config: Zero3Config) -> None:
    hf_config = getattr(model, "config", None)
    implementation = getattr(hf_config, "_attn_implementation", None)
    if implementation is None or implementation in ulysses.installed():
        return
    ulysses.UlyssesSPAttentionHF.register_with_transformers(
        model, implementation, config.sequence_parallel_size, config.train_micro_batch_size_per_gpu)
