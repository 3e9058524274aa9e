"""Parameters attached to the model after zero3.initialize ("late" parameters).

A module assigned after the engine exists (`engine.module.head = nn.Linear(...)`, a frozen
head, an adapter) behaves as it would in plain PyTorch with an optimizer built before the
attach:
- its parameters stay whole on every rank: never sharded, gathered, released or
  reduced; forward and backward use them as they are;
- the engine's optimizer does not step them (it was built without them); a trainable one
  gets `.grad` accumulated by autograd as usual, from this rank's backward only (nothing
  averages it across ranks, as DDP does not for a parameter it was built without), and
  nothing clears it but the user;
- their values are each rank's own: zero3 does not broadcast them (build or load them
  the same way on every rank);
- like the model's parameters at initialize, they are moved to the engine's device and
  floating ones cast to the compute dtype (buffers of their modules moved, dtype kept);
- rank 0 warns once (python `warnings`, UserWarning) naming them and saying how to have
  them trained: attach them before zero3.initialize;
- checkpoints save them whole (rank 0's shard file, `late/<name>`, listed in the
  manifest's `late_params`) and a load restores those present in both the model and
  the checkpoint; a late parameter the checkpoint does not hold is left as it is, and a
  saved one the model no longer has is skipped, each with a warning on rank 0.

The fetcher notices an assignment at once (TrackedAssignments, fetch.py) and calls
`LateParameters.adopt` before the next root forward; the checkpoint code finds them with
`unmanaged_parameters` at save and load time (no need for a forward in between).

Owns: the ids of the parameters already reported (so each is named once); no tensors.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping

import torch
from torch import nn


class LateParameterWarning(UserWarning):
    """Parameters attached after zero3.initialize are used but not trained by the engine."""


def unmanaged_parameters(root: nn.Module, table: Mapping[nn.Parameter, object]) -> dict[str, nn.Parameter]:
    """name -> parameter, for each parameter of `root` the engine does not manage (under
    the first name `named_parameters` gives it)."""
    return {name: p for name, p in root.named_parameters() if p not in table}


class LateParameters:
    """Places and reports the parameters attached after initialize."""

    def __init__(self, table: Mapping[nn.Parameter, object], device: torch.device,
                 compute_dtype: torch.dtype, rank: int) -> None:
        self.table = table
        self.device = device
        self.compute_dtype = compute_dtype
        self.rank = rank
        self._reported: set[int] = set()

    def adopt(self, root: nn.Module) -> dict[str, nn.Parameter]:
        """The model's structure changed: put the late parameters (and the buffers of the
        modules holding them) on the engine's device in the compute dtype, and name the new
        ones in a warning on rank 0. Returns every late parameter by name. No collective."""
        late = unmanaged_parameters(root, self.table)
        if not late:
            return late
        late_ids = {id(p) for p in late.values()}
        for module in root.modules():
            own = [p for p in module._parameters.values() if p is not None and id(p) in late_ids]
            if own:
                self._place(module, own)
        new = {name: p for name, p in late.items() if id(p) not in self._reported}
        self._reported.update(id(p) for p in new.values())
        if new and self.rank == 0:
            warnings.warn(late_message(new), LateParameterWarning, stacklevel=2)
        return late

    def _place(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        """As initialize does for the model: the device, and the compute dtype for floating
        parameters (in place: the nn.Parameter objects keep their identity)."""
        with torch.no_grad():
            for p in params:
                dtype = self.compute_dtype if p.is_floating_point() else p.dtype
                if p.device != self.device or p.dtype != dtype:
                    p.data = p.data.to(self.device, dtype)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.device:
                    module._buffers[name] = buffer.to(self.device)


def late_message(params: Mapping[str, nn.Parameter]) -> str:
    described = ", ".join(
        f"{name} {tuple(p.shape)}{'' if p.requires_grad else ' (frozen)'}" for name, p in params.items())
    return (
        f"zero3: parameters attached to the model after zero3.initialize: {described}. They are "
        "used whole on every rank in forward and backward, saved and loaded with checkpoints, but "
        "not sharded, not averaged across ranks and not stepped by the engine's optimizer (their "
        "values stay as they are; each rank keeps its own). To have them trained, attach the module "
        "before zero3.initialize."
    )


# ------------------------------------------------------------------ checkpoints
LATE_KEY = "late/"  # prefix of a late parameter's whole tensor in rank 0's shard file


def late_layout(root: nn.Module, table: Mapping[nn.Parameter, object]) -> dict[str, dict]:
    """The manifest's `late_params`: name -> {"shape", "dtype"} of each late parameter."""
    return {name: {"shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            for name, p in unmanaged_parameters(root, table).items()}


def restore_late(root: nn.Module, table: Mapping[nn.Parameter, object], saved: Mapping[str, dict],
                 read_whole: Callable[[str], torch.Tensor], rank: int) -> list[str]:
    """Load the saved values of the late parameters the model holds now (`saved`: the
    manifest's `late_params`). One the checkpoint lacks, or holds with another shape, is
    left as it is; a saved one the model lacks is skipped; rank 0 warns about both.
    Returns the names loaded. No collective: every rank reads rank 0's file."""
    late = unmanaged_parameters(root, table)
    loaded, kept = [], []
    for name, p in late.items():
        entry = saved.get(name)
        if entry is None or list(entry["shape"]) != list(p.shape):
            kept.append(f"{name} {tuple(p.shape)}" + ("" if entry is None else f" (saved {tuple(entry['shape'])})"))
            continue
        with torch.no_grad():
            p.copy_(read_whole(LATE_KEY + name))
        loaded.append(name)
    skipped = [name for name in saved if name not in late]
    if rank == 0 and (kept or skipped):
        warnings.warn(
            "zero3: load_checkpoint: parameters attached after zero3.initialize that the checkpoint does "
            f"not hold were left as they are: {kept or 'none'}; saved ones the model does not hold now "
            f"were skipped: {skipped or 'none'}. Attach the same modules before loading to restore them.",
            LateParameterWarning, stacklevel=3)
    return loaded
