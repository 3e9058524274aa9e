"""Adopting a model whose parameters DeepSpeed's own `zero.Init` partitioned.

Transformers builds a model under DeepSpeed's `deepspeed.zero.Init` whenever DeepSpeed is
installed and an `HfDeepSpeedConfig` (or a Trainer with a ZeRO-3 config) is alive, and a
script may enter `deepspeed.zero.Init` itself. Such a parameter has shape (0,) and carries
DeepSpeed's attributes as instance attributes (`ds_shape`, `ds_numel`, `ds_tensor`, its
partition, `ds_status`, `ds_id`, `ds_process_group`, bound methods `all_gather`,
`partition`, a wrapped `item`, ...). zero3's own parameters carry none: zero3's `ds_*`
names are read-only properties of a class (params/status.py), so an entry in the
parameter's `__dict__` is DeepSpeed's mark.

`adopt_deepspeed_partitions(model, comm)`, called first by build.prepare_module at
initialize, turns every such parameter into one partitioned by `zero3.Init`:

1. Every rank states what would stop the adoption (DeepSpeed not importable, a partition
   over another number of ranks than the engine's, a DeepSpeed engine already managing
   the model); one gather of those answers, and if any rank has one, the same
   `DeepSpeedAdoptionError` is raised on every rank, before anything is changed.
2. Unit by unit (the parameters of consecutive modules, up to `CHUNK_NUMEL` elements, at
   least one module's), DeepSpeed's own `GatheredParameters` gathers the full values;
   this rank's zero3 shard (shard_layout.py) is copied out of them, and DeepSpeed
   partitions them again on exit.
3. DeepSpeed's attributes are removed from each parameter, which keeps its identity
   (a client optimizer built on it stays valid) and takes its full shape back with a
   released storage, its shard recorded as zero3.Init's (init_shards.py), so the
   engine's `prepare_module` claims it as it claims zero3.Init's. DeepSpeed's
   external-parameter registry on modules goes, and `torch.nn.functional.linear`, which
   DeepSpeed's `zero.Init` replaces process-wide with its memory-efficient wrapper and
   never puts back, is torch's own again.

Collective: every rank calls it with the same model (the rank agreement check that runs
before it compares which parameters DeepSpeed partitioned, `deepspeed_mark`).
Memory: at most one chunk's full values (DeepSpeed's gather buffers) plus this rank's new
shards are held at a time; DeepSpeed's partitions are dropped with its attributes. The
shards are owned by init_shards.py's registry until the engine claims them.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from zero3.engine_parts.errors import EngineError
from zero3.params.init_shards import InitShard, record_init_shard
from zero3.params.released import release_storage
from zero3.params.shard_layout import owned_range, shard_numel_for
from zero3.params.status import mark_zero_parameter
from zero3.platform.collectives import Communicator

logger = logging.getLogger("zero3")

CHUNK_NUMEL = 1 << 26  # full elements gathered at once (one module's at least)
# Instance attributes DeepSpeed's zero.Init puts on a parameter besides its `ds_*` ones.
_DEEPSPEED_PARAM_ATTRIBUTES = frozenset({
    "all_gather", "all_gather_coalesced", "partition", "reduce_gradients_at_owner", "partition_gradients",
    "aligned_size", "padding_size", "partition_numel", "item", "convert_to_zero_parameters",
    "is_external_param", "nvme_swapper",
})
_DEEPSPEED_MODULE_ATTRIBUTES = ("_external_params", "ds_external_parameters", "all_parameters")
_FIX = ("build the model under zero3's own Init instead (`with zero3.zero.Init(config_dict_or_path=ds_config):`, "
        "or zero3.hf for the Trainer), or build it without HfDeepSpeedConfig / deepspeed.zero.Init and let "
        "zero3.initialize shard it")


class DeepSpeedAdoptionError(EngineError):
    """A model partitioned by DeepSpeed's zero.Init cannot be taken over (the message says why)."""


