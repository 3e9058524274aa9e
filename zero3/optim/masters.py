"""Master shards, the client optimizer remapped onto them, clipping.

Memory ownership: `ShardedOptimizer` owns one master shard per trainable parameter
(`masters[i]` pairs with `params[i]`), on the device the placement gives that parameter's
optimizer side (zero3/placement/devices.py); its optimizer state follows it. Masters are
fp32, or bf16 with DeepSpeed's bf16_master_weights_and_grads (optim/precision.py says which
dtypes and how bf16 masters step). When the master's dtype is the compute dtype and it lives
on the same device as the shard, the master *is* the compute shard (no second copy).
The client optimizer's param groups are rewritten in place to hold the masters, so its
hyper-parameters, its identity (lr schedulers hold it) and its state_dict format are kept;
its per-parameter state (exp_avg, ...) is therefore shard-sized.

Step, at the gradient-accumulation boundary:
  grads (ShardedParam.grad_shard) -> master.grad, None for a parameter no rank produced a
  gradient for in the window (torch optimizers then leave it and its state alone, as in
  plain PyTorch; grads/usage.py says how a leaf's unused parameters are told apart from
  the zeros reduced for them); optional global-norm clipping;
  the update, sub-group by sub-group (DeepSpeed's `sub_group_size`: at most that many
  elements, whole parameters, per optimizer call); master -> compute shard per sub-group;
  resident parameters re-gathered; grads dropped.

Where each sub-group steps: a sub-group holds parameters of one tier only. Device-tier
sub-groups step in `step()` (fused kernels on the GPU); host-tier ones (and NVMe-tier ones,
read in and written back around their update by optim/nvme_state.py) too, or, with the
overlapped host step (optim/host_step.py), on a worker thread behind the next forward. Sub-groups then
also end at fetch-unit ends, in the order the units were entered in the last forward
(resident parameters first, since the step's own re-gather reads them), and each one is
stepped by a *shadow* optimizer: a torch optimizer of the client's class over that
sub-group's masters, sharing the client's `state` dict, with the client's hyper-
parameters copied in when the step starts (so an lr scheduler stepping right after
`step()` returns cannot race with the update).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from zero3.grads.usage import GradUsage
from zero3.optim.early_update import EarlyHostUpdates, hyper_parameters, unclipped
from zero3.optim.host_step import BackgroundStep
from zero3.optim.nvme_state import OptimizerSwap, attached
from zero3.optim.precision import MasterPrecision
from zero3.optim.state_moves import move_master
from zero3.optim.write_back import ShardWriteBack, record_current_stream
from zero3.params.nvme_shards import drain_param_writes
from zero3.params.partition import ShardedParam
from zero3.placement.devices import Placement
from zero3.placement.plan import Tier
from zero3.platform.collectives import Communicator

MAX_CACHED_SHADOWS = 4096  # shadow optimizers hold references only, no tensors of their own

# Orders the fetch units were last entered in, each unit's parameters (fetch.py).
UnitOrder = Callable[[], list[list[ShardedParam]]]


def leaf_parameters_of(stepped: list[ShardedParam], leaf_modules: dict[nn.Module, list[ShardedParam]]
                       ) -> defaultdict[nn.Module, list[nn.Parameter]]:
    """DeepSpeed's `optimizer.leaf_parameters`: each leaf module (set_z3_leaf_modules, the
    config's leaf_module, the granularity threshold; `leaf_modules` gives their parameters)
    -> those of its parameters that are `stepped`, in the module's order."""
    ids = {id(sp) for sp in stepped}
    found: defaultdict[nn.Module, list[nn.Parameter]] = defaultdict(list)
    for module, sps in leaf_modules.items():
        for sp in sps:
            if id(sp) in ids:
                found[module].append(sp.param)
    return found


class OptimizerSetupError(ValueError):
    """The client optimizer cannot be mapped onto the model's shards."""


class ClientGroups:
    """DeepSpeed's ZeRO optimizer surface over a wrapped client optimizer: `param_groups` are
    the client's, and each step reads its hyper-parameters from them (an `lr` set here is the
    next step's); their "params" are this rank's master shards."""

    optimizer: torch.optim.Optimizer
    # DeepSpeed's attribute: whether the last boundary's step was skipped for a non-finite
    # gradient norm (set by the engine after each step; Accelerate's step_was_skipped reads it)
    overflow: bool = False

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups


