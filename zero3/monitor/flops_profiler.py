"""DeepSpeed's flops profiler (the ``flops_profiler`` config section), over torch's flop counter.

At the optimizer step ``profile_step`` (the engine's ``global_steps`` when the window's first
forward starts), rank 0 runs that forward under `torch.utils.flop_counter.FlopCounterMode`
with process-wide forward hooks that time each module of the engine's model (the device
synchronized around each call). The backward and the optimizer step of that window are timed
as the engine's phases. At the window's optimizer step the summary is printed in DeepSpeed's
layout (to ``output_file`` when set): sizes, parameters, the forward's MACs and flops,
latencies and FLOPS, the top modules per depth and, with ``detailed``, the module tree with
each module's share.

What is counted: the operations torch's flop counter knows (matrix products, convolutions,
attention), each as 2 flops a multiply-accumulate, so MACs are half the flops; element-wise
work is not counted. Parameters count whole tensors (a sharded parameter keeps its full
shape). The backward is taken as (2 + ``recompute_fwd_factor``) times the forward's flops, as
DeepSpeed does.

Invariants: one window is profiled, once per engine; the hooks live only during that forward
(removed even when it raises). Memory: the per-module sums of that forward (a few numbers per
module), held until the engine is dropped, for ``get_total_*``.
"""

from __future__ import annotations

import contextlib
import io
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from zero3.config import FlopsProfilerConfig
from zero3.platform.device import synchronize_cuda

_WIDTH = 70  # DeepSpeed's label column


def number_to_string(value: float, precision: int = 2) -> str:
    """`value` scaled to T/G/M/K/(none)/m/u and rounded, e.g. ``"89.45 G"``."""
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1.0, "")):
        if value >= scale:
            break
    else:
        scale, unit = (1.0, "") if value == 0 else ((1e-3, "m") if value >= 1e-3 else (1e-6, "u"))
    return f"{round(value / scale, precision):g} {unit}"


def params_to_string(count: float) -> str:
    return number_to_string(count).replace("G", "B").strip()


@dataclass
class ModuleProfile:
    """One module's share of the profiled forward (its submodules included)."""

    params: int = 0
    flops: int = 0
    seconds: float = 0.0

    @property
    def macs(self) -> int:
        return self.flops // 2


@dataclass
class _Measured:
    forward_s: float = 0.0
    backward_s: float | None = None
    step_s: float | None = None
    modules: dict[str, ModuleProfile] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSizes:
    """What the summary's first lines report (DeepSpeed's world, data and model parallel sizes)."""

    world_size: int
    data_parallel_size: int
    micro_batch: int


