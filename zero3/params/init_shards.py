"""The shards of parameters that `zero3.Init` partitioned and no engine has adopted yet.

`init.py` records a parameter's shard here when it partitions it; an engine takes the
shard over with `claim_init_shard` at `initialize`; `status.py` reads it for DeepSpeed's
`param.ds_tensor` / `ds_status` before then.

Memory ownership: this registry owns each `InitShard` until it is claimed; parameters are
held weakly (a dropped model leaves no entry behind).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary


@dataclass
class InitShard:
    """One parameter partitioned at construction: this rank's flat slice of its values.

    `shard` holds elements [rank * shard_numel, (rank + 1) * shard_numel) of the
    flattened parameter, zero past `numel` (padding), in the parameter's dtype.
    """

    shard: torch.Tensor
    numel: int
    world_size: int
    rank: int

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


INIT_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # nn.Parameter -> InitShard


def record_init_shard(param: torch.Tensor, record: InitShard) -> None:
    """`param` is partitioned: `record` holds this rank's slice until an engine claims it."""
    INIT_SHARDS[param] = record


def init_shard_of(param: torch.Tensor) -> InitShard | None:
    """The shard of a parameter partitioned by zero3.Init and not yet adopted, else None."""
    return INIT_SHARDS.get(param)


def claim_init_shard(param: torch.Tensor) -> InitShard | None:
    """Hand the shard of `param` over to its new owner (the engine); None if not partitioned."""
    return INIT_SHARDS.pop(param, None)