def deepspeed_mark(param: torch.Tensor) -> bool:
    """Whether DeepSpeed's zero.Init partitioned `param` (its attributes are in the
    parameter's own `__dict__`; zero3's are class properties)."""
    own = vars(param)
    return "ds_shape" in own or "ds_tensor" in own


def find_deepspeed_partitioned(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every parameter DeepSpeed's zero.Init partitioned, tied ones once."""
    return [(name, p) for name, p in model.named_parameters() if deepspeed_mark(p)]


def adopt_deepspeed_partitions(model: nn.Module, comm: Communicator) -> int:
    """Turn `model`'s DeepSpeed-partitioned parameters into zero3.Init-partitioned ones
    (module doc); returns how many were adopted. Collective when there are any."""
    found = find_deepspeed_partitioned(model)
    if not found:
        return 0
    problem, partition_parameters = _problem_on_this_rank(model, found, comm)
    _raise_on_every_rank(comm, problem)
    chunks = list(_chunks(model, {id(p) for _, p in found}))
    for chunk in chunks:
        _adopt_chunk(partition_parameters, chunk, comm)
    _strip_modules(model)
    linear_restored = _restore_torch_linear(partition_parameters)
    if comm.rank == 0:
        logger.info(
            "zero3: adopted %d parameters (%d elements) that DeepSpeed's zero.Init had partitioned: gathered "
            "through DeepSpeed's GatheredParameters (%d calls) and sharded zero3's way; DeepSpeed's attributes "
            "removed%s. To skip this step, build the model under zero3.zero.Init", len(found),
            sum(_full_numel(p) for _, p in found), len(chunks),
            " and torch.nn.functional.linear restored" if linear_restored else "")
    return len(found)


def _full_numel(param: torch.Tensor) -> int:
    return int(vars(param).get("ds_numel", param.numel()))


# ------------------------------------------------------------------ checks
def _problem_on_this_rank(model: nn.Module, found: list[tuple[str, nn.Parameter]],
                          comm: Communicator) -> tuple[str | None, ModuleType | None]:
    """What stops the adoption on this rank (None if nothing), and DeepSpeed's
    partition_parameters module when it imports."""
    name, first = found[0]
    what = (f"{len(found)} parameters of the model (the first, {name!r}, has shape {tuple(first.shape)} and "
            f"ds_shape {tuple(vars(first).get('ds_shape', ()))}) were partitioned by DeepSpeed's zero.Init "
            "(the model was built while a transformers HfDeepSpeedConfig was alive with DeepSpeed installed, "
            "or inside deepspeed.zero.Init)")
    managed = next((n for n, m in model.named_modules() if "ds_id" in vars(m)), None)
    if managed is not None:
        return (f"{what}, and a DeepSpeed engine already manages it (module {managed or '<root>'!r} carries its "
                "hooks); one model cannot be given to both engines: " + _FIX), None
    sizes = sorted({int(vars(p).get("ds_zero_partition_world_size", comm.world_size)) for _, p in found})
    if sizes != [comm.world_size]:
        return (f"{what} over a process group of {' and '.join(map(str, sizes))} ranks, but this engine shards "
                f"over {comm.world_size} ranks; build the model in the process group the engine uses (no "
                "data_parallel_group, zero_hpz_partition_size or sequence parallelism in deepspeed.zero.Init), or "
                + _FIX), None
    try:
        return None, importlib.import_module("deepspeed.runtime.zero.partition_parameters")
    except Exception as exc:  # noqa: BLE001 - any failure to import DeepSpeed is reported the same way
        return (f"{what}, but DeepSpeed cannot be imported in this process ({type(exc).__name__}: {exc}), so "
                "their values, held in DeepSpeed's partitions, cannot be gathered; make DeepSpeed importable "
                "on every rank, or " + _FIX), None


def _raise_on_every_rank(comm: Communicator, problem: str | None) -> None:
    """One gather of every rank's problem: DeepSpeedAdoptionError on every rank if any has one."""
    by_rank = comm.gather_objects(problem) if comm.active else [problem]
    failed = [(rank, text) for rank, text in enumerate(by_rank) if text is not None]
    if not failed:
        return
    texts = sorted({text for _, text in failed})
    where = "every rank" if len(failed) == len(by_rank) else "ranks " + ", ".join(str(r) for r, _ in failed)
    raise DeepSpeedAdoptionError(f"zero3.initialize cannot take over the model (on {where}): "
                                 + " | ".join(texts))


# ---------------------------------------------------------------- adoption
def _chunks(model: nn.Module, wanted: set[int]) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """The wanted parameters module by module (each once, in the model's order, the same on
    every rank), consecutive modules together up to CHUNK_NUMEL full elements."""
    chunk: list[tuple[str, nn.Parameter]] = []
    numel = 0
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        own = [(f"{module_name}.{n}" if module_name else n, p) for n, p in module.named_parameters(recurse=False)
               if id(p) in wanted and id(p) not in seen]
        if not own:
            continue
        size = sum(_full_numel(p) for _, p in own)
        if chunk and numel + size > CHUNK_NUMEL:
            yield chunk
            chunk, numel = [], 0
        seen.update(id(p) for _, p in own)
        chunk += own
        numel += size
    if chunk:
        yield chunk


def _adopt_chunk(partition_parameters: ModuleType, chunk: list[tuple[str, nn.Parameter]],
                 comm: Communicator) -> None:
    """Gather one chunk through DeepSpeed, keep this rank's zero3 shard of each parameter,
    then make each a zero3.Init-partitioned parameter. Collective."""
    params = [p for _, p in chunk]
    shards: list[tuple[torch.Tensor, int, torch.dtype, torch.device]] = []
    with torch.no_grad(), partition_parameters.GatheredParameters(params, modifier_rank=None):
        for name, p in chunk:
            full = p.data
            if tuple(full.shape) != tuple(vars(p)["ds_shape"]):
                raise DeepSpeedAdoptionError(
                    f"zero3.initialize: DeepSpeed's gather of {name!r} gave shape {tuple(full.shape)}, not its "
                    f"ds_shape {tuple(vars(p)['ds_shape'])}; " + _FIX)
            shards.append((_zero3_shard(full, comm), full.numel(), full.dtype, full.device))
    for (name, p), (shard, numel, dtype, device) in zip(chunk, shards):
        shape = torch.Size(vars(p)["ds_shape"])
        _strip_parameter(p)
        p.data = torch.empty(shape, dtype=dtype, device=device)
        release_storage(p)
        record_init_shard(p, InitShard(shard, numel, comm.world_size, comm.rank))
        mark_zero_parameter(p)


def _zero3_shard(full: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """A new tensor holding this rank's row of `full` in zero3's layout (padding zeroed),
    on `full`'s device and in its dtype."""
    shard = torch.zeros(shard_numel_for(full.numel(), comm.world_size), dtype=full.dtype, device=full.device)
    start, end = owned_range(full.numel(), shard.numel(), comm.rank)
    shard[:end - start].copy_(full.reshape(-1)[start:end])
    return shard


def _strip_parameter(param: nn.Parameter) -> None:
    """Remove what DeepSpeed's zero.Init put on the parameter (its partition goes with it)."""
    for key in [k for k in vars(param) if k.startswith(("ds_", "_ds_")) or k in _DEEPSPEED_PARAM_ATTRIBUTES]:
        delattr(param, key)


def _strip_modules(model: nn.Module) -> None:
    """Remove DeepSpeed's external-parameter registry (zero3 discovers such uses itself)."""
    for module in model.modules():
        for key in _DEEPSPEED_MODULE_ATTRIBUTES:
            if key in vars(module):
                delattr(module, key)


def _restore_torch_linear(partition_parameters: ModuleType) -> bool:
    """Give `torch.nn.functional.linear` back its own function where DeepSpeed's zero.Init
    left its wrapper in place; True when it did."""
    patcher = getattr(partition_parameters, "InsertPostInitMethodToModuleSubClasses", None)
    original = getattr(patcher, "linear_bk", None)
    if original is None or torch.nn.functional.linear is original:
        return False
    torch.nn.functional.linear = original
    return True