class FlopsProfiler:
    """The engine's ``flops_profiler`` (DeepSpeed's attribute); see the module docstring."""

    def __init__(self, settings: FlopsProfilerConfig, rank: int, sizes: Callable[[], EngineSizes]) -> None:
        self.settings = settings
        self.model: nn.Module | None = None  # the engine's model, once a forward is profiled
        self.active = settings.enabled and rank == 0
        self.sizes = sizes
        self.measured: _Measured | None = None
        self._state = "waiting"  # -> "measured" (forward profiled) -> "printed"

    # ------------------------------------------------------------ the engine's phases
    @contextlib.contextmanager
    def phase(self, name: str, global_steps: int, model: nn.Module) -> Iterator[None]:
        """Wraps one engine phase (forward / backward / step of `model`) of optimizer step `global_steps`."""
        if not self.active or self._state == "printed":
            yield
            return
        if name == "forward" and self._state == "waiting" and global_steps == self.settings.profile_step:
            with self._profiled_forward(model):
                yield
            return
        if self._state != "measured" or name not in ("backward", "step"):
            yield
            return
        began = _timed_start()
        yield
        elapsed = _timed_end(began)
        if name == "backward" and self.measured.backward_s is None:
            self.measured.backward_s = elapsed
        elif name == "step":
            self.measured.step_s = elapsed
            self._state = "printed"
            self._print(global_steps)

    @contextlib.contextmanager
    def _profiled_forward(self, model: nn.Module) -> Iterator[None]:
        self.model = model
        modules = {m: name for name, m in _named_modules(model)}
        seconds: dict[nn.Module, float] = defaultdict(float)
        started: list[float] = []

        def before(module: nn.Module, _args) -> None:
            if module in modules:
                started.append(_timed_start())

        def after(module: nn.Module, _args, _output) -> None:
            if module in modules and started:
                seconds[module] += _timed_end(started.pop())

        hooks = [nn.modules.module.register_module_forward_pre_hook(before),
                 nn.modules.module.register_module_forward_hook(after)]
        counter = FlopCounterMode(display=False)
        began = _timed_start()
        try:
            with counter:
                yield
        finally:
            for hook in hooks:
                hook.remove()
        forward_s = _timed_end(began)
        flops = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
        self.measured = _Measured(forward_s=forward_s, modules=_module_profiles(model, flops, seconds))
        self._state = "measured"

    # ------------------------------------------------------------ DeepSpeed's getters
    def _root(self) -> ModuleProfile:
        if self.measured is None or self.model is None:
            return ModuleProfile()
        return self.measured.modules[type(self.model).__name__]

    def get_total_flops(self, as_string: bool = False) -> int | str:
        flops = self._root().flops
        return number_to_string(flops) if as_string else flops

    def get_total_macs(self, as_string: bool = False) -> int | str:
        macs = self._root().macs
        return number_to_string(macs) + "MACs" if as_string else macs

    def get_total_duration(self, as_string: bool = False) -> float | str:
        seconds = self.measured.forward_s if self.measured is not None else 0.0
        return number_to_string(seconds) + "s" if as_string else seconds

    def get_total_params(self, as_string: bool = False) -> int | str:
        params = self._root().params
        return params_to_string(params) if as_string else params

    # ------------------------------------------------------------ the summary
    def _print(self, profile_step: int) -> None:
        text = summary_text(self.measured, self.settings, self.sizes(), profile_step, self.model)
        target = self.settings.output_file
        if target:
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            Path(target).write_text(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()


def _timed_start() -> float:
    synchronize_cuda()
    return time.perf_counter()


def _timed_end(began: float) -> float:
    synchronize_cuda()
    return time.perf_counter() - began


def _named_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """The modules under the names torch's flop counter gives them: the root's class name,
    then its dotted paths."""
    root = type(model).__name__
    for name, module in model.named_modules():
        yield (f"{root}.{name}" if name else root), module


def _module_profiles(model: nn.Module, flops: dict[str, int],
                     seconds: dict[nn.Module, float]) -> dict[str, ModuleProfile]:
    """Each module's profile by name: what was measured at its own calls, or, for a module
    never called itself (a ModuleList), the sum of its children's, as DeepSpeed reports it."""
    profiles: dict[str, ModuleProfile] = {}

    def visit(module: nn.Module, name: str) -> ModuleProfile:
        children = [visit(child, f"{name}.{child_name}") for child_name, child in module.named_children()]
        called = module in seconds
        profile = ModuleProfile(_param_count(module),
                                flops.get(name, 0) if called else sum(c.flops for c in children),
                                seconds[module] if called else sum(c.seconds for c in children))
        profiles.setdefault(name, profile)
        return profile

    visit(model, type(model).__name__)
    return profiles


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def summary_text(measured: _Measured, settings: FlopsProfilerConfig, sizes: EngineSizes, profile_step: int,
                 model: nn.Module) -> str:
    """DeepSpeed's profile summary, as one string."""
    out = io.StringIO()
    root = measured.modules[type(model).__name__]
    line = lambda label, value: out.write(f"{label:<{_WIDTH}}  {value!s:<8}\n")  # noqa: E731
    out.write("\n-------------------------- DeepSpeed Flops Profiler --------------------------\n")
    out.write(f"Profile Summary at step {profile_step}:\n")
    out.write("Notations:\ndata parallel size (dp_size), model parallel size(mp_size),\n"
              "number of parameters (params), number of multiply-accumulate operations(MACs),\n"
              "number of floating-point operations (flops), floating-point operations per second (FLOPS),\n"
              "fwd latency (forward propagation latency), bwd latency (backward propagation latency),\n"
              "step (weights update latency), iter latency (sum of fwd, bwd and step latency)\n\n")
    line("world size: ", sizes.world_size)
    line("data parallel size: ", sizes.data_parallel_size)
    line("model parallel size: ", 1)
    line("batch size per GPU: ", sizes.micro_batch)
    line("params per GPU: ", params_to_string(root.params))
    line("params of model = params per GPU * mp_size: ", params_to_string(root.params))
    line("fwd MACs per GPU: ", number_to_string(root.macs) + "MACs")
    line("fwd flops per GPU: ", number_to_string(root.flops))
    line("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(root.flops))
    fwd = measured.forward_s
    line("fwd latency: ", number_to_string(fwd) + "s")
    line("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ", _rate(root.flops, fwd))
    if measured.backward_s is not None and measured.step_s is not None:
        factor = 2 + settings.recompute_fwd_factor
        bwd, step = measured.backward_s, measured.step_s
        line("bwd latency: ", number_to_string(bwd) + "s")
        line(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ", _rate(factor * root.flops, bwd))
        line(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
             _rate((factor + 1) * root.flops, fwd + bwd))
        line("step latency: ", number_to_string(step) + "s")
        iteration = fwd + bwd + step
        line("iter latency: ", number_to_string(iteration) + "s")
        line(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
             _rate((factor + 1) * root.flops, iteration))
        line("samples/second: ", round(sizes.micro_batch * sizes.world_size / iteration, 2))
    out.write("\n----------------------------- Aggregated Profile per GPU -----------------------------\n")
    out.write(_aggregated(model, measured, settings))
    if settings.detailed:
        out.write("\n------------------------------ Detailed Profile per GPU ------------------------------\n")
        out.write("Each module profile is listed after its name in the following order: \nparams, percentage of "
                  "total params, MACs, percentage of total MACs, fwd latency, percentage of total fwd latency, "
                  "fwd FLOPS\n\nNote: the flops are those of the operations torch's flop counter counts (matrix "
                  "products, convolutions, attention); element-wise work is not counted.\n\n")
        out.write(_tree(model, measured, root) + "\n")
    out.write("------------------------------------------------------------------------------\n")
    return out.getvalue()


def _rate(flops: float, seconds: float) -> str:
    return number_to_string(flops / seconds if seconds else 0.0) + "FLOPS"


def _aggregated(model: nn.Module, measured: _Measured, settings: FlopsProfilerConfig) -> str:
    """Per depth, the module classes with the most parameters, MACs and forward latency."""
    by_depth: dict[int, dict[str, ModuleProfile]] = defaultdict(lambda: defaultdict(ModuleProfile))
    for name, _module in _named_modules(model):
        depth = name.count(".")
        sums = by_depth[depth][type(_module).__name__]
        mine = measured.modules[name]
        sums.params += mine.params
        sums.flops += mine.flops
        sums.seconds += mine.seconds
    deepest = len(by_depth) - 1
    depth_limit = deepest if settings.module_depth == -1 else min(settings.module_depth, deepest)
    lines = [f"Top {settings.top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
    for depth in range(depth_limit):
        classes = by_depth[depth]

        def top(key: Callable[[ModuleProfile], float], show: Callable[[ModuleProfile], str]) -> dict[str, str]:
            ranked = sorted(classes.items(), key=lambda item: key(item[1]), reverse=True)[:settings.top_modules]
            return {name: show(p) for name, p in ranked}
        lines += [f"depth {depth}:",
                  f"    params      - {top(lambda p: p.params, lambda p: params_to_string(p.params))}",
                  f"    MACs        - {top(lambda p: p.macs, lambda p: number_to_string(p.macs) + 'MACs')}",
                  f"    fwd latency - {top(lambda p: p.seconds, lambda p: number_to_string(p.seconds) + 's')}"]
    return "\n".join(lines) + "\n"


def _tree(model: nn.Module, measured: _Measured, root: ModuleProfile) -> str:
    """The module tree, each module with its profile, indented as torch prints a model."""
    def share(part: float, whole: float) -> str:
        return f"{round(100 * part / whole, 2) if whole else 0:g}%"

    def describe(module: nn.Module, name: str) -> str:
        p = measured.modules[name]
        items = [f"{params_to_string(p.params)} = {share(p.params, root.params)} Params",
                 f"{number_to_string(p.macs)}MACs = {share(p.macs, root.macs)} MACs",
                 f"{number_to_string(p.seconds)}s = {share(p.seconds, measured.forward_s)} latency",
                 _rate(p.flops, p.seconds)]
        extra = module.extra_repr()
        return ", ".join(items + ([extra] if extra else []))

    def walk(module: nn.Module, name: str, label: str, indent: str) -> list[str]:
        children = list(module.named_children())
        head = f"{indent}{label}{type(module).__name__}({describe(module, name)}"
        if not children:
            return [head + ")"]
        lines = [head]
        for child_name, child in children:
            lines += walk(child, f"{name}.{child_name}", f"({child_name}): ", indent + "  ")
        return lines + [indent + ")"]

    return "\n".join(walk(model, type(model).__name__, "", ""))
