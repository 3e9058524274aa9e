"""torch.compile at fetch-unit granularity: each unit's own forward compiled, its hooks eager.

zero3 gathers a unit's parameters in the unit's pre-forward hook and releases them in its
post-forward hook (fetch.py); a released parameter is sealed (released.py) and reads of
parameters go through tracking dicts (discovery.py). None of that may be traced by dynamo:
a traced hook would be frozen into the graph, a sealed parameter refuses the metadata reads
dynamo makes, and a traced tracking dict would replay its bookkeeping. So, as torchtitan
compiles each block under FSDP2, zero3 compiles the *forward* of each unit and leaves
`_call_impl` (hooks) eager: the compiled code sees plain, gathered parameters, never a
released one.

Which units: those whose module holds no other unit below it (a transformer block gathered
whole, an embedding, a norm, a head). A unit with units below it (usually the root) stays
eager, with its children's compiled forwards inside it.

Discovery: inside compiled code a parameter read is a plain dict read (the tracking dict
steps aside while dynamo traces, `TrackedParameters.__getitem__`), so it registers nothing.
Hence each compiled unit runs eagerly through the first root forward that calls it, where
discovery registers every parameter it reads outside its own module (the unit's pre-forward
gathers those from then on); it runs compiled from the next root forward on. A recomputation
in backward (activation checkpointing) belongs to the root forward it recomputes, so it takes
the same path and saves the same tensors. A compiled call that meets a released parameter anyway
(a read that the first call did not make) is refused by the sealed parameter while dynamo
traces; that unit then runs eagerly for good, with discovery, and a warning names it.

Where the compile request comes from (`take_requests`): a module compiled in place before
`zero3.initialize` (`module.compile(...)`, so `_compiled_call_impl` is set), or a
`torch.compile(module)` wrapper (an `OptimizedModule`), at the root or inside the model;
either is unwrapped (parameter names stay those of the plain model, so checkpoints do not
depend on compilation) and its dynamo context reused, options included, for every unit
below it. `engine.compile(backend=..., compile_kwargs=...)` asks the same for the whole model.

Owns no tensors. `remove()` gives every unit module its class's forward back.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from zero3.params.fetch_unit import FetchUnit
from zero3.params.released import ReleasedParameterError

logger = logging.getLogger("zero3")

Compiler = Callable[[Callable], Callable]  # a function -> its compiled version (torch.compile with options)

# Modes whose CUDA graphs replay fixed parameter addresses: zero3 re-allocates a parameter's
# storage at every gather, so such graphs would read stale memory or re-record every step.
CUDAGRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


class CompileError(ValueError):
    """A compile request zero3 cannot honour."""


@dataclasses.dataclass
class CompileRequest:
    """Compile every unit inside `scope` with `compiler` (what the user asked for)."""

    scope: nn.Module
    compiler: Compiler
    origin: str


def check_mode(mode: Any, where: str) -> None:
    """Refuse the torch.compile modes that capture CUDA graphs (see CUDAGRAPH_MODES)."""
    if mode in CUDAGRAPH_MODES:
        raise CompileError(
            f"{where}: mode={mode!r} captures CUDA graphs, which replay fixed parameter addresses, but zero3 "
            "gathers each parameter into new storage on every use; use mode='max-autotune-no-cudagraphs' "
            "or 'default'")


def compiler_for(backend: Any = "inductor", options: dict | None = None, where: str = "torch.compile") -> Compiler:
    """`torch.compile(fn, backend=backend, **options)` as a Compiler (engine.compile, the HF Trainer)."""
    options = dict(options or {})
    check_mode(options.get("mode"), where)

    def compile_fn(fn: Callable) -> Callable:
        return torch.compile(fn, backend=backend, **options)

    return compile_fn


# ------------------------------------------------------------- user requests
def _dynamo_context_of(compiled: Callable) -> Compiler | None:
    """The dynamo context (its backend and options) behind a function made by torch.compile."""
    context = inspect.getclosurevars(compiled).nonlocals.get("self") if inspect.isfunction(compiled) else None
    return context if isinstance(context, torch._dynamo.eval_frame._TorchDynamoContext) else None


def _unwrap(module: nn.Module, where: str) -> tuple[nn.Module, CompileRequest | None]:
    """`module` without its torch.compile wrapper, and the request the wrapper made."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        inner = module._orig_mod
        return inner, CompileRequest(inner, module.dynamo_ctx, f"torch.compile({where or 'model'})")
    compiled = module.__dict__.get("_compiled_call_impl")
    if compiled is None:
        return module, None
    module._compiled_call_impl = None  # its hooks are zero3's, and stay eager
    compiler = _dynamo_context_of(compiled)
    if compiler is None:
        logger.warning("zero3: %s.compile() was called with options zero3 cannot read back; its units are "
                       "compiled with torch.compile's defaults", where or "model")
        compiler = compiler_for()
    return module, CompileRequest(module, compiler, f"{where or 'model'}.compile()")


