"""ShardedParam: the layout of one parameter's shard and its state machine.

Layout: the parameter is flattened and padded to `shard_numel * world_size` elements;
rank r owns elements [r * shard_numel, (r + 1) * shard_numel). Elements at or past
`numel` are padding: zero in the shard, never written to the parameter, never saved.

Memory ownership:
- `shard` (compute dtype, on `shard_device`) is owned by this object and is the
  persistent copy of this rank's slice of the parameter's values.
- The `nn.Parameter`'s own storage holds the full values only while the state is FULL.
  In SHARDED its storage is resized to zero bytes (or, where tensors taken from it while
  gathered should keep their values, replaced by a fresh empty one: released.py), but the
  tensor keeps its shape, dtype and device, so `p.shape`, `p.numel()` and `p.dtype` stay
  honest; it is sealed (released.py), so code outside zero3 that touches its values gets a
  named error.
- `grad_shard` (fp32, same device as the optimizer's master) accumulates this rank's
  slice of the averaged gradient; it is owned here and handed to the optimizer.

State transitions, and only these, are done by the methods below; each checks the state
it starts from:  SHARDED --begin_gather--> GATHERING --finish_gather--> FULL --release--> SHARDED

NVMe tier (offload_param.device "nvme"; nvme_shards.py): `backing` is the swap that holds
the shard's values in a file. `shard` is then a meta tensor of the shard's shape and dtype
between uses (any read of its values fails), and a view of a host staging buffer only
while a gather copies it (`ShardBacking.bind` / `unbind`, called by the wire). Code outside
the gather reads and writes the values through `shard_values()` / `write_shard()`, which
work for every tier.

Aliasing (world size 1, shard on the parameter's own device): after `alias_shard()` the
shard *is* a flat view of the parameter's storage, the parameter is resident (FULL, never
released), and writing the shard (optimizer write-back, checkpoint load) writes the
parameter. Nothing is gathered or copied for it until a new placement takes it off the
device tier (`unalias_shard`: the shard is a separate copy again).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from zero3.params.released import name_for_errors, refuse_released, release_storage, restore_storage
from zero3.params.shard_layout import copy_rows, owned_range, shard_numel_for
from zero3.platform.pinned import pinned_copy


class ParamState(enum.Enum):
    SHARDED = "sharded"
    GATHERING = "gathering"
    FULL = "full"


class StateError(RuntimeError):
    """A transition was asked for from the wrong state: an engine invariant is broken."""


class ShardBacking(Protocol):
    """Where the values of an NVMe-tier shard live (nvme_shards.ParamSwap)."""

    def bind(self, sps: list["ShardedParam"]) -> None:
        """Each shard a view of its values in host memory until `unbind`."""

    def unbind(self, sps: list["ShardedParam"]) -> None:
        """The views dropped (after the copies out of them are issued)."""

    def readable(self, sp: "ShardedParam") -> torch.Tensor:
        """A new host tensor holding `sp`'s shard values (the caller owns it)."""

    def write(self, sp: "ShardedParam", values: torch.Tensor) -> None:
        """`values` (shard_numel elements, any dtype or device) become `sp`'s shard values."""

    @property
    def staging_buffers(self) -> int:
        """How many host staging buffers the reads may fill ahead."""

    def drain(self) -> None:
        """Every write started is on disk (a failed one raised)."""

    def prefetch(self, sps: list["ShardedParam"]) -> bool:
        """Start reading the shards of `sps` ahead, while staging buffers are free (never
        waits); False once none is."""


