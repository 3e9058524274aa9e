"""The dtypes of the optimizer side: masters, gradient shards and optimizer state.

DeepSpeed's `bf16.bf16_master_weights_and_grads` and `bf16.bf16_optimizer_states` choose them
(config.py checks the combinations as DeepSpeed does):

  setting                                   master  grad shard  state  bytes a parameter
  (default)                                 fp32    fp32        fp32   18 (2 + 4 + 4 + 4 + 4)
  bf16_master_weights_and_grads             bf16    bf16        fp32   14 (2 + 2 + 2 + 4 + 4;
                                                                           offload_optimizer only)
  ... and bf16_optimizer_states             bf16    bf16        bf16    8 (2 + 2 + 2 + 2)

(bf16 compute shard, master, gradient shard while it is held, Adam's two moments; DeepSpeed's
"16 bytes" for the default counts a bf16 gradient, zero3 accumulates gradients in the master's
dtype).

Decisions:
- A master whose dtype and device are the shard's *is* the shard (one tensor, no copy, no
  write-back), as fp32 masters of fp32 shards always were: with bf16 masters and bf16
  compute the 8 bytes are shard 2 + gradient 2 + moments 4. Exception: with fp32 state
  (the offloaded mixed mode) a master is never the shard, since its storage is swapped to
  fp32 during the update (`stepping`) and a shard may be a view that must keep its storage.
- bf16 masters with bf16 state step with the client's own kernels over bf16 tensors: torch's
  fused Adam / AdamW read bf16, compute in fp32 registers and store bf16, which is exactly
  what plain PyTorch does for a bf16 model, so the fused kernels are kept.
- bf16 masters with fp32 state (DeepSpeed's ZeRO-Offload mixed mode): for each optimizer call
  the masters that have a gradient are lifted to fp32 (`.data` swapped to an fp32 copy, the
  gradient cast), the client optimizer steps in fp32 against fp32 state, and the result is
  rounded back into the master's own bf16 storage (pinning and identity kept). The fp32
  copies live only for one sub-group's call (bounded by sub_group_size).

Memory ownership: this module owns no tensors; the masters and the state are the sharded
optimizer's (optim/masters.py); the fp32 copies made by `stepping` are dropped on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from zero3.config import PrecisionConfig
from zero3.platform.pinned import pinned_empty


@dataclass(frozen=True)
class MasterPrecision:
    """The dtypes the sharded optimizer keeps (see the module docstring)."""

    master_dtype: torch.dtype = torch.float32
    state_dtype: torch.dtype = torch.float32
    grad_accum_dtype: torch.dtype | None = None

    @classmethod
    def of(cls, precision: PrecisionConfig) -> "MasterPrecision":
        return cls(precision.master_dtype, precision.optimizer_state_dtype, precision.grad_accum_dtype)

    @property
    def grad_dtype(self) -> torch.dtype:
        """Gradient shards accumulate in data_types.grad_accum_dtype, else in the master's dtype
        (DeepSpeed's "master weights and grads")."""
        return self.grad_accum_dtype or self.master_dtype

    def master_grad(self, grad_shard: torch.Tensor | None, master: torch.Tensor) -> torch.Tensor | None:
        """The gradient the optimizer steps `master` with: the shard itself, or, accumulated in
        another dtype (grad_accum_dtype), a copy in the master's dtype that the step drops."""
        if grad_shard is None or grad_shard.dtype == master.dtype:
            return grad_shard
        return grad_shard.to(master.dtype)

    @property
    def upcasts(self) -> bool:
        """bf16 masters stepped against fp32 state (`stepping` lifts them)."""
        return self.state_dtype != self.master_dtype

    def shares_storage(self, shard: torch.Tensor, device: torch.device) -> bool:
        """Whether the master of `shard`, living on `device`, is the shard itself."""
        return not self.upcasts and shard.dtype == self.master_dtype and shard.device == device

    def make_master(self, shard: torch.Tensor, device: torch.device, pin: bool, apart: bool = False,
                    parked: bool = False) -> torch.Tensor:
        """The master of `shard` on `device`: the shard itself where `shares_storage` (and not
        `apart`: a shard on the NVMe tier lives in a file), else a new tensor in the master
        dtype (pinned on the host when `pin`). `parked`: a master of the NVMe tier, made with
        no storage (its values are not read: the tier writes the shard's, cast, straight to
        its file at initialize, one swap group at a time, so the tier's masters never all
        sit in host memory). The caller owns it."""
        if self.shares_storage(shard, device) and not apart:
            return shard
        if parked:
            master = torch.empty(shard.shape, dtype=self.master_dtype)
            master.untyped_storage().resize_(0)
            return master
        if pin and device.type == "cpu":
            master = pinned_empty(shard.numel(), self.master_dtype).view(shard.shape)
            return master.copy_(shard)
        return shard.to(device, self.master_dtype, copy=True)

    def state_value(self, value: torch.Tensor) -> torch.Tensor:
        """An elementwise optimizer state tensor in this engine's state dtype (floating
        tensors only: integer state is left alone). A saved value of the other setting
        is converted here (rounded to bf16, or widened to fp32)."""
        if value.is_floating_point() and value.dtype != self.state_dtype:
            return value.to(self.state_dtype)
        return value

    def describe(self) -> str:
        name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
        return f"masters and gradient shards {name(self.master_dtype)}, optimizer state {name(self.state_dtype)}"

    @contextlib.contextmanager
    def stepping(self, masters: list[torch.Tensor]) -> Iterator[None]:
        """Around one optimizer call over `masters`: with `upcasts`, each master holding a
        gradient is lifted to fp32 for the call and rounded back into its own storage after
        (see the module docstring); otherwise nothing happens."""
        if not self.upcasts:
            yield
            return
        lifted = _lift(masters)
        try:
            yield
        finally:
            _lower(lifted)


def _lift(masters: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(master, its own low-precision storage) for every master with a gradient, the master's
    `.data` now an fp32 copy and its gradient fp32."""
    lifted = []
    with torch.no_grad():
        for master in masters:
            if master.grad is None or master.dtype == torch.float32:
                continue
            own = master.data
            grad = master.grad.float()
            master.grad = None
            master.data = own.float()
            master.grad = grad
            lifted.append((master, own))
    return lifted


def _lower(lifted: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The fp32 results rounded back into each master's own storage; gradients dropped
    (the sharded optimizer drops them after every call anyway)."""
    with torch.no_grad():
        for master, own in lifted:
            own.copy_(master.data)
            master.grad = None
            master.data = own


def converted_note(kind: str, saved: torch.dtype, now: torch.dtype) -> str:
    """The log line of a load that converted `kind` from the saved dtype to this engine's."""
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    return (f"zero3: the checkpoint's {kind} are {name(saved)}, this engine keeps them in {name(now)} "
            f"(bf16_master_weights_and_grads / bf16_optimizer_states differ): converted on load"
            + (" (rounded to bf16)" if now == torch.bfloat16 else ""))

