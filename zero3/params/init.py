"""`zero3.Init()`: build a model already partitioned (DeepSpeed's `zero.Init`).

    with zero3.Init():
        model = AutoModelForCausalLM.from_config(config)   # or any nn.Module
    engine, *_ = zero3.initialize(model=model, config=ds_config, ...)

Inside the context every parameter is partitioned at the next registration of a parameter
or a module (torch's global registration hooks, active only inside the context), and at
the latest when the context exits: rank 0's values are broadcast, each rank keeps its flat
slice (the same layout as `ShardedParam`), and the parameter's own storage is freed. So
no rank holds more than the parameter(s) being built, plus its shards.

Code that runs inside the context and touches a partitioned parameter's values (a parent
re-initializing a child's weight, Hugging Face's `post_init` weight init, weight tying
that copies) works: the parameter is gathered for that call ("materialized"; a call
that overwrites it whole, such as `torch.nn.init.normal_`, needs no gather) and
partitioned again right after it ("settled", taking rank 0's values), or, when the call
returned a view of it, before the next parameter is materialized or registered; so only
the parameters of the current call are ever full. Reading metadata
(`shape`, `dtype`, `numel()`, ...) does not gather. Building is SPMD: every rank must
construct the same model in the same order (gathers are collectives), as with DeepSpeed.

Memory ownership: a partitioned parameter keeps its identity, shape, dtype and device
(the compute device), with a zero-byte storage; its shard is owned by this module's
registry (`init_shard_of`) until an engine adopts it (`claim_init_shard`). Outside the
context, a partitioned parameter is usable only through the engine or
`zero3.GatheredParameters`; until an engine adopts it, its module's forward raises
`ReleasedParameterError` and its state_dict gives meta tensors (released.py).
"""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

from zero3.params.init_shards import (  # noqa: F401 - init_shard_of, claim_init_shard: this module's API
    INIT_SHARDS,
    InitShard,
    claim_init_shard,
    init_shard_of,
    record_init_shard,
)
from zero3.params.released import (
    METADATA_METHODS,
    VIEW_ATTRIBUTES,
    ReleasedParameterError,
    attribute_of,
    describe,
    guard_state_dict,
    is_released,
    refuse_released,
    release_storage,
    restore_storage,
    seal_alias,
)
from zero3.params.shard_layout import owned_range, shard_numel_for
from zero3.params.status import mark_zero_parameter
from zero3.params.wire import gather_rows
from zero3.platform.collectives import Communicator
from zero3.platform.device import get_accelerator
from zero3.platform.pinned import pinned_empty


class InitError(RuntimeError):
    """zero3.Init was given something it cannot do."""


# Calls that write every value of their first argument without reading it: a partitioned
# parameter there needs its storage back, not its values (no gather).
_OVERWRITES_FIRST_ARGUMENT = frozenset({
    "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "copy_", "eye_", "dirac_",
    "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_",
    "orthogonal_", "sparse_", "random_", "exponential_", "log_normal_", "cauchy_", "geometric_",
})


