"""The package's shape, and the private torch behaviour it is built on.

- Every field of the typed config is read by some code outside config.py (or by a
  property of config.py that code reads): a field nothing reads is a promise with no
  effect.
- No import cycle among zero3's modules (imports inside functions and under TYPE_CHECKING
  counted), classes and functions within the sizes the code style sets.
- The sub-packages depend one way (LAYERS): a module imports only its own layer and the
  layers below it, and the checkpoint format reads no engine code.
- Every documented public import path resolves.
- The private torch internals zero3 relies on still exist and behave as zero3 assumes:
  a torch upgrade that changes one fails here, by name, not somewhere deep in a step.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

PACKAGE = Path(__file__).resolve().parent.parent / "zero3"
MAX_CLASS_LINES = 460
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    trees = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        trees[name.removesuffix(".__init__")] = ast.parse(path.read_text(), filename=str(path))
    return trees


def _attribute_reads(tree: ast.AST) -> set[str]:
    """Attribute names read anywhere in `tree` (x.name), and string constants (getattr)."""
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
    names |= {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    return names


def _config_fields(tree: ast.Module) -> list[tuple[str, str]]:
    """(class, field) of every public dataclass in config.py."""
    fields = []
    for node in tree.body:
        if (isinstance(node, ast.ClassDef) and not node.name.startswith("_")
                and any("dataclass" in ast.unparse(d) for d in node.decorator_list)):
            fields += [(node.name, item.target.id) for item in node.body
                       if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)]
    return fields


def test_every_config_field_is_read_outside_the_config_module():
    trees = _modules()
    config = trees.pop("zero3.config")
    read_elsewhere = set().union(*(_attribute_reads(tree) for tree in trees.values()))
    read_by_config_properties = {
        node.attr for fn in ast.walk(config) if isinstance(fn, ast.FunctionDef)
        and any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)
        for node in ast.walk(fn) if isinstance(node, ast.Attribute)}
    fields = _config_fields(config)
    assert len(fields) > 40, f"found only {len(fields)} config fields: the parse of config.py is off"
    dead = [f"{cls}.{name}" for cls, name in fields
            if name not in read_elsewhere and name not in read_by_config_properties]
    assert not dead, (f"config fields that no code reads: {dead}; give each an effect, or refuse the "
                      "key in the config rule table with its reason")


def _imports(module: str, tree: ast.Module, known: set[str]) -> set[str]:
    is_package = (PACKAGE.parent / Path(*module.split("."))).is_dir()
    parts = module.split(".")
    found = set()
    for node in ast.walk(tree):  # every import: module level, in functions, under TYPE_CHECKING
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in known]
            # `from . import a, b` imports submodules only; `from .m import name` imports m
            candidates = submodules if len(submodules) == len(node.names) else [target] + submodules
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in known and c != module}
    return found


def test_no_import_cycle_among_the_package_modules():
    trees = _modules()
    graph = {name: _imports(name, tree, set(trees)) for name, tree in trees.items()}
    cycles = []
    for start in graph:  # a path back to `start` through its imports is a cycle
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycles.append(" -> ".join(path + [start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
    assert not cycles, f"import cycles: {sorted(set(cycles))[:5]}"


# Low to high. A module may import modules of its own layer and of the layers below;
# an import of a higher layer, anywhere in the file, is a forbidden edge.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("zero3.version", "zero3.config", "zero3.platform", "zero3.placement", "zero3.nvme")),
    ("params", ("zero3.params",)),
    ("grads", ("zero3.grads",)),
    ("optim", ("zero3.optim",)),
    ("engine parts", ("zero3.engine_parts", "zero3.estimate", "zero3.monitor")),
    ("checkpoint", ("zero3.checkpoint",)),
    ("DeepSpeed adapters", ("zero3.compat", "zero3.checkpointing", "zero3.accelerator", "zero3.comm", "zero3.utils", "zero3.runtime",
                            "zero3.ops", "zero3.zero", "zero3.moe", "zero3.compression", "zero3.sequence")),
    ("engine", ("zero3.engine",)),
    ("entry points", ("zero3.api", "zero3")),
    ("hf", ("zero3.hf",)),
    ("command line", ("zero3.cli",)),  # above the hf adapters: `zero3 launch` is one of its commands
]
# The checkpoint format is read and written without an engine (the command line, the
# DeepSpeed import): these modules may import only each other and the shard layout rule.
FORMAT_MODULES = ("zero3.checkpoint.errors", "zero3.checkpoint.paths", "zero3.checkpoint.manifest",
                  "zero3.checkpoint.files", "zero3.checkpoint.folder_swap", "zero3.checkpoint.format",
                  "zero3.checkpoint.offline_export", "zero3.checkpoint.tag_contents",
                  "zero3.checkpoint.deepspeed")
FORMAT_MAY_IMPORT = FORMAT_MODULES + ("zero3.params.shard_layout", "zero3.version", "zero3.checkpoint")


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix naming `module`."""
    best, depth = -1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if _within(module, (prefix,)) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    assert best >= 0, f"{module} is in no layer of LAYERS: place it there"
    return best


