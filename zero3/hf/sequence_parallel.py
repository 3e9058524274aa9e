"""Ulysses sequence parallelism under the Trainer, as Transformers runs it with DeepSpeed
(`TrainingArguments(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=N))`).

- the config: `sequence_parallel_size` is N, and the batch arithmetic is over world / N
  (config_fill.py);
- the data: the training loader is wrapped in `UlyssesSPDataLoaderAdapter` (each group of N
  ranks shares its batches, each rank keeping its slice of every sequence), as Accelerate's
  `deepspeed_ulysses_dl_adapter` does; each batch must carry position_ids;
- the loss: each rank's model loss (the mean over its slice's labels) is combined into the
  sequences' loss, weighted by the non-ignored tokens of each slice (zero3/sequence/loss.py),
  as Transformers' `deepspeed_sp_compute_loss` does;
- attention: the engine installs Ulysses attention for the model's attention implementation
  when it is built (zero3/sequence/setup.py).
"""

from __future__ import annotations

from typing import Any

from zero3.platform import sequence_groups
from zero3.sequence.loader import UlyssesSPDataLoaderAdapter
from zero3.sequence.loss import sequence_parallel_loss


def sp_size_of(args: Any) -> int:
    """N of the arguments' ParallelismConfig with sp_backend "deepspeed" (1 without one)."""
    config = getattr(args, "parallelism_config", None)
    if config is None or getattr(config, "sp_backend", None) != "deepspeed":
        return 1
    return int(getattr(config, "sp_size", 1) or 1)


def wrap_loader(loader: Any, device: Any) -> Any:
    """The training loader cut along the sequence for this rank's group."""
    groups = sequence_groups.current()
    if groups is None:
        return loader
    return UlyssesSPDataLoaderAdapter(loader, sp_rank=groups.rank, sp_group=groups.group,
                                      sp_world_size=groups.size, device=device)


def compute_loss(model: Any, inputs: dict, return_outputs: bool) -> Any:
    """The model's loss over this rank's slice, combined over the group (the module docstring)."""
    if "labels" not in inputs and "shift_labels" in inputs:
        inputs = {**inputs, "labels": inputs["shift_labels"]}  # HF's loss reads shift_labels, needs labels set
    outputs = model(**inputs)
    loss = sequence_parallel_loss(outputs.loss, inputs["shift_labels"])
    return (loss, outputs) if return_outputs else loss