def _overwritten(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a call overwrites whole without reading it (its first argument, or
    torch.nn.init's `tensor=`, which no other argument is), if it is such a call."""
    if getattr(func, "__name__", "") not in _OVERWRITES_FIRST_ARGUMENT:
        return None
    target = args[0] if args else kwargs.get("tensor")
    others = list(args[1:]) + [v for k, v in kwargs.items() if k != "tensor"]
    if not isinstance(target, torch.Tensor) or any(t is target for t in pytree.tree_leaves(others)):
        return None
    return target


def _is_data_assignment(func: Any) -> bool:
    """`param.data = tensor` (the `data` attribute's setter)."""
    return attribute_of(func) == "data" and getattr(func, "__name__", "") == "__set__"


def _touches_values(func: Any) -> bool:
    """Whether a torch function call may read or write a tensor argument's values."""
    attribute = attribute_of(func)
    if attribute is not None:  # an attribute: `.data` and views (`.T`) alias values
        return attribute == "data" or attribute in VIEW_ATTRIBUTES
    return getattr(func, "__name__", "") not in METADATA_METHODS


_forward_guarded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> hook handle


def _guard_module(module: nn.Module) -> None:
    """A module holding partitioned parameters refuses to run outside the context and
    before an engine adopts them, and its state_dict gives no released storage."""
    guard_state_dict(module)
    if module not in _forward_guarded:
        _forward_guarded[module] = module.register_forward_pre_hook(_refuse_partitioned_forward)


def drop_forward_guards(model: nn.Module) -> None:
    """An engine has adopted `model`'s parameters: its modules' forward guards go."""
    for module in model.modules():
        handle = _forward_guarded.pop(module, None)
        if handle is not None:
            handle.remove()


def _refuse_partitioned_forward(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: no-op once an engine has adopted the parameters (or inside Init)."""
    if Init._active is not None:
        return
    for name, param in module._parameters.items():
        if param is not None and param in INIT_SHARDS and is_released(param):
            raise ReleasedParameterError(
                f"forward of {type(module).__name__} outside zero3.Init and before zero3.initialize: its "
                f"{describe(param, name)} is partitioned (this rank holds a shard only). Pass the model to "
                "zero3.initialize and call the engine, or gather the parameters you need with "
                "zero3.GatheredParameters(params)"
            )


class _MaterializeOnUse(TorchFunctionMode):
    """Gathers a partitioned parameter for any call that touches its values."""

    def __init__(self, init: "Init") -> None:
        super().__init__()
        self.init = init

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.init.busy and _touches_values(func):
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            touched = [t for t in tensors if t in INIT_SHARDS]
            if touched and _is_data_assignment(func):
                self.init.assign_data(args[0], args[1])
                return None
            if touched:
                self.init.materialize(touched, in_use=tensors, overwritten=_overwritten(func, args, kwargs))
                result = func(*args, **kwargs)
                self.init.settle_unless_aliased(touched, result)
                return result
        return func(*args, **kwargs)


class Init:
    """DeepSpeed's `zero.Init`: parameters partitioned while the model is built.

    Arguments as DeepSpeed's. `remote_device="cpu"` keeps the shards in host memory
    (as `offload_param` does; the engine moves them where its config says), `dtype`
    (or the config's `bf16`/`fp16` section) is the dtype parameters are stored in,
    `module=` partitions an already built module, `enabled=False` makes the context a
    no-op. Model-parallel groups, NVMe and quantized weights are refused.
    """

    _active: "Init | None" = None

    def __init__(self, module: nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None,
                 pin_memory: bool = False, config_dict_or_path: Any = None, config: Any = None,
                 enabled: bool = True, dtype: torch.dtype | None = None, mpu: Any = None,
                 zero_param_parallel_group: Any = None, zero_quantized_weights: bool = False,
                 zero_quantized_nontrainable_weights: bool = False,
                 sequence_data_parallel_group: Any = None, param_swapper: Any = None) -> None:
        self.enabled = enabled
        if not enabled:
            return
        _refuse_unsupported(data_parallel_group, mpu, zero_param_parallel_group, zero_quantized_weights,
                            zero_quantized_nontrainable_weights, sequence_data_parallel_group, param_swapper)
        settings = _read_config(config_dict_or_path if config_dict_or_path is not None else config)
        self.dtype = dtype or settings.get("dtype")
        remote_device = remote_device or settings.get("remote_device")
        if remote_device not in (None, "none", "cpu", "cuda"):
            raise InitError(f"zero3.Init(remote_device={remote_device!r}): use 'cpu' (host shards) or None")
        if not dist.is_initialized():
            from zero3.platform.process_group import init_distributed

            init_distributed()
        self.comm = Communicator()
        self.compute_device = get_accelerator().device()
        self.shard_device = torch.device("cpu") if remote_device == "cpu" else self.compute_device
        self.pin_memory = pin_memory or settings.get("pin_memory", False)
        self._pending: list[nn.Parameter] = []  # registered, not yet partitioned
        self._materialized: dict[int, nn.Parameter] = {}
        self._aliases: dict[int, list[weakref.ref]] = {}  # id(materialized param) -> tensors on its storage
        self._handles: list[Any] = []
        self._mode: _MaterializeOnUse | None = None
        self.busy = False  # inside a transition: its own tensor ops must not gather
        self._outer: Init | None = None
        if module is not None:
            self.partition_module(module)

    # ---------------------------------------------------------------- context
    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        self._outer = Init._active
        if self._outer is not None:  # nested: the outer context does the work
            return self
        self._install()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or self._outer is not None:
            return None
        try:
            self._uninstall(*exc)
            if exc[0] is None:
                self._partition_pending()
        finally:
            self._pending.clear()
        return None

    def _install(self) -> None:
        """Make this context the active one: registration hooks and the materializing mode on."""
        Init._active = self
        hooks = nn.modules.module
        self._handles = [
            hooks.register_module_parameter_registration_hook(self._on_parameter_registered),
            hooks.register_module_module_registration_hook(self._on_module_registered),
        ]
        self._mode = _MaterializeOnUse(self)
        self._mode.__enter__()

    def _uninstall(self, *exc) -> None:
        try:
            self._mode.__exit__(*(exc or (None, None, None)))
        finally:
            for handle in self._handles:
                handle.remove()
            self._handles = []
            Init._active = None

    @classmethod
    @contextlib.contextmanager
    def paused(cls):
        """The active context (if any) paused for the block: what it has registered is
        partitioned first, then nothing built or touched in the block is partitioned or
        gathered by it (zero3.initialize called inside the context adopts the model built
        there, as DeepSpeed's does); it is active again after the block."""
        active = cls._active
        if active is None:
            yield
            return
        active._partition_pending()
        active._uninstall()
        try:
            yield
        finally:
            active._install()

    # ------------------------------------------------------------------ hooks
    def _on_parameter_registered(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        """A new parameter: the ones registered before it are partitioned now."""
        self._partition_pending()
        _guard_module(module)
        if param is not None and param not in INIT_SHARDS:
            self._pending.append(param)

    def _on_module_registered(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        """A child is registered once its `__init__` has returned: partition its parameters."""
        self._partition_pending()
        if child is not None:
            self.partition_module(child)

    def _partition_pending(self) -> None:
        """Settle what was materialized, partition what was registered since the last event.

        Partitioning a parameter before its module has initialised it is correct (the
        initialisation then materializes it), so at any time only the parameters
        registered since the last registration event and those of the current call are full.
        """
        self.settle_all()
        while self._pending:
            self.partition(self._pending.pop())

    # ------------------------------------------------------------ transitions
    def partition_module(self, module: nn.Module) -> None:
        for child in module.modules():
            _guard_module(child)
        for param in module.parameters():
            self.partition(param)

    def partition(self, param: nn.Parameter) -> None:
        """Full -> partitioned: rank 0's values broadcast, this rank's slice kept, storage freed.

        A parameter on the meta device has no values yet (Transformers' from_pretrained
        builds the model on meta, then registers each loaded weight as a new parameter,
        which is partitioned then): it is left as it is."""
        if param in INIT_SHARDS or param.is_meta:
            return
        refuse_released(param, "zero3.Init: partitioning a parameter registered in the context",
                        fix="it is sharded by an engine already: build new modules with their own parameters, "
                        "or gather it with zero3.GatheredParameters and copy its values")
        with self._transition(), torch.no_grad():
            full = self._full_on_compute_device(param)
            self.comm.broadcast(full, src=0)
            record_init_shard(param, InitShard(self._slice(full), param.numel(), self.comm.world_size, self.comm.rank))
            param.data = full
            release_storage(param)
            mark_zero_parameter(param)

    def assign_data(self, param: nn.Parameter, value: torch.Tensor) -> None:
        """`param.data = value` on a partitioned parameter: `value`'s values are copied into
        the parameter's own storage, then partitioned (rank 0's values); `value` keeps its
        own storage, so freeing the parameter's never frees the caller's tensor."""
        if tuple(value.shape) != tuple(param.shape) or value.dtype != param.dtype:
            raise InitError(
                f"zero3.Init: `param.data = tensor` with a tensor of shape {tuple(value.shape)} {value.dtype} on "
                f"a partitioned parameter of shape {tuple(param.shape)} {param.dtype}; a partitioned parameter "
                "keeps its shape and dtype: assign a tensor of the same shape and dtype, or build the module "
                "with the right shape"
            )
        refuse_released(value, "zero3.Init: `param.data = tensor`")
        self.materialize([param], in_use=[param, value], overwritten=param)
        with self._transition(), torch.no_grad():
            param.data.copy_(value)
        self.settle_unless_aliased([param], None)

    def materialize(self, params: list[torch.Tensor], in_use: list[torch.Tensor] = (),
                    overwritten: torch.Tensor | None = None) -> None:
        """Partitioned -> full for one call. First every other materialized parameter is
        settled and every pending one not used by the call (`in_use`) is partitioned, so
        only the call's parameters are full. `overwritten` (the call writes all of it
        and reads none) gets its storage back without a gather."""
        with self._transition():
            self._materialize(params, {id(t) for t in in_use}, overwritten)

    def _materialize(self, params: list[torch.Tensor], in_use: set[int], overwritten: torch.Tensor | None) -> None:
        wanted = {id(p): p for p in params}
        for key in [k for k in self._materialized if k not in wanted]:
            self._settle(self._materialized.pop(key))
        keep = [p for p in self._pending if id(p) in in_use]
        for param in self._pending:
            if id(param) not in in_use:
                self.partition(param)
        self._pending = keep
        for key, param in wanted.items():
            if key in self._materialized:
                continue
            record = INIT_SHARDS[param]
            restore_storage(param)
            self._materialized[key] = param
            if param is overwritten:
                continue
            flat = param.data.view(-1)
            rows = gather_rows(self.comm, record.shard, self.compute_device).view(-1)
            with torch.no_grad():
                flat.copy_(rows[:flat.numel()])

    def settle_unless_aliased(self, params: list[torch.Tensor], result: Any) -> None:
        """After a call: settle each of its parameters at once, unless the call returned
        another tensor on its storage (a view, `.data`), which the caller will go on using;
        those are settled at the next materialization or registration."""
        with self._transition():
            outputs = [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor)]
            for param in params:
                if id(param) not in self._materialized:
                    continue
                where = param.untyped_storage().data_ptr()
                aliases = [t for t in outputs if t is not param and t.untyped_storage().data_ptr() == where]
                self._aliases.setdefault(id(param), []).extend(weakref.ref(t) for t in aliases)
                if not aliases:
                    self._settle(self._materialized.pop(id(param)))

    def settle_all(self) -> None:
        with self._transition():
            while self._materialized:
                self._settle(self._materialized.popitem()[1])

    def _settle(self, param: nn.Parameter) -> None:
        """Full -> partitioned again after a call that may have changed it: rank 0's values."""
        record = INIT_SHARDS[param]
        with torch.no_grad():
            full = param.data.contiguous()
            self.comm.broadcast(full, src=0)
            self._copy_slice_into(full, record.shard)
        release_storage(param)
        for alias in self._aliases.pop(id(param), []):
            if alias() is not None:
                seal_alias(alias())  # a view or `.data` the caller kept: it follows the parameter

    # ---------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _transition(self):
        outer, self.busy = self.busy, True
        try:
            yield
        finally:
            self.busy = outer

    def _full_on_compute_device(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's values on the compute device in the storage dtype, in a tensor
        that owns its storage alone (so freeing it frees the memory)."""
        dtype = self.dtype if (self.dtype is not None and param.is_floating_point()) else param.dtype
        full = param.data.to(self.compute_device, dtype)
        storage = full.untyped_storage()
        exclusive = (full.is_contiguous() and full.storage_offset() == 0 and storage.resizable()
                     and storage.nbytes() == full.numel() * full.element_size())  # not a file mapping
        return full if exclusive else full.clone(memory_format=torch.contiguous_format)

    def _copy_slice_into(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """This rank's slice of `full` into the existing `shard` (padding zeroed), with no temporary."""
        start, end = owned_range(full.numel(), shard.numel(), self.comm.rank)
        shard[:end - start].copy_(full.reshape(-1)[start:end])
        shard[end - start:].zero_()

    def _slice(self, full: torch.Tensor) -> torch.Tensor:
        """A new shard (on the shard device, pinned if asked) holding this rank's slice of `full`."""
        numel = shard_numel_for(full.numel(), self.comm.world_size)
        if self.pin_memory and self.shard_device.type == "cpu" and torch.cuda.is_available():
            shard = pinned_empty(numel, full.dtype)
        else:
            shard = torch.empty(numel, dtype=full.dtype, device=self.shard_device)
        self._copy_slice_into(full, shard)
        return shard


def _refuse_unsupported(data_parallel_group, mpu, zero_param_parallel_group, zero_quantized_weights,
                        zero_quantized_nontrainable_weights, sequence_data_parallel_group, param_swapper) -> None:
    refused = {
        "mpu": mpu, "zero_param_parallel_group": zero_param_parallel_group,
        "sequence_data_parallel_group": sequence_data_parallel_group, "param_swapper": param_swapper,
    }
    for name, value in refused.items():
        if value is not None:
            raise InitError(f"zero3.Init({name}=...) is not supported (no model/sequence parallelism or "
                            f"NVMe in zero3); leave it None")
    if zero_quantized_weights or zero_quantized_nontrainable_weights:
        raise InitError("zero3.Init: quantized weights are not supported; leave zero_quantized_* False")
    if data_parallel_group is not None and data_parallel_group is not dist.group.WORLD:
        raise InitError("zero3.Init(data_parallel_group=...): zero3 shards over the default process group; "
                        "leave it None")


def _read_config(config: Any) -> dict:
    """What Init takes from a DeepSpeed config: the storage dtype and the shards' device."""
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        config = getattr(config, "config", None) or {}
    settings: dict = {}
    # "auto" (a Hugging Face placeholder) decides nothing: the values keep the dtype they
    # are built or loaded in, and the engine casts them to its compute dtype.
    if _enabled(config.get("bf16") or config.get("bfloat16")):
        settings["dtype"] = torch.bfloat16
    elif _enabled(config.get("fp16")):
        settings["dtype"] = torch.float16
    offload = (config.get("zero_optimization", {}) or {}).get("offload_param") or {}
    if offload.get("device") == "cpu":
        settings["remote_device"] = "cpu"
        settings["pin_memory"] = bool(offload.get("pin_memory", False))
    return settings


def _enabled(section: Any) -> bool:
    return isinstance(section, dict) and section.get("enabled") is True