def _forbidden_edges(graph: dict[str, set[str]]) -> list[str]:
    edges = []
    for module, targets in graph.items():
        for target in targets:
            if target == "zero3" and module != "zero3":
                edges.append(f"{module} -> zero3 (the package's entry; import the module that defines the name)")
            elif _layer_of(target) > _layer_of(module):
                edges.append(f"{module} ({LAYERS[_layer_of(module)][0]}) -> {target} ({LAYERS[_layer_of(target)][0]})")
            elif (_within(module, FORMAT_MODULES) and target != "zero3.checkpoint"
                  and not _within(target, FORMAT_MAY_IMPORT)):
                edges.append(f"{module} (checkpoint format) -> {target}")
    return sorted(edges)


def test_sub_packages_depend_one_way():
    trees = _modules()
    graph = {name: _imports(name, tree, set(trees)) for name, tree in trees.items()}
    assert len(graph) > 60 and "zero3.params.fetch" in graph, "the parse of the package is off"
    edges = _forbidden_edges(graph)
    assert not edges, "imports against the layering (tests/test_architecture.py LAYERS): " + "; ".join(edges)


def test_the_layering_check_catches_a_forbidden_edge():
    """The rule itself: edges the layering forbids are reported, allowed ones are not."""
    graph = {"zero3.params.fetch": {"zero3.optim.masters", "zero3.platform.collectives"},
             "zero3.checkpoint.format": {"zero3.engine_parts.views", "zero3.params.shard_layout"},
             "zero3.optim.masters": {"zero3.compat.param_status"},
             "zero3.engine": {"zero3.params.fetch"}}
    assert _forbidden_edges(graph) == [
        "zero3.checkpoint.format (checkpoint format) -> zero3.engine_parts.views",
        "zero3.optim.masters (optim) -> zero3.compat.param_status (DeepSpeed adapters)",
        "zero3.params.fetch (params) -> zero3.optim.masters (optim)",
    ]