def take_requests(model: nn.Module) -> tuple[nn.Module, list[CompileRequest]]:
    """The model without torch.compile wrappers, and what was asked to compile (before
    initialize). A wrapped child is replaced by its original module in its parent."""
    model, request = _unwrap(model, "")
    requests = [request] if request is not None else []
    while True:
        inner, request = _unwrap(model, "")
        if request is None:
            break
        model = inner
        requests.append(request)
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):
            if child is None:
                continue
            where = f"{parent_name}.{name}" if parent_name else name
            inner, request = _unwrap(child, where)
            if request is not None:
                parent._modules[name] = inner
                requests.append(request)
    return model, requests


# ------------------------------------------------------------- compiled units
def compilable(units: list[FetchUnit]) -> list[FetchUnit]:
    """Units whose module holds no other unit below it (their forward has no zero3 hook inside)."""
    unit_modules = {id(u.module) for u in units}
    return [u for u in units
            if not any(id(m) in unit_modules for m in u.module.modules() if m is not u.module)]


class UnitForward:
    """A unit module's forward: eager through the first root forward that calls it
    (discovery), compiled afterwards. `root_forwards()` counts the root forwards begun.

    Installed as the module's instance attribute `forward`, so `_call_impl` (and zero3's hooks
    in it) stays eager and calls this."""

    def __init__(self, unit: FetchUnit, compiler: Compiler, root_forwards: Callable[[], int]) -> None:
        self.unit = unit
        self.eager = type(unit.module).forward.__get__(unit.module)
        self.compiled = compiler(self.eager)
        self.root_forwards = root_forwards
        self.discovery_forward: int | None = None  # the root forward that ran it eagerly
        self.fell_back = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        current = self.root_forwards()
        if self.discovery_forward is None:
            self.discovery_forward = current
        if current == self.discovery_forward or self.fell_back:
            return self.eager(*args, **kwargs)
        try:
            return self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - only a released read is handled; others re-raised
            released = _released_cause(exc)
            if released is None:
                raise
            self.fell_back = True
            logger.warning("zero3: the compiled forward of %s read a parameter outside its module that its first "
                           "call did not read (%s); this unit runs eagerly from now on", self.unit.name, released)
            return self.eager(*args, **kwargs)


def _released_cause(exc: BaseException) -> ReleasedParameterError | None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ReleasedParameterError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class CompiledUnits:
    """Which unit forwards run compiled, for one engine (see the module docstring)."""

    def __init__(self, units: list[FetchUnit], root_forwards: Callable[[], int]) -> None:
        self.units = units
        self.root_forwards = root_forwards
        self.forwards: dict[int, UnitForward] = {}

    @property
    def active(self) -> bool:
        return bool(self.forwards)

    def apply(self, request: CompileRequest) -> int:
        """Compile the units inside `request.scope`; returns how many were compiled now."""
        inside = {id(m) for m in request.scope.modules()}
        count = 0
        for unit in compilable(self.units):
            if id(unit.module) in inside and id(unit) not in self.forwards:
                forward = UnitForward(unit, request.compiler, self.root_forwards)
                unit.module.forward = forward
                self.forwards[id(unit)] = forward
                count += 1
        return count

    def fallbacks(self) -> list[str]:
        """Names of the units that run eagerly after a compiled call met a released parameter."""
        return [f.unit.name for f in self.forwards.values() if f.fell_back]

    def remove(self) -> None:
        for forward in self.forwards.values():
            if forward.unit.module.__dict__.get("forward") is forward:
                del forward.unit.module.forward
        self.forwards.clear()
