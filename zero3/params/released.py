"""Released parameters: a parameter whose storage was freed while its shape stayed.

zero3 frees a sharded parameter's storage (`untyped_storage().resize_(0)`) and keeps its
shape, dtype and device. Many torch kernels do not check the storage size before they
read or write (`add_`, `sum`, `clone`, `copy_` ...), so touching such a tensor's values
would read or write freed memory: a segmentation fault at best.

Two guards make every such touch fail loudly with `ReleasedParameterError`:

- zero3's own paths check first, through `refuse_released`.
- Any other code (user code between steps, a library, `model.to(dtype)`, `copy.deepcopy`,
  `load_state_dict`) meets the parameter *sealed*: `release_storage` frees the storage
  and gives the parameter a sealed class, a subclass of its own class (so `isinstance`
  and the DeepSpeed status properties stay) whose `__torch_function__` lets metadata
  through (`shape`, `dtype`, `numel()`, `requires_grad`, hooks, a `.to()` that changes
  nothing) and refuses anything that reads or writes values, naming the call and the
  parameter. An alias taken while sealed (`p.data`, `p.detach()`) is sealed too, and
  checks the storage at each call, so it works again once the values are back.
  `restore_storage` gives the plain class back before the storage is re-allocated, so a
  gathered parameter pays nothing. This is torch's own pattern for lazy parameters
  (`UninitializedParameter` changes `__class__` when materialized); nothing is stored
  on the parameter.

Aliases taken while a parameter is gathered (`p.detach().cpu()` on the CPU, `p.data`, a
NumPy view) share its storage. Where the release comes from GatheredParameters
(`keep_aliases`) and such a tensor holds the storage (its use count, torch's
`_storage_Use_Count`, is above the parameter's own), they keep their values, as under
DeepSpeed: the parameter moves to a fresh, empty storage and the old one stays whole with
its holders, freed with the last of them. Nothing else holding it, the storage is freed in
place. Sealed aliases (taken while released) follow the parameter instead: where one is
alive, the storage is freed in place, and they are sealed again.
Releases while the model runs always free in place, so that the tensors autograd saved
in forward are freed too and valid again once the parameter is gathered for backward.

Nothing here holds memory: the checks read metadata only; `_sealed_aliases` holds weak
references.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

_state_dict_guarded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> state_dict hook handle
_load_guarded: WeakIdKeyDictionary = WeakIdKeyDictionary()  # module -> load_state_dict hook handle

HOW_TO_REACH_VALUES = (
    "read or change its values inside `with zero3.GatheredParameters(params, modifier_rank=...)`, "
    "or through the engine (engine(...), engine.state_dict(), zero3.checkpoint.export.consolidated_state_dict)"
)


class ReleasedParameterError(RuntimeError):
    """The values of a parameter were touched while its storage is released (sharded)."""


def is_released(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has elements but its storage cannot hold them (freed by zero3)."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return False
    needed = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    return tensor.untyped_storage().nbytes() < needed


def describe(tensor: torch.Tensor, name: str | None = None) -> str:
    shape = "x".join(str(s) for s in tensor.shape)
    return f"parameter {name!r} ({shape}, {tensor.dtype})" if name else f"a parameter of shape ({shape}, {tensor.dtype})"


def refuse_released(tensor: torch.Tensor, what: str, name: str | None = None, fix: str = HOW_TO_REACH_VALUES) -> None:
    """Raise ReleasedParameterError if `tensor` is released; `what` says who was about to touch it."""
    if is_released(tensor):
        raise ReleasedParameterError(
            f"{what}: {describe(tensor, name)} is sharded (its storage is released, "
            f"{tensor.untyped_storage().nbytes()} bytes held), so its values are not on this rank; {fix}"
        )


def guard_state_dict(module: nn.Module) -> None:
    """`module.state_dict()` gives, for each of its own parameters that is released, a
    tensor on the meta device of the same shape and dtype instead of the released one:
    names, shapes and dtypes stay, and any read of its values fails loudly ("Cannot copy
    out of meta tensor") instead of reading freed memory. Gathered (FULL) parameters are
    given as usual, so `with GatheredParameters(params): module.state_dict()` has the
    values. With keep_vars=True the parameters themselves are given. Idempotent."""
    if module not in _state_dict_guarded:
        _state_dict_guarded[module] = module.register_state_dict_post_hook(_meta_for_released)


def guard_load_state_dict(module: nn.Module) -> None:
    """`module.load_state_dict(sd)` that would write a released parameter is refused
    before anything is written (the first module loaded checks its whole subtree), so a
    refused load leaves every value as it was. For an engine's model; inside zero3.Init
    a load writes partitioned parameters through the context instead. Idempotent."""
    if module not in _load_guarded:
        _load_guarded[module] = module.register_load_state_dict_pre_hook(_refuse_load_into_released)


def _refuse_load_into_released(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    released = [prefix + name for name, param in module.named_parameters()
                if prefix + name in state_dict and is_released(param)]
    if released:
        shown = ", ".join(repr(name) for name in released[:4]) + (", ..." if len(released) > 4 else "")
        raise ReleasedParameterError(
            f"load_state_dict into parameters sharded by zero3 ({shown}; {len(released)} in all): their values "
            "are not on this rank, and nothing was loaded. Load inside `with zero3.GatheredParameters("
            "list(model.parameters()), modifier_rank=0):` on every rank (rank 0's values are kept), or "
            "resume with engine.load_checkpoint"
        )


def _meta_for_released(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    for name, param in module._parameters.items():
        key = prefix + name
        value = state_dict.get(key)
        if param is None or value is None or value is param or not is_released(value):
            continue
        state_dict[key] = torch.empty(value.shape, dtype=value.dtype, device="meta")


# ------------------------------------------------------------------ sealing
# Tensor methods that read metadata only (never values): allowed on a released tensor.
METADATA_METHODS = frozenset({
    "numel", "nelement", "dim", "ndimension", "size", "stride", "is_floating_point", "is_complex",
    "element_size", "is_contiguous", "requires_grad_", "untyped_storage", "data_ptr", "storage_offset",
    "get_device", "__hash__", "__len__", "type", "is_pinned", "is_shared", "is_inference",
    "is_signed", "_is_view", "__dir__",
})

# Calls a sealed tensor lets through beyond METADATA_METHODS: they give an alias or
# register a hook, touching no values; an alias that comes out released is sealed too.
_ALIAS_OR_HOOK = frozenset({
    "detach", "register_hook", "register_post_accumulate_grad_hook", "retain_grad",
    "_has_compatible_shallow_copy_type",
})

# autograd calls that take a sealed parameter as an input or output of differentiation: they
# use its gradient edge (where its gradient accumulates), never its values; what backward reads
# of a parameter it reads through the tensors autograd saved, which zero3 gathers (late_params.py).
# Tiled compute (zero3/sequence/tiled.py) asks for and hands over parameters' gradients this way.
_GRADIENT_EDGE_CALLS = frozenset({torch.autograd.grad, torch.autograd.backward})

# Attributes that compute a new view of the values (`p.T`): refused like any view.
VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})

_CONVERSIONS = {"float": torch.float32, "double": torch.float64, "half": torch.float16,
                "bfloat16": torch.bfloat16}

_sealed_classes: dict[type, type] = {}
_names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> its name in the model, for errors
_sealed_aliases: dict[int, list[weakref.ref]] = {}  # storage (_cdata) -> sealed aliases living on it


class _Sealed:
    """Mixin of the classes a released tensor wears (see the module docstring). Its
    `_plain_class` (a class attribute) is the class the tensor had before."""

    _plain_class: type = torch.Tensor

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            return _call_sealed(func, args, kwargs or {})

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            if not is_released(self):
                return torch.Tensor.__repr__(self, *args, **kwargs)
            shape = "x".join(str(s) for s in self.shape)
            return (f"{self._plain_class.__name__}(sharded by zero3: shape {shape}, {self.dtype}, "
                    f"{self.device}; this rank holds only its shard)")

    def __format__(self, spec: str) -> str:
        with torch._C.DisableTorchFunctionSubclass():
            if is_released(self):
                return format(repr(self), spec)
        return super().__format__(spec)

    def __deepcopy__(self, memo: dict) -> Any:
        _refuse_sealed_copy(self, "copy.deepcopy")
        return super().__deepcopy__(memo)

    def __reduce_ex__(self, protocol: Any) -> Any:
        _refuse_sealed_copy(self, "pickling (torch.save, copy.deepcopy, multiprocessing)")
        return super().__reduce_ex__(protocol)


class ReleasedTensor(_Sealed, torch.Tensor):
    """An alias (`p.data`, `p.detach()`) taken of a sealed parameter."""


def _refuse_sealed_copy(tensor: torch.Tensor, what: str) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        refuse_released(tensor, what, fix=HOW_TO_REACH_VALUES + "; to copy the whole model, export it "
                        "(engine.save_16bit_model or zero3.checkpoint.export.consolidated_state_dict) and load that")


def sealed_class_for(cls: type) -> type:
    """The sealed subclass of tensor class `cls` (made once per class)."""
    if issubclass(cls, _Sealed):
        return cls
    if cls not in _sealed_classes:
        _sealed_classes[cls] = type(f"Sharded{cls.__name__}", (_Sealed, cls), {"_plain_class": cls,
                                                                             "__module__": __name__})
    return _sealed_classes[cls]


def is_sealed(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, _Sealed)


def plain_class(tensor: torch.Tensor) -> type:
    """The class `tensor` has when its values are present."""
    return type(tensor)._plain_class if is_sealed(tensor) else type(tensor)


def set_plain_class(tensor: torch.Tensor, cls: type) -> None:
    """Give `tensor` the class `cls` when unsealed (and its sealed subclass while sealed)."""
    tensor.__class__ = sealed_class_for(cls) if is_sealed(tensor) else cls


def seal(tensor: torch.Tensor) -> None:
    if not is_sealed(tensor):
        tensor.__class__ = sealed_class_for(type(tensor))


def seal_alias(alias: torch.Tensor) -> torch.Tensor:
    """Seal `alias`, a tensor on a released parameter's storage that should follow the
    parameter (values back while it is gathered, refused while released); returns it."""
    seal(alias)
    key = alias.untyped_storage()._cdata
    _sealed_aliases[key] = _live_sealed_aliases(key) + [weakref.ref(alias)]
    return alias


def _live_sealed_aliases(key: int) -> list[weakref.ref]:
    """The sealed aliases on storage `key` still alive; the dead ones are forgotten."""
    live = [ref for ref in _sealed_aliases.pop(key, []) if ref() is not None]
    if live:
        _sealed_aliases[key] = live
    return live


def unseal(tensor: torch.Tensor) -> None:
    if is_sealed(tensor):
        tensor.__class__ = type(tensor)._plain_class


def name_for_errors(param: torch.Tensor, name: str) -> None:
    """`name` (the parameter's name in the model) is used in the errors a sealed call raises."""
    _names[param] = name


def release_storage(param: torch.Tensor, keep_aliases: bool = False) -> bool:
    """Free `param`'s storage (its shape, dtype and device stay) and seal it; True when the
    parameter moved to a fresh storage (the old one's holders keep it) instead.

    It moves when its storage cannot be resized (user code read the gathered values as
    NumPy: `p.detach().cpu().numpy()` shares the storage on CPU and marks it not resizable
    for good), and with `keep_aliases` unless a sealed alias lives on it (module doc).
    Memory: a held storage is its holders' from then on; the parameter owns only the fresh,
    empty one."""
    storage = param.untyped_storage()
    moved = not storage.resizable() or (keep_aliases and _held_by_others(storage))
    if moved:
        _move_to_empty_storage(param)
    else:
        storage.resize_(0)
    seal(param)
    return moved


def _held_by_others(storage: torch.UntypedStorage) -> bool:
    """Whether a tensor other than the parameter (and `storage`, this Python handle on it)
    holds `storage`, sealed aliases aside."""
    others = torch._C._storage_Use_Count(storage._cdata) - 2
    return others > 0 and not _live_sealed_aliases(storage._cdata)


def _move_to_empty_storage(param: torch.Tensor) -> None:
    """`param` onto a new storage, emptied at once, its shape, strides, dtype and device
    kept (the new full-size allocation lives only between these two lines); the old storage
    is left to whoever else holds it."""
    with torch.no_grad():
        param.data = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device=param.device)
    param.untyped_storage().resize_(0)


def restore_storage(param: torch.Tensor) -> None:
    """Unseal `param` and give it a storage for its full values again (not yet written)."""
    unseal(param)
    param.untyped_storage().resize_(param.numel() * param.element_size())


def _call_sealed(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` for a call involving a sealed tensor, or refuse it. Runs with subclass
    dispatch disabled, so metadata reads here do not come back."""
    released = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and is_released(t)]
    if not released:  # a sealed alias whose parameter is gathered again: plain behaviour
        return func(*args, **kwargs)
    if _is_metadata(func, args, kwargs):
        return _seal_released(func(*args, **kwargs))
    if func in _GRADIENT_EDGE_CALLS:  # the parameter names a gradient edge; values are read through saved tensors
        return func(*args, **kwargs)
    if _changes_nothing(func, args, kwargs):
        return args[0]
    what = describe(released[0], _names.get(released[0]))
    raise ReleasedParameterError(
        f"{_call_name(func)} on {what}: it is sharded by zero3 (its storage is released), so its values "
        f"are not on this rank; {HOW_TO_REACH_VALUES}"
    )


def attribute_of(func: Any) -> str | None:
    """The tensor attribute a torch function call reads or writes (`"data"` for
    `Tensor.data.__set__`), or None when the call is not an attribute access."""
    owner = getattr(func, "__self__", None)
    return owner.__name__ if type(owner).__name__ == "getset_descriptor" else None


def _is_metadata(func: Any, args: tuple, kwargs: dict) -> bool:
    name = getattr(func, "__name__", "")
    attribute = attribute_of(func)
    if attribute is not None:  # an attribute read or write
        if name == "__set__" and attribute == "data":
            return len(args) > 1 and args[1] is args[0]  # `p.data = p`, as module.to() does
        return attribute not in VIEW_ATTRIBUTES
    if name == "type":
        return len(args) == 1 and not kwargs  # `p.type()` names the type; with a type it converts
    return name in METADATA_METHODS or name in _ALIAS_OR_HOOK


def _changes_nothing(func: Any, args: tuple, kwargs: dict) -> bool:
    """A conversion to the dtype and device the tensor has already (torch returns the tensor itself)."""
    name = getattr(func, "__name__", "")
    if not args or not isinstance(args[0], torch.Tensor) or kwargs.get("copy"):
        return False
    tensor = args[0]
    if name in _CONVERSIONS:
        return not args[1:] and _CONVERSIONS[name] == tensor.dtype
    if name == "cpu":
        return tensor.device.type == "cpu"
    if name == "cuda":
        return _cuda_changes_nothing(tensor, args[1] if len(args) > 1 else kwargs.get("device"))
    if name != "to":
        return False
    try:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return False
    return ((device is None or _same_device(torch.device(device), tensor.device))
            and (dtype is None or dtype == tensor.dtype)
            and memory_format in (None, torch.preserve_format))


def _cuda_changes_nothing(tensor: torch.Tensor, device: Any) -> bool:
    """`tensor.cuda(device)` returns `tensor` itself: it is on that CUDA device already."""
    if tensor.device.type != "cuda":
        return False
    if device is None:
        return tensor.device.index == torch.cuda.current_device()
    wanted = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    return _same_device(wanted, tensor.device)


def _same_device(wanted: torch.device, have: torch.device) -> bool:
    """Whether a move to `wanted` leaves a tensor on `have` where it is. Every CPU index
    names the one host memory (Accelerate moves CPU models to `cpu:0`)."""
    if wanted.type != have.type:
        return False
    return wanted.type == "cpu" or wanted.index is None or wanted.index == have.index


def _seal_released(result: Any) -> Any:
    """Seal each released tensor in `result` (an alias of a sealed tensor)."""
    def seal_one(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and not is_sealed(t) and is_released(t):
            return seal_alias(t.as_subclass(ReleasedTensor))
        return t
    return pytree.tree_map(seal_one, result)


def _call_name(func: Any) -> str:
    attribute = attribute_of(func)
    if attribute is not None:
        verb = "reading" if getattr(func, "__name__", "") == "__get__" else "assigning"
        return f"{verb} `.{attribute}`"
    return f"`{getattr(func, '__qualname__', None) or getattr(func, '__name__', repr(func))}`"