# What users import, as the README, the examples and DeepSpeed scripts spell it.
PUBLIC_PATHS = [
    "zero3.initialize", "zero3.init_distributed", "zero3.add_config_arguments", "zero3.Init",
    "zero3.GatheredParameters", "zero3.register_external_parameter", "zero3.gathered_for_generation",
    "zero3.estimate_memory", "zero3.set_z3_leaf_modules", "zero3.set_z3_leaf_modules_by_name",
    "zero3.set_z3_leaf_modules_by_suffix", "zero3.unset_z3_leaf_modules", "zero3.Engine", "zero3.DeepSpeedEngine",
    "zero3.CheckpointError", "zero3.ConfigError", "zero3.EngineError", "zero3.DivergenceError", "zero3.__version__",
    "zero3.zero.Init", "zero3.zero.GatheredParameters", "zero3.zero.register_external_parameter",
    "zero3.zero.unregister_external_parameter",
    "zero3.runtime.zero.GatheredParameters", "zero3.runtime.zero.Init", "zero3.runtime.zero.ZeroParamStatus",
    "zero3.runtime.zero.unwrap_model_for_generation",
    "zero3.runtime.zero.partition_parameters.GatheredParameters",
    "zero3.runtime.zero.partition_parameters.ZeroParamStatus",
    "zero3.runtime.zero.partition_parameters.ZeroParameter",
    "zero3.utils.safe_get_full_fp32_param", "zero3.utils.safe_get_full_grad",
    "zero3.utils.safe_get_full_optimizer_state", "zero3.utils.safe_set_full_fp32_param",
    "zero3.utils.safe_get_local_fp32_param", "zero3.utils.set_z3_leaf_modules", "zero3.utils.z3_leaf_module",
    "zero3.utils.logger", "zero3.utils.log_dist",
    "zero3.utils.zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint",
    "zero3.utils.zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict",
    "zero3.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint",
    "zero3.comm.init_distributed", "zero3.comm.get_rank", "zero3.comm.get_world_size", "zero3.comm.get_local_rank",
    "zero3.comm.all_reduce", "zero3.comm.all_gather_into_tensor", "zero3.comm.barrier", "zero3.comm.ReduceOp",
    "zero3.accelerator.get_accelerator", "zero3.ops.adam.FusedAdam", "zero3.ops.adam.DeepSpeedCPUAdam",
    "zero3.config.from_deepspeed", "zero3.checkpoint.CheckpointError",
    "zero3.checkpoint.export.consolidated_state_dict", "zero3.checkpoint.export.save_fp32_model",
    "zero3.checkpoint.export.full_fp32_param", "zero3.cli.main",
    "zero3.DeepSpeedConfigError", "zero3.runtime.config.DeepSpeedConfigError", "zero3.runtime.config.ADAM_OPTIMIZER",
    "zero3.runtime.lr_schedules.WarmupLR", "zero3.runtime.lr_schedules.WARMUP_LR",
    "zero3.runtime.zero.offload_config.OffloadDeviceEnum", "zero3.utils.torch.required_torch_version",
    "zero3.utils.safe_update_full_grad_vectorized",
    "zero3.runtime.zero.utils.ZeRORuntimeException", "zero3.checkpoint.utils.clone_tensors_for_torch_save",
    "zero3.get_accelerator", "zero3.moe.utils.split_params_into_different_moe_groups_for_optimizer",
    "zero3.moe.utils.is_moe_param", "zero3.compression.helper.recursive_getattr",
    "zero3.compression.helper.recursive_setattr", "zero3.runtime.utils.see_memory_usage",
    "zero3.runtime.zero.parameter_offload.ZeROOrderedDict", "zero3.runtime.zero.parameter_offload.ensure_zero_ordered_dict",
    "zero3.runtime.swap_tensor.MIN_SWAPPABLE_BYTES", "zero3.runtime.swap_tensor.utils.MIN_SWAPPABLE_BYTES",
    "zero3.runtime.swap_tensor.constants.AIO_BLOCK_SIZE",
    "zero3.checkpointing.configure", "zero3.checkpointing.checkpoint", "zero3.checkpointing.is_configured",
    "zero3.checkpointing.get_cuda_rng_tracker", "zero3.checkpointing.model_parallel_cuda_manual_seed",
    "zero3.checkpointing.reset", "zero3.runtime.activation_checkpointing.checkpointing.configure",
    "zero3.runtime.activation_checkpointing.checkpointing.checkpoint",
    "zero3.runtime.activation_checkpointing.checkpointing.is_configured",
    "zero3.runtime.activation_checkpointing.checkpointing.get_cuda_rng_tracker",
    "zero3.runtime.activation_checkpointing.checkpointing.model_parallel_cuda_manual_seed",
]
HF_PATHS = ["zero3.hf.Trainer", "zero3.hf.trainer_class", "zero3.hf.ConfigFillError",
            "zero3.hf.UnsupportedOptionError"]


