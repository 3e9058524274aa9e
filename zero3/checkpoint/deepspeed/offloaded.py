"""DeepSpeed ZeRO-3 checkpoints saved with `offload_optimizer.device: "nvme"`: the swapped
optimizer state put back into the loaded optimizer files.

What DeepSpeed 0.19.x writes then (read from its engine's save path and its optimizer
swapper): `zero_pp_rank_{r}_mp_rank_00_optim_states.pt` as usual, except that every sub-group
its swapper held on NVMe has an empty fp32 flat in `fp32_flat_groups` and empty tensors for its
swapped optimizer state (the storage was released at the save); the real values are the swap
files themselves, copied under `<tag>/offloaded_tensors/rank{r:02d}/`:
  `{first}_{last}.tensor.swp`          the sub-group's fp32 master flat
  `{key}-{first}_{last}.tensor.swp`    its optimizer state `key` (exp_avg, exp_avg_sq, ...)
where first and last are the ids of the sub-group's first and last parameters (so the files,
ordered by first id, follow the sub-groups in flat order), each file a raw fp32 array
possibly padded past the flat's length for I/O alignment. Gradient swap files in the same
folder are skipped.

`fill_offloaded` replaces those empty tensors with the files' values (the first n elements),
so the checks and reads of layout.py see an ordinary checkpoint; a missing or short file is a
DeepSpeedCheckpointError naming it. Memory: each file is read with `torch.from_file` into a
tensor the loaded state then holds (not memory-mapped).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from zero3.checkpoint.deepspeed.unpickle import DeepSpeedCheckpointError

OFFLOADED = "offloaded_tensors"
_MASTER = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")


def saved_with_nvme(config: Any) -> bool:
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    section = zero.get("offload_optimizer") if isinstance(zero, dict) else None
    return isinstance(section, dict) and section.get("device") == "nvme"


def fill_offloaded(folder: Path, optims: list[dict], expected: list[int]) -> None:
    """Each rank's swapped sub-groups (empty flats where `expected[i]` elements belong)
    filled from `folder/offloaded_tensors/rank{r:02d}/`."""
    for rank, optim in enumerate(optims):
        state = optim["optimizer_state_dict"]
        flats = state.get("fp32_flat_groups")
        if not isinstance(flats, list):
            continue
        swapped = [i for i, flat in enumerate(flats) if flat.numel() == 0 and expected[i] > 0]
        if not swapped:
            continue
        source = folder / OFFLOADED / f"rank{rank:02d}"
        names = _master_files(source, len(swapped))
        inner = state.get("optimizer_state_dict", {})
        indices = [i for group in inner.get("param_groups", []) for i in group.get("params", [])]
        for index, stem in zip(swapped, names):
            flats[index] = _read(source / f"{stem}.tensor.swp", expected[index])
            entry = inner.get("state", {}).get(indices[index], {}) if index < len(indices) else {}
            for key, value in list(entry.items()):
                if isinstance(value, torch.Tensor) and value.numel() == 0:
                    entry[key] = _read(source / f"{key}-{stem}.tensor.swp", expected[index])


def _master_files(source: Path, count: int) -> list[str]:
    """The `{first}_{last}` stems of the master swap files, in sub-group order."""
    if not source.is_dir():
        raise DeepSpeedCheckpointError(
            f"{source}: missing; the checkpoint was saved with offload_optimizer.device 'nvme' and its "
            f"optimizer files hold {count} sub-groups without values, which DeepSpeed copies there")
    found = sorted((int(m.group(1)), int(m.group(2))) for m in map(_MASTER.match, (p.name for p in source.iterdir()))
                   if m is not None)
    if len(found) != count:
        raise DeepSpeedCheckpointError(
            f"{source}: {len(found)} master swap files ({{first}}_{{last}}.tensor.swp), the optimizer file has "
            f"{count} sub-groups without values")
    return [f"{first}_{last}" for first, last in found]


def _read(path: Path, numel: int) -> torch.Tensor:
    if not path.is_file():
        raise DeepSpeedCheckpointError(f"{path}: missing (a swapped optimizer tensor of this NVMe-offloaded save)")
    size = path.stat().st_size
    if size < numel * 4:
        raise DeepSpeedCheckpointError(f"{path}: {size} bytes, the sub-group needs {numel} fp32 values "
                                       f"({numel * 4} bytes)")
    return torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32)