class ShardedParam:
    """One managed parameter: its shard, its gradient shard and its gather state."""

    def __init__(
        self,
        param: torch.nn.Parameter,
        name: str,
        rank: int,
        world_size: int,
        persistent: bool,
        shard_device: torch.device,
        pin_memory: bool = False,
        shard: torch.Tensor | None = None,
    ) -> None:
        """`shard` given: the parameter was partitioned already (zero3.Init) and is SHARDED,
        its storage empty; this object takes `shard` over (moved to `shard_device`).
        Otherwise the parameter is FULL and its local slice is copied out of it."""
        self.param = param
        self.name = name
        name_for_errors(param, name)
        self.rank = rank
        self.world_size = world_size
        self.numel = param.numel()
        self.shape = param.shape
        self.dtype = param.dtype
        self.shard_numel = shard_numel_for(self.numel, world_size)
        # A zero-size parameter has nothing to gather: it is simply always resident.
        self.persistent = persistent or self.numel == 0
        self.shard_device = shard_device
        self.holds = 0
        if shard is None:
            self.state = ParamState.FULL
            self.shard = self._take_local_shard()
        else:
            if shard.numel() != self.shard_numel:
                raise StateError(f"{name}: a shard of {shard.numel()} elements for {world_size} ranks, "
                                 f"expected {self.shard_numel}")
            self.state = ParamState.SHARDED
            self.shard = shard.to(shard_device)
        if pin_memory and self.shard.device.type == "cpu" and torch.cuda.is_available():
            self.shard = pinned_copy(self.shard)  # host shard copied to the GPU asynchronously
        self.grad_shard: torch.Tensor | None = None
        # squared L2 norm of grad_shard when known on the device (grads/sink.py), else None
        self.grad_sq_norm: torch.Tensor | None = None
        self.aliased = False
        self._persistent_before_alias = self.persistent  # restored by unalias_shard
        self.backing: ShardBacking | None = None  # set by the NVMe tier (nvme_shards.py)

    # ----------------------------------------------------------------- layout
    @property
    def padded_numel(self) -> int:
        return self.shard_numel * self.world_size

    @property
    def persistent_by_config(self) -> bool:
        """Resident by the persistence threshold (or its size), aliasing aside: what a plan
        charges as resident, whatever the placement aliased."""
        return self._persistent_before_alias if self.aliased else self.persistent

    @property
    def requires_grad(self) -> bool:
        return self.param.requires_grad

    def range_of(self, rank: int) -> tuple[int, int]:
        """[start, end) of the unpadded elements that `rank` owns (possibly empty)."""
        return owned_range(self.numel, self.shard_numel, rank)

    @property
    def local_valid_numel(self) -> int:
        start, end = self.range_of(self.rank)
        return end - start

    def padded_flat(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` flattened and zero-padded to padded_numel (a new tensor if padding)."""
        flat = tensor.reshape(-1)
        pad = self.padded_numel - self.numel
        return torch.nn.functional.pad(flat, (0, pad)) if pad else flat

    def _take_local_shard(self) -> torch.Tensor:
        start = self.rank * self.shard_numel
        flat = self.padded_flat(self.param.detach())
        return flat[start:start + self.shard_numel].to(self.shard_device, copy=True)

    # ------------------------------------------------------------ values
    def shard_values(self) -> torch.Tensor:
        """The shard's values on any tier: the shard itself, or (NVMe tier) a new host
        tensor read from its swap file. For readers outside the gather path."""
        return self.backing.readable(self) if self.backing is not None else self.shard

    def write_shard(self, values: torch.Tensor, start: int = 0) -> None:
        """shard[start:start + values.numel()] = values on any tier (NVMe: the shard read,
        changed and written back; a whole shard is written without a read)."""
        if self.backing is None:
            with torch.no_grad():
                self.shard[start:start + values.numel()].copy_(values.reshape(-1))
            return
        if start == 0 and values.numel() == self.shard_numel:
            self.backing.write(self, values)
            return
        whole = self.backing.readable(self)
        whole[start:start + values.numel()].copy_(values.reshape(-1))
        self.backing.write(self, whole)

    # ------------------------------------------------------------ transitions
    def _expect(self, state: ParamState, verb: str) -> None:
        if self.state is not state:
            raise StateError(
                f"{verb}({self.name}): parameter is {self.state.value}, expected {state.value}"
            )

    def release(self, keep_aliases: bool = False) -> bool:
        """FULL -> SHARDED: free the full storage; metadata stays. True when the parameter
        moved to a fresh storage instead, leaving the old one to tensors that share it
        (released.py: with `keep_aliases`, or when NumPy holds it)."""
        self._expect(ParamState.FULL, "release")
        if self.persistent:
            raise StateError(f"release({self.name}): persistent parameters stay full")
        moved = release_storage(self.param, keep_aliases)
        self.state = ParamState.SHARDED
        return moved

    def move_shard(self, device: torch.device, pin_memory: bool = False) -> None:
        """The shard moves to `device` (values kept) as a new tensor: a tensor that was the
        shard (an fp32 master sharing it) stays where it was, with the same values. Pinned on
        the host when `pin_memory` and CUDA is there. An aliased shard is the parameter's own
        storage and never moves. Already on `device` (the host), it is pinned there if asked."""
        if self.shard.device == device:
            if (pin_memory and device.type == "cpu" and torch.cuda.is_available() and self.backing is None
                    and not self.shard.is_pinned()):
                self.shard = self.shard.pin_memory()
            return
        if self.backing is not None:
            raise StateError(f"move_shard({self.name}): an NVMe-tier shard stays there (fixed at initialize)")
        if self.aliased:
            raise StateError(f"move_shard({self.name}): an aliased shard is the parameter itself")
        if pin_memory and device.type == "cpu" and torch.cuda.is_available():
            shard = pinned_copy(self.shard)
        else:
            shard = self.shard.to(device, copy=True)
        self.shard = shard
        self.shard_device = device

    def adopt_shard(self, tensor: torch.Tensor) -> None:
        """`tensor` (same shape, dtype and values) becomes the shard: an fp32 master moved
        next to its shard is shared with it again."""
        if tensor.shape != self.shard.shape or tensor.dtype != self.shard.dtype or self.aliased or self.backing:
            raise StateError(f"adopt_shard({self.name}): {tuple(tensor.shape)} {tensor.dtype} for a shard of "
                             f"{tuple(self.shard.shape)} {self.shard.dtype} (aliased: {self.aliased})")
        self.shard = tensor
        self.shard_device = tensor.device

    def alias_shard(self, master: torch.Tensor | None = None) -> None:
        """FULL -> FULL, resident: the shard becomes a view of the parameter's
        storage (the separate shard copy is freed). Only at world size 1 with the shard
        on the parameter's device, where the shard and the parameter hold the same values.
        `master`: the optimizer's master when it is the shard itself (same tensor); it moves
        onto the parameter's storage with it (its identity, which the optimizer keys its
        state by, kept) and stays the shard."""
        self._expect(ParamState.FULL, "alias_shard")
        if master is not None and master is not self.shard:
            raise StateError(f"alias_shard({self.name}): the master given is not the shard")
        if self.world_size != 1 or self.shard.device != self.param.device or not self.param.is_contiguous():
            raise StateError(f"alias_shard({self.name}): needs world size 1, the shard on the parameter's "
                             f"device and a contiguous parameter (world {self.world_size}, shard on "
                             f"{self.shard.device}, parameter on {self.param.device})")
        self._persistent_before_alias = self.persistent
        view = self.param.data.view(-1)
        if master is not None:
            master.data = view
            view = master
        self.shard = view
        self.persistent = True
        self.aliased = True

    def unalias_shard(self, device: torch.device, pin_memory: bool = False) -> None:
        """FULL -> FULL, aliased no more (a new placement takes the parameter off the device
        tier): the shard becomes a copy of the parameter's values on `device`, pinned on the
        host when `pin_memory` and CUDA is there, and the parameter is persistent again only
        if it was before `alias_shard`. The caller releases it if it is not."""
        if not self.aliased:
            raise StateError(f"unalias_shard({self.name}): the shard is not aliased")
        self._expect(ParamState.FULL, "unalias_shard")
        values = self.param.data.reshape(-1)
        if pin_memory and device.type == "cpu" and torch.cuda.is_available():
            self.shard = pinned_copy(values)
        else:
            self.shard = values.to(device, copy=True)
        self.shard_device = device
        self.aliased = False
        self.persistent = self._persistent_before_alias

    def begin_gather(self) -> None:
        """SHARDED -> GATHERING: allocate the full storage back (values not yet valid)."""
        self._expect(ParamState.SHARDED, "begin_gather")
        restore_storage(self.param)
        self.state = ParamState.GATHERING

    def finish_gather(self, rows: torch.Tensor) -> None:
        """GATHERING -> FULL: write the gathered values in place.

        `rows` is a [world_size, shard_numel] view of the all-gather output (row r is rank
        r's shard). The write does not bump autograd's version counter, so tensors saved
        in forward are valid again once the parameter is gathered for backward.
        """
        self._expect(ParamState.GATHERING, "finish_gather")
        self.write_rows(rows)
        self.state = ParamState.FULL

    def refresh(self, rows: torch.Tensor) -> None:
        """FULL -> FULL: new values after an optimizer step, for resident parameters."""
        self._expect(ParamState.FULL, "refresh")
        if not self.aliased:  # an aliased parameter's values are its shard's already
            self.write_rows(rows)

    def write_rows(self, rows: torch.Tensor) -> None:
        """Copy the unpadded part of `rows` ([world_size, shard_numel]) into the parameter;
        refuses (ReleasedParameterError) a parameter whose storage something else freed."""
        refuse_released(self.param, "writing gathered or updated values", self.name,
                        fix="something outside zero3 freed or replaced its storage; leave a managed "
                        "parameter's storage and `.data` to zero3 (change values with GatheredParameters)")
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.param):
            copy_rows(self.param.data.view(-1), rows, self.shard_numel, into_rows=False)

    def pack_rows(self, flat: torch.Tensor, rows: torch.Tensor) -> None:
        """Copy `flat` (numel values) into a zeroed [world_size, shard_numel] block `rows`."""
        copy_rows(flat.reshape(-1), rows, self.shard_numel, into_rows=True)

    def __repr__(self) -> str:
        return (
            f"ShardedParam({self.name}, numel={self.numel}, shard={self.shard_numel}, "
            f"state={self.state.value}, persistent={self.persistent})"
        )