def _resolve(path: str) -> object:
    """`path` as `import a.b; a.b.name`: the longest importable module prefix, then attributes."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            value = getattr(value, attribute)
        return value
    raise ModuleNotFoundError(path)


@pytest.mark.parametrize("path", PUBLIC_PATHS + HF_PATHS)
def test_documented_import_path_resolves(path):
    if path.startswith("zero3.hf"):
        pytest.importorskip("transformers", reason="zero3.hf needs the hf extra")
    assert _resolve(path) is not None


def test_the_zero3_command_entry_point_resolves():
    import tomllib

    scripts = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, function = scripts["zero3"].partition(":")
    assert callable(_resolve(f"{module}.{function}"))


def test_classes_and_functions_stay_small():
    too_big = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            lines = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and lines > MAX_CLASS_LINES:
                too_big.append(f"class {name}.{node.name}: {lines} lines (at most {MAX_CLASS_LINES})")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and lines > MAX_FUNCTION_LINES:
                too_big.append(f"function {name}.{node.name}: {lines} lines (at most {MAX_FUNCTION_LINES})")
    assert not too_big, "split these on their seams: " + "; ".join(too_big)


# ------------------------------------------------------- private torch internals
def test_graph_task_id_tells_backward_from_forward():
    """fetch.in_backward / current_task: torch._C._current_graph_task_id."""
    assert torch._C._current_graph_task_id() == -1
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    y.grad_fn.register_prehook(lambda grads: seen.append(torch._C._current_graph_task_id()))
    y.backward()
    assert len(seen) == 1 and seen[0] != -1


def test_queue_callback_runs_at_the_end_of_the_backward_pass():
    """fetch.pre_backward: Variable._execution_engine.queue_callback ends a backward."""
    order = []
    x = torch.ones(2, requires_grad=True)
    h = x * 2
    h.register_hook(lambda g: (order.append("hook"), torch.autograd.Variable._execution_engine.queue_callback(
        lambda: order.append("end")))[0])
    (h * 3).sum().backward()
    order.append("after")
    assert order == ["hook", "end", "after"]


def test_storage_identity_and_resize_release():
    """discovery.owner_of (untyped_storage()._cdata equal for views) and ShardedParam's
    release (untyped_storage().resize_(0) frees; resizing back makes it usable again)."""
    p = nn.Parameter(torch.arange(12.0))
    view = p.data.view(3, 4)[1:]
    assert view.untyped_storage()._cdata == p.untyped_storage()._cdata
    assert torch.ones(3).untyped_storage()._cdata != p.untyped_storage()._cdata
    p.untyped_storage().resize_(0)
    assert p.untyped_storage().nbytes() == 0
    p.untyped_storage().resize_(12 * 4)
    with torch.no_grad():
        p.copy_(torch.arange(12.0) + 1)
    assert p.sum().item() == sum(range(1, 13))


def test_storage_use_count_and_moving_a_parameter_off_a_shared_storage():
    """released.py's release that keeps aliases: torch._C._storage_Use_Count counts the
    tensors (and Python handles) on a storage, NumPy views included; `p.data = t` moves the
    parameter to t's storage and a tensor that shared the old one keeps it and its values."""
    p = nn.Parameter(torch.arange(12.0).view(3, 4))
    storage = p.untyped_storage()
    assert torch._C._storage_Use_Count(storage._cdata) == 2  # the parameter and `storage`
    alias, array = p.detach(), p.detach().numpy()
    assert torch._C._storage_Use_Count(storage._cdata) == 4
    p.data = torch.empty_strided(p.shape, p.stride())
    p.untyped_storage().resize_(0)
    assert p.untyped_storage().nbytes() == 0 and p.shape == (3, 4)
    assert alias.sum().item() == array.sum() == sum(range(12))
    p.untyped_storage().resize_(12 * 4)
    with torch.no_grad():
        p.copy_(alias + 1)
    assert p.sum().item() == sum(range(1, 13)) and p.stride() == (4, 1)


def test_module_attribute_reads_go_through_parameters_getitem():
    """discovery.TrackedParameters: `module.weight` reads `_parameters[name]` via __getitem__."""
    reads = []

    class Counting(dict):
        def __getitem__(self, name):
            reads.append(name)
            return super().__getitem__(name)

    layer = nn.Linear(2, 2)
    layer._parameters = Counting(layer._parameters)
    layer(torch.ones(1, 2))
    _ = layer.weight
    assert reads.count("weight") == 2 and "bias" in reads


