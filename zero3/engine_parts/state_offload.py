"""DeepSpeed's `engine.offload_states()` / `reload_states()`: the training state moved off the
accelerator between steps (RLHF loops free the GPU for generation) and back, exactly.

The kinds are DeepSpeed's `OffloadStateTypeEnum` values, mapped onto zero3's tensors:
- `hp_params`: the fp32 master shards (the sharded optimizer's);
- `optim_states`: the optimizer's state tensors (Adam's moments, step counters);
- `lp_params`: the compute-dtype parameter shards (`ShardedParam.shard`). A parameter that is
  its own shard (world size 1 without collectives, where nothing is sharded) is the model's
  weight itself and stays;
- `lp_grads`: gradient shards held inside an accumulation window;
- `contiguous_grad_buffer`: DeepSpeed's persistent reduce buckets; zero3's buckets live only
  while a backward reduces, so there is nothing to move.

Each tensor keeps its identity (`tensor.data` is replaced), so the optimizer's state keys,
shadow optimizers and views held by the owners stay valid; the devices it came from are kept
here until `reload`. While anything is offloaded, the engine refuses forward, backward and
step (`EngineUsageError` naming the kinds and `reload_states()`); saving a checkpoint reads
the values wherever they are. An update still in flight is waited for first.

Ownership: the tensors stay their owners'; this object holds references to the ones it moved
until they are back.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

import torch

from zero3.engine_parts.views import OptimizerAccess, ShardedModel

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


class StateOffloadError(ValueError):
    """offload_states was given a kind or device zero3 does not know."""


class StateOffload:
    """Moves the engine's state kinds to the host and back; remembers where they were."""

    def __init__(self, model: ShardedModel, optimizer: OptimizerAccess) -> None:
        self.model = model
        self.optimizer = optimizer
        self.offloaded: set[str] = set()
        self._moved: list[tuple[torch.Tensor, torch.device]] = []

    def offload(self, include: Container | None, device: object, pin_memory: bool, non_blocking: bool) -> None:
        """The kinds in `include` (all when None) to the host; a kind already offloaded stays."""
        if _value(device) != "cpu":
            raise StateOffloadError(f"offload_states(device={_value(device)!r}): zero3 offloads to the CPU "
                                    "only; pass device='cpu' (OffloadDeviceEnum.cpu)")
        target = torch.device("cpu")
        kinds = [k for k in KINDS if (include is None or _contains(include, k)) and k not in self.offloaded]
        _check_kinds(include)
        self.optimizer.settle()
        pin = pin_memory and torch.cuda.is_available()
        seen = {id(t) for t, _ in self._moved}
        for kind in kinds:
            for tensor in self._tensors_of(kind):
                if id(tensor) not in seen and tensor.device != target:
                    seen.add(id(tensor))
                    self._moved.append((tensor, tensor.device))
                    _move(tensor, target, pin, non_blocking)
            self.offloaded.add(kind)

    def reload(self, non_blocking: bool) -> None:
        """Everything offloaded back where it was."""
        for tensor, device in self._moved:
            _move(tensor, device, False, non_blocking)
        self._moved = []
        self.offloaded = set()

    def _tensors_of(self, kind: str) -> Iterable[torch.Tensor]:
        table = self.model.table
        if kind == "hp_params":
            return [master for _, master in self.optimizer.stepped()]
        if kind == "optim_states":
            return [v for state in self.optimizer.state().values() for v in state.values()
                    if isinstance(v, torch.Tensor)]
        if kind == "lp_params":
            return [sp.shard for sp in table.values() if not sp.aliased and sp.backing is None]  # NVMe: files
        if kind == "lp_grads":
            return [sp.grad_shard for sp in table.values() if sp.grad_shard is not None]
        return []  # contiguous_grad_buffer: no persistent buckets


def _move(tensor: torch.Tensor, device: torch.device, pin: bool, non_blocking: bool) -> None:
    with torch.no_grad():
        moved = tensor.detach().to(device, non_blocking=non_blocking and not pin)
        if pin and device.type == "cpu":
            moved = moved.pin_memory()
        tensor.data = moved


def _value(item: object) -> str:
    return str(getattr(item, "value", item))


def _contains(include: Container, kind: str) -> bool:
    return any(_value(item) == kind for item in include)  # type: ignore[attr-defined]


def _check_kinds(include: Container | None) -> None:
    if include is None:
        return
    unknown = [_value(item) for item in include if _value(item) not in KINDS]  # type: ignore[attr-defined]
    if unknown:
        raise StateOffloadError(f"offload_states(include=...): unknown state kinds {unknown}; use "
                                f"OffloadStateTypeEnum values: {', '.join(KINDS)}")
