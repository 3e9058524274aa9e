"""fp32 master shards, the client optimizer remapped onto them, clipping.

Memory ownership: `ShardedOptimizer` owns one fp32 master shard per trainable parameter
(`masters[i]` pairs with `params[i]`). When the compute dtype is fp32 and the master lives
on the same device as the shard, the master *is* the compute shard (no second copy).
The client optimizer's param groups are rewritten in place to hold the masters, so its
hyper-parameters, its identity (lr schedulers hold it) and its state_dict format are kept;
its per-parameter state (exp_avg, ...) is therefore shard-sized.

Step, at the gradient-accumulation boundary:
  grads (ShardedParam.grad_shard) -> master.grad; optional global-norm clipping;
  optimizer.step(); master -> compute shard; resident parameters re-gathered;
  grads dropped.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import Communicator
from .partition import ShardedParam


class OptimizerSetupError(ValueError):
    """The client optimizer cannot be mapped onto the model's shards."""


class ShardedOptimizer:
    """The client optimizer, stepping on this rank's fp32 master shards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        table: dict[torch.nn.Parameter, ShardedParam],
        comm: Communicator,
        master_device: torch.device,
        gradient_clipping: float,
        check_overflow: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.optimizer = optimizer
        self.comm = comm
        self.master_device = master_device
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.pin_memory = pin_memory and master_device.type == "cpu" and torch.cuda.is_available()
        self.params: list[ShardedParam] = []
        self.masters: list[torch.Tensor] = []
        self._last_norm: torch.Tensor | float | None = None
        self._remap_param_groups(table)

    # ------------------------------------------------------------------ setup
    def _master_for(self, sp: ShardedParam) -> torch.Tensor:
        shares_storage = sp.shard.dtype == torch.float32 and sp.shard.device == self.master_device
        if shares_storage:
            return sp.shard
        master = sp.shard.to(self.master_device, torch.float32, copy=True)
        return master.pin_memory() if self.pin_memory else master

    def _remap_param_groups(self, table: dict[torch.nn.Parameter, ShardedParam]) -> None:
        if self.optimizer.state:
            raise OptimizerSetupError(
                "the optimizer passed to zero3.initialize already has state (it has stepped); "
                "build it fresh over model.parameters() and pass it before the first step"
            )
        for index, group in enumerate(self.optimizer.param_groups):
            masters = []
            for p in group["params"]:
                sp = table.get(p)
                if sp is None:
                    raise OptimizerSetupError(
                        f"param group {index} of the optimizer holds a tensor of shape "
                        f"{tuple(p.shape)} that is not a parameter of the model; build the "
                        "optimizer over model.parameters() (or a subset of them)"
                    )
                if not sp.requires_grad:
                    continue  # frozen: never has a gradient, needs no master
                self.params.append(sp)
                master = self._master_for(sp)
                self.masters.append(master)
                masters.append(master)
            group["params"] = masters
        self._master_by_param = {id(sp): m for sp, m in zip(self.params, self.masters)}
        self._prefer_fused_kernels()

    def _prefer_fused_kernels(self) -> None:
        """Adam, AdamW and SGD over the shards run as one fused kernel per group, unless
        the user chose an implementation (foreach=... or fused=...) explicitly."""
        if not isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
            return
        for group in self.optimizer.param_groups:
            explicit = group.get("foreach") is not None or group.get("fused") is not None
            if not explicit and not group.get("differentiable") and group["params"]:
                group["fused"] = True

    # ------------------------------------------------------------------- step
    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm of the last step (read from the device on first use:
        the step itself never waits for it unless overflow checking needs it)."""
        if self._last_norm is None:
            return None
        if not isinstance(self._last_norm, float):
            self._last_norm = math.sqrt(float(self._last_norm.item()))
        return self._last_norm

    def global_grad_norm_squared(self, grad_divisor: float = 1.0) -> torch.Tensor:
        """Squared L2 norm of the full gradient (fp64, one element, on the device where it
        was reduced); each element lives in exactly one rank's shard. No host sync.
        `grad_divisor`: what the gradients were divided by after their norms were taken."""
        grads, known = [], []
        for sp, m in zip(self.params, self.masters):
            if m.grad is None:
                continue
            if sp.grad_sq_norm is not None and m.grad is sp.grad_shard:
                known.append(sp.grad_sq_norm)  # taken on the GPU on the way to the host
            else:
                grads.append(m.grad)
        local = torch.zeros(1, dtype=torch.float64, device=self.master_device)
        if grads:
            # One fused pass for all shards, whatever their number.
            norms = torch._foreach_norm(grads, 2.0)
            local = local + torch.stack(norms).double().pow(2).sum()
        if known:
            local = local + torch.stack(known).sum().to(self.master_device) / grad_divisor ** 2
        if self.comm.active and local.device.type == "cpu" and torch.cuda.is_available() and dist_backend_is_nccl():
            local = local.cuda()
        self.comm.all_reduce(local)
        return local

    def global_grad_norm(self) -> float:
        """L2 norm of the full gradient (waits for it)."""
        return math.sqrt(float(self.global_grad_norm_squared().item()))

    def _clip(self, squared_norm: torch.Tensor) -> None:
        """Scale the gradients by min(1, clip / (norm + 1e-6)), as torch's clip_grad_norm_,
        computed on the device (no host sync)."""
        grads = [m.grad for m in self.masters]  # all on master_device
        if not grads:
            return
        coefficient = (self.gradient_clipping / (squared_norm.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coefficient.to(self.master_device, torch.float32).reshape(()))

    def step(self, grad_divisor: float = 1.0) -> bool:
        """One optimizer step over the shards; grads are consumed.

        `grad_divisor` undoes fp16 loss scaling before the norm, clipping and update.

        Returns False (and changes nothing but the gradients, which are dropped) when
        overflow checking is on and the global gradient norm is inf or nan.
        """
        for sp, master in zip(self.params, self.masters):
            # A trainable parameter unused in this window gets a zero gradient (as DeepSpeed).
            master.grad = sp.grad_shard if sp.grad_shard is not None else torch.zeros_like(master)
        if grad_divisor != 1.0:
            torch._foreach_div_([m.grad for m in self.masters], grad_divisor)
        squared = self.global_grad_norm_squared(grad_divisor)
        self._last_norm = squared
        if self.check_overflow and not math.isfinite(self.last_grad_norm):
            self.zero_grad()
            return False
        if self.gradient_clipping > 0:
            self._clip(squared)
        self.optimizer.step()
        self._write_back_shards()
        self.zero_grad()
        return True

    def _write_back_shards(self) -> None:
        """master -> compute shard (a cast), one fused copy per device pair."""
        pairs: dict[tuple[torch.device, torch.device], tuple[list, list]] = {}
        for sp, master in zip(self.params, self.masters):
            if master is not sp.shard:
                shards, sources = pairs.setdefault((sp.shard.device, master.device), ([], []))
                shards.append(sp.shard)
                sources.append(master)
        with torch.no_grad():
            for (shard_device, master_device), (shards, sources) in pairs.items():
                if shard_device == master_device:
                    torch._foreach_copy_(shards, sources)
                else:
                    for shard, source in zip(shards, sources):
                        shard.copy_(source)

    def zero_grad(self) -> None:
        for sp, master in zip(self.params, self.masters):
            sp.grad_shard = None
            sp.grad_sq_norm = None
            master.grad = None

    def master_of(self, sp: ShardedParam) -> torch.Tensor | None:
        """The fp32 master of `sp`, or None for a parameter the optimizer does not step."""
        return self._master_by_param.get(id(sp))


def dist_backend_is_nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"