class ShardedOptimizer(ClientGroups):
    """The client optimizer, stepping on this rank's fp32 master shards."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        table: dict[torch.nn.Parameter, ShardedParam],
        comm: Communicator,
        placement: Placement,
        gradient_clipping: float,
        check_overflow: bool = False,
        pin_memory: bool = False,
        sub_group_numel: int = 0,
        unit_order: UnitOrder | None = None,
        usage: GradUsage | None = None,
        background: BackgroundStep | None = None,
        leaf_modules: dict[nn.Module, list[ShardedParam]] | None = None,
        swap: OptimizerSwap | None = None,
        precision: MasterPrecision | None = None,
        early_update_bytes: int = 0,
    ) -> None:
        """`sub_group_numel`: elements per optimizer call (0: all at once). `unit_order`:
        given only when the update is to run behind the next forward (see the module doc), on
        `background`, the worker the fetcher and gradient sink were built to wait for.
        `usage`: which leaf parameters got a real gradient in the window (grads/usage.py);
        None when every gradient shard stands for a real gradient. `leaf_modules`: see leaf_parameters_of.
        `swap`: the NVMe tier's masters and state (optim/nvme_state.py), None without one.
        `precision`: the masters' and state's dtypes (optim/precision.py; None: fp32).
        `early_update_bytes`: bound of the host updates started in the window's last backward
        (optim/early_update.py; 0: none)."""
        self.optimizer = optimizer
        self.precision = precision or MasterPrecision()
        self.comm = comm
        self.placement = placement
        self.gradient_clipping = gradient_clipping
        self.check_overflow = check_overflow
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.write_back = ShardWriteBack()
        self.params: list[ShardedParam] = []
        self.masters: list[torch.Tensor] = []
        self._last_norm: torch.Tensor | float | None = None
        self.sub_group_numel = max(int(sub_group_numel), 0)
        self.unit_order = unit_order
        self.usage = usage
        self.background = background or BackgroundStep()
        self._shadows: dict[tuple[int, ...], torch.optim.Optimizer] = {}
        self._remap_param_groups(table, swaps=swap is not None)
        self._client_group_of = [
            index for index, group in enumerate(self.optimizer.param_groups) for _ in group["params"]]
        self.leaf_parameters = leaf_parameters_of(self.params, leaf_modules or {})
        self.swap = attached(swap, self)
        self.early = EarlyHostUpdates(self, early_update_bytes)

    # ------------------------------------------------------------------ setup
    def _remap_param_groups(self, table: dict[torch.nn.Parameter, ShardedParam], swaps: bool) -> None:
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
                on_nvme = sp.backing is not None  # never the shard: that one lives in a file
                in_files = swaps and self.placement.state_tier(sp) is Tier.NVME  # written by the swap's attach
                master = self.precision.make_master(sp.shard if in_files else sp.shard_values(),
                                                    self.placement.state_device(sp), self.pin_memory,
                                                    apart=on_nvme, parked=in_files)
                self.masters.append(master)
                masters.append(master)
            group["params"] = masters
        self._master_by_param = {id(sp): m for sp, m in zip(self.params, self.masters)}
        prefer_fused_kernels(self.optimizer)

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
        local = self._local_grad_norm_squared(grad_divisor)
        self.comm.all_reduce(local)
        return local

    def _norm_and_unused(self, grad_divisor: float) -> tuple[torch.Tensor, list[ShardedParam]]:
        """The global squared gradient norm, and the leaf parameters no rank used in the
        window (grads/usage.py): one all-reduce carries both, the usage counts after the norm."""
        local = self._local_grad_norm_squared(grad_divisor)
        if self.usage is None or not self.usage.size:
            self.comm.all_reduce(local)
            return local, []
        both = torch.cat([local, self.usage.local_counts(local.dtype, local.device)])
        self.comm.all_reduce(both)
        return both[:1], self.usage.unused_everywhere(both[1:])

    def _local_grad_norm_squared(self, grad_divisor: float) -> torch.Tensor:
        """This rank's part of the squared norm (fp64, one element), on the device the
        all-reduce runs on."""
        grads: dict[torch.device, list[torch.Tensor]] = {}
        known = []
        for sp, m in zip(self.params, self.masters):
            if m.grad is None:
                continue
            if sp.grad_sq_norm is not None and m.grad is sp.grad_shard:
                known.append(sp.grad_sq_norm)  # taken on the GPU on the way to the host
            else:
                grads.setdefault(m.grad.device, []).append(m.grad)
        device = self.norm_device
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for on_device in grads.values():
            # One fused pass for all shards of a device, whatever their number.
            norms = torch._foreach_norm(on_device, 2.0, dtype=torch.float32)  # bf16 gradient shards too
            local = local + torch.stack(norms).double().pow(2).sum().to(device)
        if known:
            local = local + torch.stack(known).sum().to(device) / grad_divisor ** 2
        if self.comm.active and local.device.type == "cpu" and torch.cuda.is_available() and dist_backend_is_nccl():
            local = local.cuda()
        return local

    @property
    def norm_device(self) -> torch.device:
        """Where the gradient norm is summed and reduced: the compute device (host-side
        shards' norms are taken on the host and added there as one element)."""
        return self.placement.compute_device

    def global_grad_norm(self) -> float:
        """L2 norm of the full gradient (waits for it)."""
        return math.sqrt(float(self.global_grad_norm_squared().item()))

    def _clip(self, squared_norm: torch.Tensor) -> None:
        """Scale the gradients by min(1, clip / (norm + 1e-6)), as torch's clip_grad_norm_,
        computed on the device (no host sync)."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for m in self.masters:
            if m.grad is not None:
                by_device.setdefault(m.grad.device, []).append(m.grad)
        coefficient = (self.gradient_clipping / (squared_norm.sqrt() + 1e-6)).clamp(max=1.0)
        for device, grads in by_device.items():
            torch._foreach_mul_(grads, coefficient.to(device, torch.float32).reshape(()))

    def step(self, grad_divisor: float = 1.0) -> bool:
        """One optimizer step over the shards; grads are consumed.

        `grad_divisor` undoes fp16 loss scaling before the norm, clipping and update.

        Returns False (and changes nothing but the gradients, which are dropped) when
        overflow checking is on and the global gradient norm is inf or nan; when the skip
        is decided inside the fused kernel (`_skips_in_kernel`), an overflow on the very
        first step still creates the optimizer state, as zeros at step 0, which is what an
        untouched state means. With an overlapped host step the update may still be
        running when this returns.
        """
        self.early.stop()
        self.background.wait()
        for sp, master in zip(self.params, self.masters):
            # None: no rank produced a gradient for it in this window. torch optimizers skip
            # it (state, step count and weight decay untouched), as plain PyTorch does.
            master.grad = self.precision.master_grad(sp.grad_shard, master)
        with_grad = [m.grad for m in self.masters if m.grad is not None]
        if grad_divisor != 1.0 and with_grad:
            torch._foreach_div_(with_grad, grad_divisor)
        squared, unused = self._norm_and_unused(grad_divisor)
        for sp in unused:  # zeros reduced by every rank for a leaf parameter none of them used
            if id(sp) in self._master_by_param:
                self._master_by_param[id(sp)].grad = None
        self._last_norm = squared
        skip_in_kernel = self._skips_in_kernel(squared)
        if self.check_overflow and not skip_in_kernel and not math.isfinite(self.last_grad_norm):
            self.zero_grad()
            return False
        grad_scale = None
        if self.gradient_clipping > 0:
            if self._fused_kernels_unscale():
                grad_scale = self._clip_divisor(squared)
            else:
                self._clip(squared)
        groups = separate_first_momentum(self.optimizer, self.masters, self.sub_groups())
        stands = self.early.resolve(lambda: grad_divisor == 1.0 and unclipped(self.gradient_clipping, squared),
                                    {id(sp) for sp in unused}, {tuple(g) for g in groups})
        if self.unit_order is not None:
            on_device = [g for g in groups if self._tier_of(g) is Tier.DEVICE]
            self._step_now(on_device, grad_scale, squared if skip_in_kernel else None, keep_others=True)
            self._start_background([g for g in groups if self._tier_of(g) is not Tier.DEVICE], grad_scale, stands)
            self._drop_shard_grads()  # the host masters' .grad go with their sub-group, on the worker
            return not (skip_in_kernel and not math.isfinite(self.last_grad_norm))
        self._step_now(groups, grad_scale, squared if skip_in_kernel else None, keep_others=False)
        self.zero_grad()
        # With the skip decided in the kernel, the host learns of it only now, while the
        # device runs the update it queued: masters and state are unchanged on overflow.
        return not (skip_in_kernel and not math.isfinite(self.last_grad_norm))

    def _step_now(self, groups: list[list[int]], grad_scale: torch.Tensor | None,
                  overflow_norm: torch.Tensor | None, keep_others: bool) -> None:
        """The client optimizer over `groups`, here; `overflow_norm`: the squared norm the
        fused kernels skip the update on when it is not finite. `keep_others`: the masters
        outside `groups` keep their gradients (they step elsewhere)."""
        if not groups:
            return
        self.optimizer.grad_scale = grad_scale
        self.optimizer.found_inf = (~torch.isfinite(overflow_norm)).float().reshape(()) \
            if overflow_norm is not None else None
        try:
            self._step_in_sub_groups(groups, keep_others)
        finally:
            self.optimizer.grad_scale = None
            self.optimizer.found_inf = None

    def _tier_of(self, group: list[int]) -> Tier:
        return self.placement.state_tier(self.params[group[0]])

    def _skips_in_kernel(self, squared_norm: torch.Tensor) -> bool:
        """Overflow checking without a host sync before the update: torch's fused Adam and
        AdamW kernels leave parameters, moments and step counts untouched when their
        `found_inf` input is 1 (the hook GradScaler uses). On a GPU only: there the sync
        would leave the device idle while the host prepares the update."""
        return (self.check_overflow and squared_norm.device.type == "cuda"
                and self._runs_fused(torch.optim.Adam, torch.optim.AdamW)
                and (self.unit_order is None or not self.placement.any_state_on_host))

    def _fused_kernels_unscale(self) -> bool:
        """True when every group runs torch's fused Adam / AdamW / SGD kernel, which divides
        the gradients by the optimizer's `grad_scale` tensor as it reads them (the hook
        GradScaler uses): clipping then costs no pass of its own over the gradients."""
        return self._runs_fused(torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)

    def _runs_fused(self, *classes: type) -> bool:
        """The client is one of `classes` and every group runs its fused kernel."""
        return isinstance(self.optimizer, classes) and all(
            group.get("fused") for group in self.optimizer.param_groups)

    def _clip_divisor(self, squared_norm: torch.Tensor) -> torch.Tensor:
        """1 / min(1, clip / (norm + 1e-6)): what the gradients are divided by (one fp32
        element on the masters' device; no host sync on the GPU)."""
        coefficient = (self.gradient_clipping / (squared_norm.sqrt() + 1e-6)).clamp(max=1.0)
        return (1.0 / coefficient).to(torch.float32).reshape(())  # fused kernels copy it to each device

    # ------------------------------------------------------------- sub-groups
    def sub_groups(self) -> list[list[int]]:
        """Indices into `params`, one list per optimizer call, in the order they run; each
        holds parameters of one placement tier (device-tier sub-groups first without the
        overlapped host step; with it, the order the next forward needs them)."""
        groups = []
        for group in self._ordered_sub_groups():
            for tier in Tier:
                part = [i for i in group if self.placement.state_tier(self.params[i]) is tier]
                groups.extend(split_numel(self.masters, self.sub_group_numel, part) if part else [])
        if self.unit_order is None:
            groups.sort(key=lambda g: self._tier_of(g) is not Tier.DEVICE)  # stable: device tier first
        return groups

    def _ordered_sub_groups(self) -> list[list[int]]:
        if self.unit_order is None:
            return split_numel(self.masters, self.sub_group_numel, list(range(len(self.params))))
        position = {id(sp): i for i, sp in enumerate(self.params)}
        resident = [i for i, sp in enumerate(self.params) if sp.persistent]
        taken = set(resident)
        groups = [resident] if resident else []
        for unit_params in self.unit_order():
            members = []
            for sp in unit_params:
                i = position.get(id(sp))
                if i is not None and i not in taken:
                    taken.add(i)
                    members.append(i)
            groups.extend(split_numel(self.masters, self.sub_group_numel, members))
        rest = [i for i in range(len(self.params)) if i not in taken]
        groups.extend(split_numel(self.masters, self.sub_group_numel, rest))
        return groups

    def _step_in_sub_groups(self, groups: list[list[int]], keep_others: bool = False) -> None:
        """The client optimizer over one sub-group at a time: only that group's masters
        hold a gradient during its call, so the others are skipped (torch optimizers skip
        parameters whose .grad is None). One sub-group of every parameter: one plain call.
        `keep_others`: the gradients of masters in no group are put back afterwards."""
        if len(groups) == 1 and len(groups[0]) == len(self.params):
            with self.swap.stepping(0, groups):  # masters in memory through the write-back
                with self.precision.stepping(self.masters):
                    self.optimizer.step()
                self._write_back_shards(groups[0])
            self._drain_param_writes()
            return
        grads = [m.grad for m in self.masters]
        for master in self.masters:
            master.grad = None
        for k, group in enumerate(groups):
            for i in group:
                self.masters[i].grad = grads[i]
            with self.swap.stepping(k, groups):
                with self.precision.stepping([self.masters[i] for i in group]):
                    self.optimizer.step()
                self._write_back_shards(group)
            for i in group:
                self.masters[i].grad = None
        self._drain_param_writes()
        if keep_others:
            stepped = {i for group in groups for i in group}
            for i, master in enumerate(self.masters):
                if i not in stepped:
                    master.grad = grads[i]

    def _start_background(self, groups: list[list[int]], grad_scale: torch.Tensor | None,
                          stands: set[tuple[int, ...]] = frozenset()) -> None:
        """Hand the update to the worker, one shadow optimizer per sub-group, with the
        client's hyper-parameters as they are now; the sub-groups in `stands` were updated
        in the backward (optim/early_update.py) and only write their shards back."""
        if grad_scale is not None and grad_scale.device.type != "cpu":
            grad_scale = grad_scale.cpu()  # here, not by the kernel's asynchronous copy on the worker
        hyper = hyper_parameters(self.optimizer)
        shadows = [self.shadow_with(tuple(group), hyper, grad_scale) for group in groups]

        # The worker's copies into device shards must come after every read of those shards
        # already queued on the compute stream (the backward's gathers).
        queued = record_current_stream(self.placement.compute_device)

        def run(index: int) -> None:
            with self.swap.stepping(index, groups):
                if tuple(groups[index]) not in stands:
                    with self.precision.stepping([self.masters[i] for i in groups[index]]):
                        shadows[index].step()
                self._write_back_shards(groups[index], after=queued)
            for i in groups[index]:
                self.masters[i].grad = None
            if index == len(groups) - 1:
                self._drain_param_writes()

        self.background.start([[self.params[i] for i in group] for group in groups], run)
        # lr schedulers warn when the optimizer they wrap was never stepped.
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def shadow_with(self, group: tuple[int, ...], hyper: list[dict], grad_scale: torch.Tensor | None = None
                    ) -> torch.optim.Optimizer:
        """The shadow optimizer of `group`, on the client's state, with `hyper` (the client's
        groups' hyper-parameters, optim/early_update.py: hyper_parameters) and `grad_scale`."""
        shadow = self._shadow(group)
        shadow.state = self.optimizer.state  # rebound each step: load_state_dict replaces it
        shadow.grad_scale = grad_scale
        for shadow_group in shadow.param_groups:
            shadow_group.update(hyper[shadow_group["client_group"]])
        return shadow

    def _shadow(self, group: tuple[int, ...]) -> torch.optim.Optimizer:
        """A torch optimizer of the client's class over the masters of `group` (cached)."""
        shadow = self._shadows.get(group)
        if shadow is None:
            if len(self._shadows) >= MAX_CACHED_SHADOWS:  # the unit order keeps changing
                self._shadows.clear()
            by_client_group: dict[int, list[torch.Tensor]] = {}
            for i in group:
                by_client_group.setdefault(self._client_group_of[i], []).append(self.masters[i])
            param_groups = [
                {**{k: v for k, v in self.optimizer.param_groups[c].items() if k != "params"},
                 "params": masters, "client_group": c}
                for c, masters in by_client_group.items()
            ]
            shadow = type(self.optimizer)(param_groups)
            self._shadows[group] = shadow
        return shadow

    # ------------------------------------------------------------ placement
    def move_side(self, sp: ShardedParam, device: torch.device) -> None:
        """`sp`'s master and optimizer state to `device`, between steps (optim/state_moves.py)."""
        self.wait()
        master = self._master_by_param.get(id(sp))
        if master is not None:
            index = next(i for i, m in enumerate(self.masters) if m is master)
            group = self.optimizer.param_groups[self._client_group_of[index]]
            move_master(master, self.optimizer.state.get(master, {}), group, device, self.pin_memory)

    def placement_changed(self) -> None:
        """Sub-groups are made anew from the placement's tiers."""
        self._shadows.clear()

    def wait(self) -> None:
        """Until the update in flight (if any) is complete: call before reading or writing
        masters, optimizer state or parameter shards outside the fetch path. Host updates
        started in a backward whose step() has not come are put back first."""
        self.early.abandon()
        self.background.wait()

    def settled_masters(self) -> dict[int, torch.Tensor]:
        """id(ShardedParam) -> its fp32 master, once the update in flight is complete."""
        self.wait()
        return {id(sp): master for sp, master in zip(self.params, self.masters)}

    def _write_back_shards(self, group: list[int], after: torch.cuda.Event | None = None) -> None:
        """master -> compute shard for the parameters of `group` (optim/write_back.py); a
        shard on the NVMe tier is written to its file instead (started here, waited for by
        `_drain_param_writes` at the end of the step: params/nvme_shards.py)."""
        for i in group:
            sp = self.params[i]
            if sp.backing is not None:
                sp.backing.write(sp, self.masters[i])
        self.write_back.write([(self.params[i].shard, self.masters[i]) for i in group
                               if self.masters[i] is not self.params[i].shard and self.params[i].backing is None],
                              after)

    def _drain_param_writes(self) -> None:
        """The step's writes of NVMe-tier shards are on disk (a failed one raised here)."""
        drain_param_writes(self.params)

    def _drop_shard_grads(self) -> None:
        """The window is over: gradient shards dropped, usage forgotten."""
        for sp in self.params:
            sp.grad_shard = None
            sp.grad_sq_norm = None
        if self.usage is not None:
            self.usage.reset()

    def let_go(self) -> None:
        """Teardown: masters, gradient shards and the client optimizer's state dropped (freed
        once nothing else holds them; a master that is its shard stays the shard), so the
        parameters can be gathered whole in their place. No step afterwards."""
        self.wait()
        self.zero_grad()
        self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            group["params"] = []
        self.masters, self._master_by_param, self._shadows = [], {}, {}

    def zero_grad(self) -> None:
        self.early.abandon()
        self._drop_shard_grads()
        for master in self.masters:
            master.grad = None

    def master_of(self, sp: ShardedParam) -> torch.Tensor | None:
        """The fp32 master of `sp`, or None for a parameter the optimizer does not step
        (after the update in flight, if any)."""
        self.wait()
        return self._master_by_param.get(id(sp))


def prefer_fused_kernels(optimizer: torch.optim.Optimizer) -> None:
    """Adam, AdamW and SGD over the shards run as one fused kernel per group, unless the
    user chose an implementation (foreach=... or fused=...) explicitly."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)):
        return
    for group in optimizer.param_groups:
        explicit = group.get("foreach") is not None or group.get("fused") is not None
        if not explicit and not group.get("differentiable") and group["params"]:
            group["fused"] = True


def separate_first_momentum(optimizer: torch.optim.Optimizer, masters: list[torch.Tensor],
                            groups: list[list[int]]) -> list[list[int]]:
    """torch's fused SGD treats a call's momentum buffers as all first (none exists yet)
    or all later ones, and fails on a mix. A parameter stepped for the first time next
    to parameters that have stepped before (it had no gradient until now) is stepped in
    a call of its own, just before the rest of its sub-group (the result is the same:
    the update is elementwise). `groups` index `masters`."""
    if not isinstance(optimizer, torch.optim.SGD):
        return groups
    state = optimizer.state

    def first(i: int) -> bool:
        master = masters[i]
        return master.grad is not None and state.get(master, {}).get("momentum_buffer") is None

    separated = []
    for group in groups:
        new = [i for i in group if first(i)]
        rest = [i for i in group if not first(i)]
        if new and any(masters[i].grad is not None for i in rest):
            separated += [new, rest]
        else:
            separated.append(group)
    return separated


def split_numel(masters: list[torch.Tensor], sub_group_numel: int, indices: list[int]) -> list[list[int]]:
    """Consecutive runs of at most `sub_group_numel` elements (whole parameters; 0: one run)."""
    if not indices:
        return []
    if not sub_group_numel:
        return [indices]
    groups: list[list[int]] = [[]]
    numel = 0
    for i in indices:
        size = masters[i].numel()
        if groups[-1] and numel + size > sub_group_numel:
            groups.append([])
            numel = 0
        groups[-1].append(i)
        numel += size
    return groups


def dist_backend_is_nccl() -> bool:
    return dist.is_initialized() and dist.get_backend() == "nccl"


def settle(optimizer: ShardedOptimizer | None) -> None:
    """Wait for `optimizer`'s update in flight, if there is an optimizer: before code
    outside the step reads or writes parameter shards, masters or optimizer state."""
    if optimizer is not None:
        optimizer.wait()
