"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`, as DeepSpeed defines it."""

from __future__ import annotations

from typing import Any

import torch


def clone_tensors_for_torch_save(item: Any, device: torch.device = torch.device("cpu")) -> Any:
    """A copy of `item` whose tensors are detached clones on `device`, so that `torch.save`
    writes each tensor's own values, not the whole storage a view shares; lists, tuples
    and dicts are copied recursively, anything else is returned as it is. The clones are
    the caller's."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)({k: clone_tensors_for_torch_save(v, device) for k, v in item.items()})
    return item
