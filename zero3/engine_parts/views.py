"""Typed views of an engine's collaborators, for the code that reads them from outside the step.

Checkpoints, consolidated exports, GatheredParameters, generation and the parameter
accessors each take the view they read instead of the engine:

- `ShardedModel`: the client's model, its `ShardedParam` table, the process group it is
  sharded over, the compute device and dtype. Built once by the engine; every field is
  fixed for the engine's life (the table is the engine's own dict, not a copy).
- `OptimizerAccess`: the masters (fp32 or bf16) and the client optimizer's state and param groups,
  each read only after any update still running behind the forward is complete
  (optim/host_step.py), so a reader never sees a half-applied step. Without an optimizer it
  reads as empty: no masters, no state, no groups. Masters and state of the NVMe tier
  (optim/nvme_state.py) are brought into host memory before they are handed out, unless
  the reader asks for them as they are (`paged_in=False`) and reads each through
  `readable` (checkpoint saves, streaming from the swap files) or `loosen` (loads).
- `ShardedTraining`: what a public function that takes an engine reads of it (these two
  views), so such a function unpacks the engine once and passes the views on.

Memory: a view owns nothing. It holds references to the engine's collaborators, and
every tensor reached through it (shards, masters, optimizer state) is theirs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from zero3.optim.masters import ShardedOptimizer, settle
from zero3.optim.precision import MasterPrecision
from zero3.optim.state_probe import foreseen_state
from zero3.params.partition import ShardedParam
from zero3.platform.collectives import Communicator


@dataclass(frozen=True, eq=False)
class ShardedModel:
    """The model and its shards: what consolidation, checkpoints and gathering read.

    `table` maps each managed `nn.Parameter` to its `ShardedParam`; a parameter of
    `module` that is not in it was attached after initialize (late_params.py). Gathers
    through this view land on `device`; `compute_dtype` is the dtype of the shards."""

    module: nn.Module
    table: dict[nn.Parameter, ShardedParam]
    comm: Communicator
    device: torch.device
    compute_dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class OptimizerAccess:
    """The sharded optimizer's masters and state, each read after the update in flight.

    `sharded` is None for an engine built without an optimizer: then `present` is False
    and every read is empty. The returned dicts and lists are the optimizer's own (writes
    to them are writes to the optimizer), except `masters()`, a new dict."""

    sharded: ShardedOptimizer | None

    @property
    def present(self) -> bool:
        return self.sharded is not None

    def settle(self) -> None:
        """Wait for the update in flight, if any (a no-op without an optimizer)."""
        settle(self.sharded)

    def _paged_in(self, paged_in: bool) -> None:
        """After the update in flight; with `paged_in`, the NVMe tier's state in host memory
        (until the next step writes it back: optim/nvme_state.py)."""
        self.sharded.wait()
        if paged_in:
            self.sharded.swap.materialize()

    def masters(self, paged_in: bool = True) -> dict[int, torch.Tensor]:
        """id(ShardedParam) -> its fp32 master; empty without an optimizer."""
        if self.sharded is None:
            return {}
        self._paged_in(paged_in)
        return self.sharded.settled_masters()

    def precision(self) -> MasterPrecision:
        """The dtypes of masters, gradient shards and optimizer state (fp32 without an optimizer)."""
        return self.sharded.precision if self.sharded is not None else MasterPrecision()

    def master_of(self, sp: ShardedParam) -> torch.Tensor | None:
        """The fp32 master of `sp`, or None for a parameter the optimizer does not step."""
        if self.sharded is None:
            return None
        self._paged_in(True)
        return self.sharded.master_of(sp)

    def stepped(self, paged_in: bool = True) -> Iterator[tuple[ShardedParam, torch.Tensor]]:
        """(parameter, master) for every parameter the optimizer steps, in its order."""
        if self.sharded is None:
            return iter(())
        self._paged_in(paged_in)
        return zip(self.sharded.params, self.sharded.masters)

    def state(self, paged_in: bool = True) -> dict[Any, dict[str, Any]]:
        """The client optimizer's per-master state (keyed by master tensor)."""
        if self.sharded is None:
            return {}
        self._paged_in(paged_in)
        return self.sharded.optimizer.state

    def readable(self, tensor: torch.Tensor) -> torch.Tensor:
        """A master or state tensor (or a view of one) read as `masters(paged_in=False)` gave
        it: its values, read from its swap file when it is on the NVMe tier and parked."""
        return self.sharded.swap.readable(tensor) if self.sharded is not None else tensor

    def loosen(self, master: torch.Tensor) -> None:
        """`master` and its state in host memory, to be written (one NVMe swap group at a
        time: the one loosened before is written back); `store_loose()` when done."""
        if self.sharded is not None:
            self.sharded.swap.loosen(master)

    def store_loose(self) -> None:
        if self.sharded is not None:
            self.sharded.swap.store_loose()

    def foreseen_state(self) -> dict[Any, dict[str, Any]]:
        """`state()` as it will be once every master has stepped: a master without state yet
        gets the state its first step creates, as meta tensors (optim/state_probe.py)."""
        if self.sharded is None:
            return {}
        self._paged_in(True)
        precision = self.sharded.precision
        return foreseen_state(self.sharded.optimizer, precision.state_dtype if precision.upcasts else None)

    def param_groups(self) -> list[dict[str, Any]]:
        """The client optimizer's param groups (their `params` are the masters)."""
        if self.sharded is None:
            return []
        self.sharded.wait()
        return self.sharded.optimizer.param_groups


class ShardedTraining(Protocol):
    """What a public function given an engine reads of it: its two views."""

    @property
    def sharded_model(self) -> ShardedModel: ...

    @property
    def optimizer_access(self) -> OptimizerAccess: ...