def test_registration_hooks_and_saved_tensor_hooks():
    """init.py: module-level parameter/module registration hooks; discovery.py: saved-tensor hooks."""
    registered = []
    handles = [nn.modules.module.register_module_parameter_registration_hook(
        lambda module, name, param: registered.append(name))]
    handles.append(nn.modules.module.register_module_module_registration_hook(
        lambda module, name, sub: registered.append(name)))
    try:
        nn.Sequential(nn.Linear(1, 1))
    finally:
        for handle in handles:
            handle.remove()
    assert {"weight", "bias", "0"} <= set(registered)
    packed = []
    x = torch.ones(3, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
        y = (x * x).sum()
    y.backward()
    assert packed and torch.equal(x.grad, 2 * torch.ones(3))


def test_pytree_and_foreach_and_incompatible_keys():
    """fetch.py (tree_flatten / unflatten of hook arguments), optim/masters.py and grads/sink.py
    (torch._foreach_*), compat/engine_surface.py (nn.modules.module._IncompatibleKeys)."""
    from torch.utils._pytree import tree_flatten

    flat, spec = tree_flatten(((torch.ones(1), 2), {"k": torch.zeros(2)}))
    assert len(flat) == 3 and spec.unflatten(flat)[1]["k"].shape == (2,)
    a, b = [torch.ones(3), torch.full((2,), 2.0)], [torch.zeros(3), torch.zeros(2)]
    assert [n.item() for n in torch._foreach_norm(a, 2.0)] == pytest.approx([3 ** 0.5, 8 ** 0.5])
    torch._foreach_mul_(a, torch.tensor(2.0))
    torch._foreach_div_(a, 2.0)
    torch._foreach_copy_(b, a)
    torch._foreach_add_(b, a)
    assert torch.equal(b[0], 2 * torch.ones(3)) and torch.equal(b[1], torch.full((2,), 4.0))
    keys = nn.modules.module._IncompatibleKeys(["m"], ["u"])
    assert keys.missing_keys == ["m"] and keys.unexpected_keys == ["u"]


def test_class_change_and_torch_function_sealing():
    """released.py: a Parameter's `__class__` can be changed to a subclass and back (as
    torch's UninitializedParameter does); a subclass's `__torch_function__` sees method
    calls, attribute reads (as getset descriptors) and `.data` assignment; subclass
    dispatch can be switched off inside; `torch._C._nn._parse_to` reads `.to()` arguments."""
    seen = []

    class Watching(nn.Parameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            owner = getattr(func, "__self__", None)
            if type(owner).__name__ == "getset_descriptor":
                seen.append(owner.__name__)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))

    p = nn.Parameter(torch.ones(2, 3))
    p.__class__ = Watching
    assert isinstance(p, nn.Parameter) and p.sum().item() == 6.0
    assert p.shape == (2, 3)
    p.data = p
    assert {"sum", "__get__", "shape", "__set__", "data"} <= set(seen)
    p.__class__ = nn.Parameter
    seen.clear()
    p.sum()
    assert seen == []
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to("cpu", torch.float16)
    assert (str(device), dtype, non_blocking, memory_format) == ("cpu", torch.float16, False, None)


def test_top_saved_tensor_hooks_and_reentrant_checkpoint_saves_through_them():
    """checkpointing/offload.py: `torch._C._autograd._top_saved_tensors_default_hooks(False)`
    gives the (pack, unpack) pair active now (None outside any), and a reentrant
    `torch.utils.checkpoint` saves its tensor inputs through the active pack hook."""
    from torch.autograd.graph import saved_tensors_hooks
    from torch.utils.checkpoint import checkpoint

    def pack(t):
        return t

    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    packed = []
    x = torch.ones(3, requires_grad=True)
    with saved_tensors_hooks(pack, pack):
        assert torch._C._autograd._top_saved_tensors_default_hooks(False)[0] is pack
        with saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = checkpoint(lambda a: (a * a).sum(), x, use_reentrant=True)
    y.backward()
    assert len(packed) == 1 and packed[0] is x and torch.equal(x.grad, 2 * torch.ones(3))
