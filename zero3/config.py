"""DeepSpeed's JSON config, parsed and validated into typed, frozen dataclasses.

``from_deepspeed(config, world_size)`` takes a DeepSpeed config (a dict, a path to a JSON
file, or a base64-encoded JSON string, as DeepSpeed accepts) and returns a ``Zero3Config``.

Every key DeepSpeed 0.19.8 reads is known here. Each key has one rule in a table:

* ``_Map``: the key is mapped to a field (through a converter that checks its type and range);
* ``_Only``: the key is accepted only with the listed values (DeepSpeed's default, or a value
  whose meaning zero3 always satisfies); any other value is refused, saying why and what to do;
* ``_Refuse``: zero3 does not support the key at all.

A key that is in no table is an error that suggests the nearest known key. Nothing is
silently ignored. ``docs/config.md`` lists every key with its rule.

``"auto"`` values: where DeepSpeed validates a section with its pydantic models (non-strict),
a literal ``"auto"`` is dropped and the DeepSpeed default applies; zero3 does the same in
those sections (``zero_optimization``, ``offload_*``, ``leaf_module``, ``bf16``, ``fp16``,
``timers.throughput``, the monitor blocks). Everywhere else DeepSpeed would use the string
itself and fail, so zero3 refuses it and asks for a concrete value.
"""

from __future__ import annotations

import base64
import binascii
import copy
import difflib
import json
import logging
import math
import os
import sys
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NoReturn, Union

import torch
import torch.distributed as dist

logger = logging.getLogger("zero3")

__all__ = [
    "ConfigError",
    "OffloadConfig",
    "AioConfig",
    "LeafModuleConfig",
    "ZeroConfig",
    "ActivationCheckpointingConfig",
    "activation_checkpointing_of",
    "checked_activation_checkpointing",
    "PrecisionConfig",
    "ComponentSpec",
    "Zero3Config",
    "from_deepspeed",
    "describe_keys",
    "DEEPSPEED_TOP_LEVEL_KEYS",
    "DEEPSPEED_ZERO_KEYS",
    "DEEPSPEED_OFFLOAD_PARAM_KEYS",
    "DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS",
    "DEEPSPEED_BF16_KEYS",
    "DEEPSPEED_FP16_KEYS",
    "SUPPORTED_OPTIMIZERS",
    "SUPPORTED_SCHEDULERS",
]


class DeepSpeedConfigError(Exception):
    """DeepSpeed's name for an invalid config (deepspeed.runtime.config.DeepSpeedConfigError)."""


class ConfigError(ValueError, DeepSpeedConfigError):
    """A config key zero3 cannot accept. The message names the key, the value seen and the fix.
    Also a ValueError (what DeepSpeed's pydantic sections raise) and a DeepSpeedConfigError
    (what its hand-read keys raise), so a script's `except` clause for either catches it."""


# --------------------------------------------------------------------------------------
# The keys DeepSpeed 0.19.8 accepts, read from its source (deepspeed/runtime/config.py,
# constants.py, zero/config.py, zero/offload_config.py, precision_config.py and the config
# modules those import). Pydantic sections accept each field name and its alias.
# --------------------------------------------------------------------------------------

DEEPSPEED_TOP_LEVEL_KEYS: tuple[str, ...] = (
    # batch
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "managed_gradient_accumulation",
    # optimizer / scheduler
    "optimizer", "scheduler", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    # precision and gradients
    "bf16", "bfloat16", "fp16", "torch_autocast", "gradient_clipping", "communication_data_type",
    "seq_parallel_communication_data_type", "prescale_gradients", "gradient_predivide_factor",
    "gradient_allreduce_op", "data_types",
    # ZeRO
    "zero_optimization",
    # logging
    "steps_per_print", "wall_clock_breakdown", "memory_breakdown", "dump_state", "log_level",
    "vocabulary_size", "timers",
    # misc runtime
    "disable_allgather", "disable_python_gc", "dataloader_drop_last", "checkpoint",
    "activation_checkpointing", "aio", "use_data_before_expert_parallelism",
    "sequence_parallel_size", "data_parallel_size", "long_sequence",
    # feature blocks
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "flops_profiler", "autotuning",
    "hybrid_engine", "pipeline", "data_efficiency", "datastates_ckpt", "weight_quantization",
    "compile", "tensor_parallel", "expert_parallel",
    # keys DeepSpeed 0.19.8 itself refuses (features removed from DeepSpeed)
    "nebula", "compression_training", "amp", "quantize_training", "sparse_gradients", "eigenvalue",
    "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
    "progressive_layer_drop",
)

DEEPSPEED_ZERO_KEYS: tuple[str, ...] = (
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size",
    "use_multi_rank_bucket_allreduce", "allgather_partitions", "allgather_bucket_size",
    "overlap_comm", "compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint",
    "offload_param", "offload_optimizer", "zenflow", "sub_group_size",
    "cpu_offload_param", "cpu_offload_use_pin_memory", "cpu_offload",
    "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold",
    "model_persistence_threshold", "stage3_model_persistence_threshold",
    "max_live_parameters", "stage3_max_live_parameters",
    "max_reuse_distance", "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment",
    "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "log_trace_cache_warnings", "enable_sanity_checks",
    "save_muon_momentum_buffer_in_memory", "leaf_module",
    # keys DeepSpeed 0.19.8 itself refuses (removed features)
    "mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param",
)

# Top-level sections of zero3's own (DeepSpeed ignores top-level keys it does not know).
ZERO3_TOP_LEVEL_KEYS: tuple[str, ...] = ("placement",)

DEEPSPEED_OFFLOAD_PARAM_KEYS: tuple[str, ...] = (
    "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory",
)

DEEPSPEED_OFFLOAD_OPTIMIZER_KEYS: tuple[str, ...] = (
    "device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read", "pipeline_write",
    "fast_init", "ratio", "super_offload", "cpuadam_cores_perc",
)

DEEPSPEED_BF16_KEYS: tuple[str, ...] = (
    "enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
    "bf16_optimizer_states",
)

DEEPSPEED_FP16_KEYS: tuple[str, ...] = (
    "enabled", "auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
    "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads",
)

# DeepSpeed's default ZeRO-3 leaf module classes (zero/leaf_module_config.py).
_DEFAULT_LEAF_CLASSES: tuple[str, ...] = (
    "transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock",
    "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeSparseMoeBlock",
    "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock",
)

#: DeepSpeed's default gradient_clipping (deepspeed/runtime/constants.py, 0.19.8): 1.0.
GRADIENT_CLIPPING_DEFAULT = 1.0


# --------------------------------------------------------------------------------------
# The typed result
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OffloadConfig:
    """Where a state lives between uses: ``"none"`` (the device), ``"cpu"`` or ``"nvme"``
    (the host first, then swap files under ``nvme_path``: zero3/nvme/). The host's share:
    for the optimizer side ``placement.host_budget`` bytes; for parameter shards
    ``max_in_cpu`` elements (DeepSpeed's key), each bound applying to its own section."""

    device: str = "none"
    pin_memory: bool = False  # from_deepspeed fills DeepSpeed's default (True) when a section is given
    # offload_optimizer only: run the CPU update behind the next forward ("auto", True, False)
    overlap_step: bool | str = "auto"
    # offload_optimizer only: DeepSpeed's ratio, the share of the optimizer state on the host
    # (None: not given; the placement budget decides, zero3/placement/plan.py)
    ratio: float | None = None
    # device "nvme" only: the folder of the swap files, the staging buffers, the pipelining
    nvme_path: str | None = None
    buffer_count: int = 4
    pipeline_read: bool = True
    pipeline_write: bool = True
    # offload_param device "nvme" only: elements per staging buffer, elements kept on the host
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    @property
    def enabled(self) -> bool:
        """True when the state is offloaded off the device (to CPU memory, or NVMe behind it)."""
        return self.device in ("cpu", "nvme")

    @property
    def nvme(self) -> bool:
        """True when what does not fit the host budget goes to swap files under nvme_path."""
        return self.device == "nvme"


@dataclass(frozen=True)
class AioConfig:
    """The ``aio`` section: how the NVMe tier's reads and writes are issued (zero3/nvme/io.py).

    ``block_size``: bytes per I/O call; ``queue_depth``: calls of one request in flight at
    once; ``intra_op_parallelism``: I/O threads; ``single_submit``: calls issued one after
    another instead of a window at a time; ``overlap_events``: the next window is issued
    while the last completes instead of after it. Invariant: block_size is a multiple of
    4096 (direct I/O alignment)."""

    block_size: int = 1048576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True)
class LeafModuleConfig:
    """Modules gathered and released as one fetch unit (DeepSpeed's ZeRO-3 leaf modules).

    ``classes`` match a module's class name or its fully qualified ``module.ClassName``;
    ``names`` match ``model.named_modules()`` names; ``name_suffixes`` match name endings.
    """

    classes: tuple[str, ...] = _DEFAULT_LEAF_CLASSES
    names: tuple[str, ...] = ()
    name_suffixes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlacementConfig:
    """The ``placement`` section (zero3 only; DeepSpeed ignores top-level keys it does not know).

    ``gpu_budget``: bytes of device memory the engine's own tensors may hold (parameter
    shards, gradient shards, masters, optimizer state, resident parameters, gathered units
    and gradient buckets; activations are outside it); None: "auto", the device's free
    memory less the activation reserve and a margin. ``activation_reserve``: bytes kept
    free for activations under the "auto" budget; None: measured over the first
    accumulation window. Both matter only where something is offloaded. ``host_budget``:
    with ``offload_optimizer.device: "nvme"``, host bytes the offloaded optimizer sides may
    hold before the rest goes to swap files (None: none, all of it on NVMe, as DeepSpeed).
    ``early_update_bytes``: with the overlapped host step, the bound on the copies of masters
    and optimizer state kept so that host updates may start in the window's last backward
    (optim/early_update.py); None: 2 GiB, 0: no early updates.
    """

    gpu_budget: int | None = None
    activation_reserve: int | None = None
    host_budget: int | None = None
    early_update_bytes: int | None = None


@dataclass(frozen=True)
class LongSequenceConfig:
    """The ``long_sequence`` section (zero3 only): DeepSpeed ALST's single-card pieces applied
    to a Hugging Face causal LM at initialize (zero3/sequence/long_context.py). ``tiled_mlp``:
    each decoder layer's MLP over tiles of tokens (``mlp_tiles`` a forward; None: "auto",
    ceil(tokens / hidden_size)). ``tiled_loss``: the loss over tiles of at most
    ``loss_tile_bytes`` of fp32 logits, never the full logits. ``offload_hidden_states``: each
    decoder layer checkpointed with its input in pinned host memory, up to ``host_bytes`` (None:
    "auto", the host's available memory less a reserve), the earliest layers' inputs beyond it in
    swap files under ``nvme_path`` (None: none; a forward that does not fit is refused)."""

    tiled_mlp: bool = False
    mlp_tiles: int | None = None
    tiled_loss: bool = False
    loss_tile_bytes: int | None = None
    offload_hidden_states: bool = False
    host_bytes: int | None = None
    nvme_path: str | None = None


@dataclass(frozen=True)
class FileMonitorConfig:
    """The ``tensorboard`` and ``csv_monitor`` sections: rank 0 writes the training events under
    ``<output_path>/<job_name>/`` (DeepSpeed's layout and defaults)."""

    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


@dataclass(frozen=True)
class WandbConfig:
    """The ``wandb`` section: rank 0 logs the training events to a Weights & Biases run."""

    enabled: bool = False
    group: str | None = None
    team: str | None = None
    project: str = "deepspeed"


@dataclass(frozen=True)
class CometConfig:
    """The ``comet`` section: rank 0 logs the training events to a Comet experiment, at most
    once every ``samples_log_interval`` samples; the other keys are comet_ml's
    ``start(...)`` arguments (None: comet_ml's own configuration)."""

    enabled: bool = False
    samples_log_interval: int = 100
    project: str | None = None
    workspace: str | None = None
    api_key: str | None = None
    experiment_name: str | None = None
    experiment_key: str | None = None
    online: bool | None = None
    mode: str | None = None


@dataclass(frozen=True)
class CommsLoggerConfig:
    """The ``comms_logger`` section (zero3/platform/comms_log.py): time the engine's
    collectives by operation and message size; ``zero3.comm.log_summary()`` prints them."""

    enabled: bool = False
    verbose: bool = False
    prof_all: bool = True
    debug: bool = False
    prof_ops: tuple[str, ...] = ()


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """The ``flops_profiler`` section (zero3/monitor/flops_profiler.py): at optimizer step
    ``profile_step``, rank 0 counts its first forward's flops by module and prints DeepSpeed's
    profile summary (to ``output_file`` when given)."""

    enabled: bool = False
    recompute_fwd_factor: float = 0.0
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None


@dataclass(frozen=True)
class MonitorConfig:
    """DeepSpeed's monitor sections (zero3/monitor/): where the events of each optimizer step go."""

    tensorboard: FileMonitorConfig = FileMonitorConfig()
    csv_monitor: FileMonitorConfig = FileMonitorConfig()
    wandb: WandbConfig = WandbConfig()
    comet: CometConfig = CometConfig()

    @property
    def enabled(self) -> bool:
        return any(m.enabled for m in (self.tensorboard, self.csv_monitor, self.wandb, self.comet))


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section: how ``zero3.checkpointing.checkpoint`` (DeepSpeed's
    ``deepspeed.checkpointing.checkpoint``) runs. ``zero3.initialize`` applies it unless the
    script called ``configure()`` itself; ``configure(mpu, deepspeed_config=...)`` reads it as
    DeepSpeed does. What each field does, and what it cannot do without model parallelism, is
    written in zero3/checkpointing/settings.py.

    Invariant: ``contiguous_memory_optimization`` implies ``partition_activations`` and a
    ``number_checkpoints`` (DeepSpeed asserts the same in ``configure``).
    """

    partition_activations: bool = False
    contiguous_memory_optimization: bool = False
    cpu_checkpointing: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class ZeroConfig:
    """The ``zero_optimization`` section."""

    stage: int = 3
    param_persistence_threshold: int = 100_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    reduce_bucket_size: int = 500_000_000
    model_persistence_threshold: int = sys.maxsize
    module_granularity_threshold: int = 0
    gather_16bit_weights_on_model_save: bool = False
    overlap_comm: bool = True
    offload_param: OffloadConfig = OffloadConfig()
    offload_optimizer: OffloadConfig = OffloadConfig()
    sub_group_size: int = 1_000_000_000
    leaf_module: LeafModuleConfig = LeafModuleConfig()
    log_trace_cache_warnings: bool = False
    enable_sanity_checks: bool = False


@dataclass(frozen=True)
class PrecisionConfig:
    """``bf16`` / ``fp16`` sections, ``communication_data_type`` and ``data_types``."""

    dtype: torch.dtype = torch.float32
    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    communication_data_type: torch.dtype | None = None
    auto_cast: bool = False
    check_grad_overflow: bool = False
    # bf16.bf16_master_weights_and_grads / bf16_optimizer_states (zero3/optim/precision.py)
    master_dtype: torch.dtype = torch.float32
    optimizer_state_dtype: torch.dtype = torch.float32
    # data_types.grad_accum_dtype (None: the master dtype)
    grad_accum_dtype: torch.dtype | None = None
    # torch_autocast: the dtype the forward runs under (None: no autocast), and the module
    # classes ("package.Class") whose parameters' gradients are reduced in that dtype
    # (None: DeepSpeed's default list, zero3/engine_parts/autocast.py)
    autocast_dtype: torch.dtype | None = None
    autocast_safe_modules: tuple[str, ...] | None = None

    @property
    def fp16(self) -> bool:
        """True when training in float16 (loss scaling applies)."""
        return self.dtype == torch.float16

    @property
    def bf16(self) -> bool:
        """True when training in bfloat16."""
        return self.dtype == torch.bfloat16

    @property
    def dynamic_loss_scale(self) -> bool:
        """True for fp16 with ``loss_scale`` 0 (DeepSpeed's dynamic loss scaling)."""
        return self.fp16 and self.loss_scale == 0

    @property
    def initial_loss_scale(self) -> float:
        """The first loss scale: ``2**initial_scale_power`` if dynamic, else ``loss_scale``."""
        if not self.fp16:
            return 1.0
        return float(2**self.initial_scale_power) if self.loss_scale == 0 else self.loss_scale

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: ``communication_data_type`` or, as DeepSpeed
        does when it is absent, the compute dtype."""
        return self.communication_data_type or self.dtype


@dataclass(frozen=True)
class ComponentSpec:
    """The ``optimizer`` or ``scheduler`` section.

    ``type`` is the canonical name (``"Adam"``, ``"AdamW"``, ``"SGD"``, ``"WarmupLR"``, ...),
    ``params`` the params as given. ``resolved`` is what to build: for optimizers the
    ``torch.optim`` class name with DeepSpeed's semantics applied (``Adam`` with
    ``adam_w_mode`` true, DeepSpeed's default, is ``AdamW``); for schedulers the DeepSpeed
    schedule. ``kwargs`` are the constructor keyword arguments: DeepSpeed-only params
    removed for optimizers, DeepSpeed's defaults filled in for schedulers.
    """

    type: str
    params: dict
    resolved: str = ""
    kwargs: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Zero3Config:
    """A validated DeepSpeed config."""

    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    zero: ZeroConfig
    precision: PrecisionConfig
    optimizer: ComponentSpec | None
    scheduler: ComponentSpec | None
    steps_per_print: int | None
    wall_clock_breakdown: bool
    zero_allow_untested_optimizer: bool
    prescale_gradients: bool
    gradient_predivide_factor: float
    world_size: int
    memory_breakdown: bool
    dump_state: bool
    disable_python_gc: bool
    dataloader_drop_last: bool
    log_level: str | None
    vocabulary_size: int | None
    checkpoint_tag_validation: str
    checkpoint_arrival_timeout: float
    checkpoint_async_save: bool
    placement: PlacementConfig
    checkpoint_load_rng_state: bool
    throughput_timer_enabled: bool
    throughput_timer_synchronized: bool
    activation_checkpointing: ActivationCheckpointingConfig
    raw: dict
    aio: AioConfig = AioConfig()
    sequence_parallel_size: int = 1
    seq_parallel_communication_data_type: torch.dtype = torch.float32
    long_sequence: LongSequenceConfig = LongSequenceConfig()
    monitor: MonitorConfig = MonitorConfig()
    comms_logger: CommsLoggerConfig = CommsLoggerConfig()
    flops_profiler: FlopsProfilerConfig = FlopsProfilerConfig()

    @property
    def gradient_reduce_dtype(self) -> torch.dtype:
        """The dtype gradients are reduced in: under sequence parallelism
        seq_parallel_communication_data_type, as DeepSpeed's engine does; else
        precision.reduce_dtype."""
        if self.sequence_parallel_size > 1:
            return self.seq_parallel_communication_data_type
        return self.precision.reduce_dtype

    @property
    def data_parallel_size(self) -> int:
        """Ranks that read distinct batches: world_size / sequence_parallel_size."""
        return self.world_size // self.sequence_parallel_size

    # DeepSpeed's `engine.config` is the JSON dict it was given: read it the same way.
    def __getitem__(self, key: str) -> Any:
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.raw.get(key, default)

    def __contains__(self, key: object) -> bool:
        return key in self.raw

    def keys(self):
        return self.raw.keys()

    def items(self):
        return self.raw.items()


# --------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------

Converter = Callable[[str, Any], Any]


@dataclass(frozen=True)
class _Map:
    """The key sets ``field`` to ``convert(key, value)``."""

    field: str
    convert: Converter
    doc: str


@dataclass(frozen=True)
class _Only:
    """The key is accepted only while ``accepts(value)``; other values are refused."""

    accepts: Callable[[Any], bool]
    shown: str  # the accepted values, in words
    why: str  # why those are accepted (and others are not)
    fix: str  # what to do instead of another value


@dataclass(frozen=True)
class _Inert:
    """DeepSpeed accepts the key, but it means nothing without a feature zero3 lacks
    (pipeline or sequence parallelism, ZeRO stages 1/2): any value is accepted with a
    one-line warning, except the values `quiet` accepts (DeepSpeed's default), which
    change nothing to say."""

    why: str
    quiet: Callable[[Any], bool] | None = None


@dataclass(frozen=True)
class _Refuse:
    """zero3 does not support the key."""

    why: str
    fix: str


_Rule = Union[_Map, _Only, _Inert, _Refuse]


@dataclass(frozen=True)
class _Section:
    """One JSON object of the config and the rules for its keys."""

    name: str  # dotted path, "" for the top level
    rules: Mapping[str, _Rule]
    auto_is_default: bool  # DeepSpeed drops "auto" here (pydantic, non-strict)


def _fail(key: str, value: Any, problem: str, fix: str) -> NoReturn:
    """Raise the one error format: key, what is wrong, the value seen, the fix."""
    raise ConfigError(f"{key}: {problem} (got {_show(value)}). {fix}")


def _show(value: Any) -> str:
    """A short JSON-ish rendering of a config value for messages."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _same(a: Any, b: Any) -> bool:
    """Equality of a given value ``a`` and an accepted one ``b`` that keeps booleans apart
    from numbers (``True != 1`` here), except that where ``b`` is a boolean, ``a`` may be
    any of DeepSpeed's boolean spellings (``"true"``, ``1``, ...)."""
    if isinstance(b, bool):
        return _lax_bool(a) is b
    if isinstance(a, bool):
        return False
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


TYPO_CUTOFF = 0.85  # difflib ratio above which an unknown top-level key is taken for a misspelt known one


def _unknown_top_level(key: str, value: Any, section: _Section) -> None:
    """DeepSpeed 0.19.8 reads the top-level keys it knows and ignores the others
    (`comms_config`, `monitor_config` in real configs): accepted with a warning. One that
    is a near spelling of a known key (`gradient_cliping`) is a typo whose setting would be
    lost, and is refused as in a section (`_unknown`)."""
    if difflib.get_close_matches(key, list(section.rules), n=1, cutoff=TYPO_CUTOFF):
        _unknown(key, key, value, section)
    _warn_inert(key, value, "DeepSpeed 0.19.8 ignores top-level keys it does not know, and so does zero3 "
                "(docs/config.md lists the known ones)")


def _unknown(key: str, name: str, value: Any, section: _Section) -> NoReturn:
    """Raise for a key no table knows, suggesting the nearest known one."""
    known = list(section.rules)
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if near:
        hint = f"Did you mean '{_join(section.name, near[0])}'?"
    else:
        nearest = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
        hint = f"The closest known key is '{_join(section.name, nearest[0])}'." if nearest else ""
    _fail(key, value, "unknown key", f"{hint} Every key zero3 knows is listed in docs/config.md.")


def _parse_section(section: _Section, raw: Any) -> dict[str, Any]:
    """Apply ``section.rules`` to the JSON object ``raw``; return the mapped field values."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        _fail(section.name or "config", raw, "expected a JSON object", "Write this section as {...}.")
    values: dict[str, Any] = {}
    set_by: dict[str, str] = {}
    for name, value in raw.items():
        key = _join(section.name, str(name))
        rule = section.rules.get(name)
        if rule is None and not section.name:
            _unknown_top_level(key, value, section)
            continue
        if rule is None:
            _unknown(key, str(name), value, section)
        if isinstance(value, str) and value == "auto":
            if section.auto_is_default:
                continue  # DeepSpeed drops "auto" here: its default applies
            _fail(key, value, "'auto' is a placeholder that the Hugging Face Trainer fills in; "
                  "DeepSpeed itself would use the string as is", "zero3 needs a concrete value: "
                  "write the number (or true/false) here.")
        if isinstance(rule, _Refuse):
            _fail(key, value, f"zero3 does not support this key: {rule.why}", rule.fix)
        if isinstance(rule, _Inert):
            if rule.quiet is None or not rule.quiet(value):
                _warn_inert(key, value, rule.why)
            continue
        if isinstance(rule, _Only):
            if not rule.accepts(value):
                _fail(key, value, f"zero3 accepts only {rule.shown} here: {rule.why}", rule.fix)
            continue
        if rule.field in set_by:
            _fail(key, value, f"sets the same option as '{set_by[rule.field]}'",
                  "Keep only one of the two spellings.")
        values[rule.field] = rule.convert(key, value)
        set_by[rule.field] = key
    return values


# --------------------------------------------------------------------------------------
# Converters and predicates
# --------------------------------------------------------------------------------------


def _to_int(key: str, value: Any, minimum: int | None) -> int:
    """An integer, or an integral float such as 5e7 (DeepSpeed's pydantic accepts those)."""
    bound = f" >= {minimum}" if minimum is not None else ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, value, "expected an integer", f"Write a whole number{bound}, e.g. 5e7 or 50000000.")
    if isinstance(value, float):
        if not math.isfinite(value) or value != int(value):
            _fail(key, value, "expected a whole number", f"Write a whole number{bound}.")
        value = int(value)
    if minimum is not None and value < minimum:
        _fail(key, value, f"must be >= {minimum}", f"Write a whole number{bound}.")
    return value


def _int(minimum: int | None = 0) -> Converter:
    """Converter: an integer (integral floats accepted) at least ``minimum``."""
    return lambda key, value: _to_int(key, value, minimum)


def _int_or_none(minimum: int = 0) -> Converter:
    """Converter: ``null`` or an integer at least ``minimum``."""
    return lambda key, value: None if value is None else _to_int(key, value, minimum)


def _steps_or_never(key: str, value: Any) -> int | None:
    """Converter: a whole number >= 1, or null / Infinity (Accelerate's DeepSpeed path writes
    float("inf"), which DeepSpeed takes as never reaching the step): never."""
    if isinstance(value, float) and value == math.inf:
        return None
    return None if value is None else _to_int(key, value, 1)


def _float(minimum: float = 0.0, strict: bool = False) -> Converter:
    """Converter: a finite number at least (or, if ``strict``, above) ``minimum``."""
    def convert(key: str, value: Any) -> float:
        relation = ">" if strict else ">="
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            _fail(key, value, "expected a finite number", f"Write a number {relation} {minimum}.")
        if value < minimum or (strict and value == minimum):
            _fail(key, value, f"must be {relation} {minimum}", f"Write a number {relation} {minimum}.")
        return float(value)
    return convert


_TRUE_WORDS = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE_WORDS = frozenset({"false", "f", "no", "n", "off", "0"})


def _lax_bool(value: Any) -> bool | None:
    """The boolean DeepSpeed's config (pydantic) reads from `value`: true / false, 1 / 0,
    and the strings "true", "yes", "on", "1", ... (any case); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE_WORDS | _FALSE_WORDS:
        return value.strip().lower() in _TRUE_WORDS
    return None


def _bool(key: str, value: Any) -> bool:
    """Converter: a boolean, in any of DeepSpeed's spellings (`_lax_bool`)."""
    flag = _lax_bool(value)
    if flag is None:
        _fail(key, value, "expected true or false", "Write true or false (JSON booleans, unquoted).")
    return flag


def _warn_inert(key: str, value: Any, why: str) -> None:
    """One line on the first rank: the key is accepted and has no effect."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.warning("zero3: config key %s=%s is accepted and has no effect: %s", key, _show(value), why)


def _choice(options: Mapping[str, Any], fold: Callable[[str], str] = str.lower) -> Converter:
    """Converter: one of ``options`` (compared after ``fold``), mapped to its value."""
    def convert(key: str, value: Any) -> Any:
        if isinstance(value, str) and fold(value) in options:
            return options[fold(value)]
        _fail(key, value, "not a valid choice", f"Use one of: {', '.join(sorted(options))}.")
    return convert


def _is(*accepted: Any) -> Callable[[Any], bool]:
    """Predicate: the value is one of ``accepted`` (booleans kept apart from numbers)."""
    return lambda value: any(_same(value, a) for a in accepted)


def _is_bool(value: Any) -> bool:
    return _lax_bool(value) is not None


def _disabled(flag: str = "enabled") -> Callable[[Any], bool]:
    """Predicate: a feature block that is off (absent/null, or its ``flag`` false or missing)."""
    def accepts(value: Any) -> bool:
        if value is None:
            return True
        return isinstance(value, dict) and value.get(flag, False) in (False, None)
    return accepts


def _defaults_only(defaults: Mapping[str, Any]) -> Callable[[Any], bool]:
    """Predicate: null, or an object whose every key is known and holds DeepSpeed's default."""
    def accepts(value: Any) -> bool:
        if value is None:
            return True
        return isinstance(value, dict) and all(k in defaults and _same(v, defaults[k]) for k, v in value.items())
    return accepts


def _shown_defaults(defaults: Mapping[str, Any]) -> str:
    return "DeepSpeed's defaults (" + ", ".join(f"{k}: {_show(v)}" for k, v in defaults.items()) + ")"


_DTYPE_SPELLINGS: dict[str, torch.dtype] = {  # DeepSpeed's DtypeEnum spellings
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16, "torch.float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32, "torch.float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "torch.bfloat16": torch.bfloat16,
}
_FP32_SPELLINGS = tuple(k for k, v in _DTYPE_SPELLINGS.items() if v == torch.float32)


def _comm_dtype(key: str, value: Any) -> torch.dtype | None:
    """Converter for ``communication_data_type``: null, "fp32", "fp16" or "bf16" (any case)."""
    if value is None:
        return None
    return _choice({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16})(key, value)


def _seq_comm_dtype(key: str, value: Any) -> torch.dtype:
    return _comm_dtype(key, value) or torch.float32


def _dtype_name(key: str, value: Any) -> torch.dtype | None:
    """Converter: null or one of DeepSpeed's dtype spellings ("bf16", "torch.float16", ...)."""
    if value is None:
        return None
    return _choice(_DTYPE_SPELLINGS)(key, value)


def _str_list(key: str, value: Any) -> tuple[str, ...]:
    """Converter: a string or a list of strings, deduplicated in order (as DeepSpeed does)."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        _fail(key, value, "expected a list of strings", 'Write e.g. ["model.layers.0.mlp"].')
    return tuple(dict.fromkeys(value))


# --------------------------------------------------------------------------------------
# Shared reasons
# --------------------------------------------------------------------------------------

_STAGE12 = "DeepSpeed reads it only at ZeRO stages 1 and 2 and ignores it at stage 3, as zero3 does"
_REMOVE = "Remove the key."
_NVME = "NVMe offload is not supported by zero3"
_REMOVED_UPSTREAM = ("DeepSpeed 0.19.8 itself removed this feature and refuses the key "
                     "(https://github.com/deepspeedai/DeepSpeed/issues/8489)")


def _stage12_only(default: Any, why: str = _STAGE12) -> _Inert:
    """A key DeepSpeed ignores at stage 3: any value accepted, a warning unless `default`."""
    return _Inert(why, quiet=_is(default))


def _off(default: Any, why: str, fix: str = _REMOVE) -> _Only:
    return _Only(_is(default), _show(default) + " (DeepSpeed's default)", why, fix)


def _feature_block(what: str, fix: str, flag: str = "enabled") -> _Only:
    return _Only(_disabled(flag), f"a disabled block ({flag}: false, or no {flag} key)",
                 f"zero3 does not implement {what}", fix)


# --------------------------------------------------------------------------------------
# zero_optimization
# --------------------------------------------------------------------------------------


def _stage(key: str, value: Any) -> int:
    """Converter for ``stage``: only 3."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _fail(key, value, "expected the number 3", 'Write "stage": 3 (a number, unquoted).')
    stage = value
    if stage != 3:
        _fail(key, value, "zero3 implements stage 3 only",
              'Set "stage": 3 (parameters, gradients and optimizer states partitioned), or use '
              "DeepSpeed or torch DDP/FSDP for stages 0-2.")
    return 3


def _overlap_comm(key: str, value: Any) -> bool:
    """Converter for ``overlap_comm``: null means DeepSpeed's stage 3 default, true."""
    return True if value is None else _bool(key, value)


def _offload_device(key: str, value: Any) -> str:
    """Converter for ``offload_*.device``: "none", "cpu" or "nvme"."""
    if value is None:
        return "none"
    if value not in ("none", "cpu", "nvme"):
        _fail(key, value, "not a valid offload device", 'Use "none", "cpu" or "nvme".')
    return value


def _nvme_path(key: str, value: Any) -> str | None:
    """Converter for ``nvme_path``: null or a non-empty path string (checked at initialize)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        _fail(key, value, "expected a folder path", 'Write e.g. "/local_nvme" (a folder on a local NVMe drive).')
    return value


def _buffer_count(key: str, value: Any) -> int:
    """Converter for ``offload_*.buffer_count``: at least 1 staging buffer."""
    return _to_int(key, value, 1)


def _block_size(key: str, value: Any) -> int:
    """Converter for ``aio.block_size``: a positive multiple of 4096 bytes (direct I/O)."""
    size = _to_int(key, value, 4096)
    if size % 4096:
        _fail(key, value, "must be a multiple of 4096 (direct I/O alignment)", "Write e.g. 1048576.")
    return size


def _ratio(key: str, value: Any) -> float:
    """Converter for ``offload_optimizer.ratio``: a number from 0 to 1, as DeepSpeed validates it."""
    ratio = _float(0.0)(key, value)
    if ratio > 1.0:
        _fail(key, value, "must be between 0 and 1", "Write the share of the optimizer state to offload, "
              "e.g. 0.3 (1.0: all of it, 0.0: none).")
    return ratio


_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def bytes_or_auto(key: str, value: Any) -> int | None:
    """Converter: "auto" / null (None), a byte count, or a string such as "40GiB" / "38.5 GB"."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if match is None or match.group(2).lower() not in _BYTE_UNITS:
            _fail(key, value, "not a byte size", 'Write "auto", a number of bytes, or e.g. "40GiB" / "38GB".')
        return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])
    return _to_int(key, value, 0)


def _tiles_or_auto(key: str, value: Any) -> int | None:
    if isinstance(value, str) and value.lower() == "auto":
        return None
    return _to_int(key, value, 1)


_LONG_SEQUENCE_RULES: dict[str, _Rule] = {
    "tiled_mlp": _Map("tiled_mlp", _bool, "zero3 only: each decoder layer's MLP runs over tiles of tokens "
                      "(DeepSpeed ALST's TiledMLP), recomputed tile by tile in backward"),
    "mlp_tiles": _Map("mlp_tiles", _tiles_or_auto, 'tiles per MLP call ("auto", the default: ceil(tokens / '
                      "hidden_size), the largest token count over the ranks)"),
    "tiled_loss": _Map("tiled_loss", _bool, "zero3 only: with labels, the causal-LM loss over tiles of tokens "
                       "(DeepSpeed ALST's TiledFusedLogitsLoss): the full logits are never made; outputs.logits "
                       "is None"),
    "loss_tile_bytes": _Map("loss_tile_bytes", bytes_or_auto, 'fp32 logits of one loss tile ("auto", the '
                            'default: 1GiB)'),
    "offload_hidden_states": _Map("offload_hidden_states", _bool, "zero3 only: every decoder layer is "
                                  "checkpointed with its input in pinned host memory, copied on side streams "
                                  "(in place of HF gradient checkpointing for those layers)"),
    "host_bytes": _Map("host_bytes", bytes_or_auto, 'zero3 only: with offload_hidden_states, host bytes for '
                       'the saved layer inputs ("auto", the default: on a GPU the available host memory over '
                       "the ranks of the machine, less a tenth of the host's memory; or bytes, \"60GiB\"); the "
                       "earliest layers' inputs beyond it go to nvme_path"),
    "nvme_path": _Map("nvme_path", _nvme_path, "zero3 only: with offload_hidden_states, the folder (a local "
                      "NVMe drive) of the swap files of the layer inputs that host_bytes does not hold (null, "
                      "the default: none, and a forward whose inputs do not fit the host is refused); the "
                      "aio section tunes the I/O"),
}


_PLACEMENT_RULES: dict[str, _Rule] = {
    "gpu_budget": _Map("gpu_budget", bytes_or_auto,
                       'zero3 only: device bytes the engine\'s own tensors may hold ("auto", the default: the '
                       "device's free memory less the activation reserve and a margin; or bytes, \"40GiB\"); "
                       "what is offloaded but fits stays on the device"),
    "activation_reserve": _Map("activation_reserve", bytes_or_auto,
                               'zero3 only: device bytes left for activations under an "auto" budget ("auto", '
                               "the default: measured over the first accumulation window, then the state is "
                               "placed once)"),
    "host_budget": _Map("host_budget", bytes_or_auto,
                        'zero3 only, with offload_optimizer.device "nvme": host bytes the offloaded optimizer '
                        'sides may hold ("auto", the default: none, all of them on NVMe as DeepSpeed; or bytes, '
                        '"100GiB"); the units past it have their masters and optimizer state in swap files'),
    "early_update_bytes": _Map("early_update_bytes", bytes_or_auto,
                               "zero3 only, with the overlapped host step: host sub-groups whose gradients are "
                               "complete are updated during the window's last backward, each copied first so "
                               "that clipping or a changed hyper-parameter can undo it; the bound on those "
                               'copies ("auto", the default: 2GiB; 0: no updates before step())'),
}


def _overlap_step(key: str, value: Any) -> bool | str:
    """Converter for ``offload_optimizer.overlap_step``: "auto", true or false."""
    if value is None or value == "auto":
        return "auto"
    if not isinstance(value, bool):
        _fail(key, value, 'expected "auto", true or false', 'Write "auto", true or false.')
    return value


_OFFLOAD_COMMON: dict[str, _Rule] = {
    "pin_memory": _Map("pin_memory", _bool, "page-locked CPU buffers for asynchronous copies "
                       "(DeepSpeed's default: true)"),
}

_OFFLOAD_PARAM_RULES: dict[str, _Rule] = {
    "device": _Map("device", _offload_device, '"none", "cpu" or "nvme": where the parameter shards live between '
                   'uses; "nvme": the host up to max_in_cpu elements, the rest in swap files under nvme_path, '
                   "read back through staging buffers ahead of each gather"),
    **_OFFLOAD_COMMON,
    "nvme_path": _Map("nvme_path", _nvme_path, 'device "nvme": the folder of the per-rank parameter swap files '
                      "(must exist, be writable and hold the shards; checked at initialize)"),
    "buffer_count": _Map("buffer_count", _buffer_count, 'device "nvme": host staging buffers the shards are read '
                         "into ahead of their gather (DeepSpeed's default: 5)"),
    "buffer_size": _Map("buffer_size", _int(1), 'device "nvme": elements per staging buffer; every parameter '
                        "shard on NVMe must fit one (DeepSpeed's default: 1e8)"),
    "max_in_cpu": _Map("max_in_cpu", _int(0), 'device "nvme": parameter elements (this rank\'s shards) kept in '
                       "host memory, whole fetch units in forward order; the rest go to NVMe (DeepSpeed's "
                       "default: 1e9)"),
}

_OFFLOAD_OPTIMIZER_RULES: dict[str, _Rule] = {
    "device": _Map("device", _offload_device, '"none", "cpu" or "nvme": where the optimizer side (gradient '
                   'shards, fp32 masters, optimizer state) lives; "nvme": the host up to placement.host_budget, '
                   "the masters and optimizer state of the rest in swap files under nvme_path"),
    **_OFFLOAD_COMMON,
    "nvme_path": _Map("nvme_path", _nvme_path, 'device "nvme": the folder of the per-rank swap files (must '
                      "exist, be writable and hold the state; checked at initialize)"),
    "buffer_count": _Map("buffer_count", _buffer_count, 'device "nvme": host staging buffers, each the size of '
                         "the largest swapped sub-group (DeepSpeed's default: 4; 2 or more let reads and "
                         "writes overlap the update)"),
    "pipeline_read": _Map("pipeline_read", _bool, 'device "nvme": read the next sub-group while the current one '
                          "steps (zero3's default: true)"),
    "pipeline_write": _Map("pipeline_write", _bool, 'device "nvme": write a stepped sub-group back while the '
                           "next one steps (zero3's default: true)"),
    "fast_init": _off(False, "zero3 writes each swapped sub-group once at initialize; there is no slower path "
                      "for fast_init to skip"),
    "ratio": _Map("ratio", _ratio, "DeepSpeed's share of the optimizer state on the host (0 to 1): of the "
                  "fetch units with trainable parameters, in module order, the first int((1 - ratio) * n) keep "
                  "their optimizer state on the device and step there; without it, placement.gpu_budget "
                  "decides"),
    "super_offload": _off(False, "SuperOffload (Superchip CPU offload) is not implemented"),
    "overlap_step": _Map("overlap_step", _overlap_step,
                         'zero3 only: "auto" (default), true or false: the CPU optimizer update of '
                         "the host-side units runs behind the next forward, unit by unit "
                         '("auto": when the compute device is a GPU)'),
    "cpuadam_cores_perc": _off(0.8, "zero3 has no DeepSpeed CPU Adam; the key applies only "
                               "with super_offload"),
}


# The keys with an effect only with device "nvme", and the value that changes nothing elsewhere
# (DeepSpeed's default, accepted with any device).
_NVME_ONLY: dict[str, dict[str, Any]] = {
    "offload_optimizer": {"nvme_path": None, "buffer_count": 4, "pipeline_read": False, "pipeline_write": False},
    "offload_param": {"nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
                      "max_in_cpu": 1_000_000_000},
}


def _offload(rules: Mapping[str, _Rule]) -> Converter:
    """Converter for an ``offload_param`` / ``offload_optimizer`` section."""
    def convert(key: str, value: Any) -> OffloadConfig:
        if value is None:
            return OffloadConfig()
        values = _parse_section(_Section(key, rules, auto_is_default=True), value)
        values.setdefault("device", "none")
        values.setdefault("pin_memory", True)  # DeepSpeed 0.19.8's default when offloading
        _check_nvme_keys(key, values, value)
        return OffloadConfig(**values)
    return convert


def _check_nvme_keys(key: str, values: dict[str, Any], raw: dict) -> None:
    """device "nvme" needs nvme_path; the NVMe keys mean nothing with another device (a
    DeepSpeed default value is accepted there: it changes nothing)."""
    if values["device"] == "nvme" and not values.get("nvme_path"):
        _fail(f"{key}.nvme_path", None, 'device "nvme" needs the folder of the swap files',
              'Add "nvme_path": "/local_nvme" (a folder on a local NVMe drive).')
    defaults = _NVME_ONLY[key.rsplit(".", 1)[-1]]
    if values["device"] == "nvme":
        values.setdefault("buffer_count", defaults["buffer_count"])  # DeepSpeed's: 5 for parameters, 4 else
    else:
        for name in defaults:
            if name in values and not _same(raw.get(name), defaults[name]):
                _fail(f"{key}.{name}", raw.get(name), f"has an effect only with device \"nvme\" (device is "
                      f"{_show(values['device'])})", 'Remove the key, or set "device": "nvme".')
            values.pop(name, None)


_LEAF_RULES: dict[str, _Rule] = {
    "classes": _Map("classes", _str_list, "class names or fully qualified class names"),
    "names": _Map("names", _str_list, "module names as in model.named_modules()"),
    "name_suffixes": _Map("name_suffixes", _str_list, "endings of module names"),
}


def _leaf_module(key: str, value: Any) -> LeafModuleConfig:
    """Converter for ``leaf_module``."""
    if value is None:
        return LeafModuleConfig()
    return LeafModuleConfig(**_parse_section(_Section(key, _LEAF_RULES, auto_is_default=True), value))


def _deprecated_flag(new: str) -> _Only:
    return _Only(_is(None, False), "false or null", "a deprecated DeepSpeed flag",
                 f'Use "{new}": {{"device": "cpu"}} instead.')


_ZERO_RULES: dict[str, _Rule] = {
    "stage": _Map("stage", _stage, "must be 3 (absent means 3 in zero3; DeepSpeed's default is 0)"),
    "stage3_param_persistence_threshold": _Map(
        "param_persistence_threshold", _int(0),
        "parameters with at most this many elements stay gathered between steps"),
    "stage3_prefetch_bucket_size": _Map(
        "prefetch_bucket_size", _int(0),
        "at most this many elements are gathered ahead of use (0: no prefetch)"),
    "stage3_max_live_parameters": _Map(
        "max_live_parameters", _int(0), "bound on gathered (non-persistent) elements per rank"),
    "stage3_max_reuse_distance": _Map(
        "max_reuse_distance", _int(0),
        "a parameter reused within this many elements is kept gathered (0: always release)"),
    "stage3_model_persistence_threshold": _Map(
        "model_persistence_threshold", _int(0), "bound on the total elements kept persistent"),
    "stage3_module_granularity_threshold": _Map(
        "module_granularity_threshold", _int(0),
        "modules finer than this (params / (1 + descendants)) are fetched as one unit"),
    "stage3_gather_16bit_weights_on_model_save": _Map(
        "gather_16bit_weights_on_model_save", _bool,
        "save_16bit_model() gathers and writes the full 16-bit weights"),
    "stage3_gather_fp16_weights_on_model_save": _Map(
        "gather_16bit_weights_on_model_save", _bool,
        "deprecated DeepSpeed alias of stage3_gather_16bit_weights_on_model_save"),
    "reduce_bucket_size": _Map("reduce_bucket_size", _int(1), "elements per reduce-scatter bucket (> 0)"),
    "overlap_comm": _Map("overlap_comm", _overlap_comm,
                         "overlap each gradient bucket's reduce-scatter with the rest of backward (null: true); "
                         "false waits for each one"),
    "offload_param": _Map("offload_param", _offload(_OFFLOAD_PARAM_RULES),
                          "parameter shards in CPU memory, or (device nvme) in swap files past max_in_cpu"),
    "offload_optimizer": _Map("offload_optimizer", _offload(_OFFLOAD_OPTIMIZER_RULES),
                              "fp32 master shards and optimizer state in CPU memory, step on CPU"),
    "sub_group_size": _Map("sub_group_size", _int(0),
                           "the optimizer step runs over the shards in groups of at most this many "
                           "elements (whole parameters, one optimizer call each)"),
    "leaf_module": _Map("leaf_module", _leaf_module,
                        "modules gathered and released as one unit (classes / names / name_suffixes)"),
    "override_module_apply": _Only(_is(True), "true (DeepSpeed's default)",
                                   "inside zero3.Init any code that touches a partitioned parameter, "
                                   "Module.apply(fn) included, sees it gathered and keeps what it writes; "
                                   "that cannot be turned off", _REMOVE),
    "log_trace_cache_warnings": _Map("log_trace_cache_warnings", _bool,
                                     "log a warning when a step leaves the previous step's fetch order "
                                     "(prefetch stops until the next step, which re-records it)"),
    "enable_sanity_checks": _Map("enable_sanity_checks", _bool,
                                 "after every backward, check that each non-resident parameter is released "
                                 "with no hold and each gradient shard has its shard's size (an EngineError "
                                 "names the parameters otherwise)"),
    # accepted when zero3 always satisfies the value
    "contiguous_gradients": _Only(_is_bool, "true or false",
                                  "zero3 always reduces into contiguous shard buffers; the buffer "
                                  "layout is internal", _REMOVE),
    "reduce_scatter": _Only(_is(True), "true", "zero3 always reduce-scatters gradients into shards",
                            _REMOVE),
    "memory_efficient_linear": _Only(_is_bool, "true or false",
                                     "zero3 never patches F.linear; autograd saves the parameter "
                                     "itself, whose storage is released, so a linear layer never "
                                     "pins a gathered weight", _REMOVE),
    "ignore_unused_parameters": _stage12_only(True, _STAGE12 + ": a parameter no rank used in a window "
                                              "is skipped by the optimizer step, as in plain PyTorch"),
    "compute_grad_norm": _Only(_is(True), "true",
                               "the global gradient norm is always computed at stage 3 (DeepSpeed "
                               "refuses false at stage 3 too)", _REMOVE),
    "load_from_fp32_weights": _Only(_is(True), "true",
                                    "zero3 always restores the fp32 master shards from the checkpoint",
                                    "Remove the key; to load only the model weights use "
                                    "load_checkpoint(..., load_module_only=True)."),
    # stage 1/2 only
    "use_multi_rank_bucket_allreduce": _stage12_only(True),
    "allgather_partitions": _stage12_only(True),
    "allgather_bucket_size": _stage12_only(500_000_000, _STAGE12 + " (at stage 3 stage3_prefetch_bucket_size "
                                           "bounds the all-gathers)"),
    "round_robin_gradients": _stage12_only(False),
    "parameter_alignment": _stage12_only(False),
    "legacy_stage1": _stage12_only(False),
    # not implemented
    "elastic_checkpoint": _Inert("DeepSpeed's ZeRO-3 no longer supports elastic checkpoints and only warns; "
                                 "zero3 checkpoints load on any world size", quiet=_is(False)),
    "zenflow": _off(None, "ZenFlow is not implemented"),
    "use_all_reduce_for_fetch_params": _off(False, "zero3 fetches with one coalesced all-gather "
                                            "per unit"),
    "stage3_use_all_reduce_for_fetch_params": _off(False, "zero3 fetches with one coalesced "
                                                   "all-gather per unit"),
    "allgather_sequential": _off(False, "zero3 coalesces one all-gather per fetch unit",
                                 "Remove the key; to bound gather memory lower "
                                 "stage3_prefetch_bucket_size."),
    "stage3_allgather_sequential": _off(False, "zero3 coalesces one all-gather per fetch unit",
                                        "Remove the key; to bound gather memory lower "
                                        "stage3_prefetch_bucket_size."),
    "zero_hpz_partition_size": _Only(_is(0, 1), "1 (DeepSpeed's default) or 0",
                                     "hierarchical partitioning (ZeRO++ hpZ) is not implemented",
                                     _REMOVE),
    "zero_quantized_weights": _off(False, "quantized weight communication (ZeRO++ qwZ) is not "
                                   "implemented"),
    "zero_quantized_nontrainable_weights": _off(False, "quantized storage of frozen weights is "
                                                "not implemented"),
    "zero_quantized_gradients": _off(False, "quantized gradient communication (ZeRO++ qgZ) is not "
                                     "implemented"),
    "pipeline_loading_checkpoint": _Inert("it applies to pipeline-parallel models only, and zero3 has no "
                                          "pipeline parallelism"),
    "save_muon_momentum_buffer_in_memory": _off(False, f"{_NVME}, nor is the Muon optimizer"),
    "cpu_offload_param": _deprecated_flag("offload_param"),
    "cpu_offload": _deprecated_flag("offload_optimizer"),
    "cpu_offload_use_pin_memory": _Only(_is(None), "null", "a deprecated DeepSpeed flag",
                                        "Use offload_param.pin_memory / offload_optimizer.pin_memory."),
    "mics_shard_size": _Refuse(_REMOVED_UPSTREAM + " (MiCS)", _REMOVE),
    "mics_hierarchical_params_gather": _Refuse(_REMOVED_UPSTREAM + " (MiCS)", _REMOVE),
    "zeropp_loco_param": _Refuse(_REMOVED_UPSTREAM + " (LoCo-Zero++)", _REMOVE),
}

# DeepSpeed's pydantic model also accepts the field names without the stage3_ prefix.
for _name in ("param_persistence_threshold", "prefetch_bucket_size", "max_live_parameters",
              "max_reuse_distance", "model_persistence_threshold", "module_granularity_threshold",
              "gather_16bit_weights_on_model_save"):
    _ZERO_RULES[_name] = _ZERO_RULES["stage3_" + _name]
del _name


def _zero(key: str, value: Any) -> ZeroConfig:
    """Converter for ``zero_optimization``."""
    if isinstance(value, bool):
        _fail(key, value, "the boolean form is DeepSpeed's deprecated stage 0/1 switch",
              'Write "zero_optimization": {"stage": 3}.')
    return ZeroConfig(**_parse_section(_Section(key, _ZERO_RULES, auto_is_default=True), value))


# --------------------------------------------------------------------------------------
# Precision
# --------------------------------------------------------------------------------------

_BF16_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "train in bfloat16 (fp32 master shards unless bf16_master_weights_and_grads)"),
    "check_grad_overflow": _Map("check_grad_overflow", _bool,
                                "skip the step when a gradient is inf/nan (DeepSpeed's default: true)"),
    "immediate_grad_update": _off(False, "DeepSpeed uses it only in its stage 0/1 bf16 optimizer; "
                                  "zero3 reduces each gradient into its fp32 shard as it is produced"),
    "bf16_master_weights_and_grads": _Map("bf16_master_weights_and_grads", _bool,
                                          "bf16 master weights and gradient shards (needs bf16.enabled; with "
                                          "bf16_optimizer_states false it needs offload_optimizer on the CPU)"),
    "bf16_optimizer_states": _Map("bf16_optimizer_states", _bool,
                                  "optimizer state in bf16 (needs bf16_master_weights_and_grads)"),
}


def _module_names(key: str, value: Any) -> tuple[str, ...]:
    """Converter: a list of fully qualified class names ("torch.nn.Linear"), as DeepSpeed reads
    torch_autocast.lower_precision_safe_modules (imported at initialize)."""
    if not isinstance(value, list) or not all(isinstance(v, str) and "." in v.strip(".") for v in value):
        _fail(key, value, "expected a list of fully qualified class names",
              'Write e.g. ["torch.nn.Linear", "torch.nn.Conv2d"].')
    return tuple(value)


_AUTOCAST_RULES: dict[str, _Rule] = {
    "enabled": _Map("autocast_enabled", _bool, "run the forward under torch.autocast (parameters and masters stay "
                    "in the bf16/fp16 section's dtype, fp32 without one)"),
    "dtype": _Map("autocast_dtype", _dtype_name, "the autocast dtype (bfloat16 or float16; absent: the enabled "
                  "bf16/fp16 section's dtype)"),
    "lower_precision_safe_modules": _Map("lower_precision_safe_modules", _module_names,
                                         "classes whose parameters' gradients are reduced in the autocast "
                                         "dtype (default: torch.nn Linear, Conv1d, Conv2d, Conv3d); the rest "
                                         "in their own dtype"),
}


_FP16_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "train in float16 with loss scaling (fp32 master shards)"),
    "auto_cast": _Map("auto_cast", _bool, "cast floating-point forward inputs to float16"),
    "loss_scale": _Map("loss_scale", _float(0.0), "static loss scale; 0 = dynamic"),
    "initial_scale_power": _Map("initial_scale_power", _int(0), "dynamic scale starts at 2**power"),
    "loss_scale_window": _Map("loss_scale_window", _int(None),
                              "steps without overflow before the scale grows"),
    "hysteresis": _Map("hysteresis", _int(1), "overflows tolerated before the scale shrinks"),
    "consecutive_hysteresis": _Map("consecutive_hysteresis", _bool,
                                   "refill hysteresis after a step without overflow"),
    "min_loss_scale": _Map("min_loss_scale", _int(None), "floor of the dynamic loss scale"),
    "fp16_master_weights_and_grads": _off(False, "zero3 keeps fp32 master weights and gradients"),
}


def _section_values(rules: Mapping[str, _Rule], auto_is_default: bool = True) -> Converter:
    """Converter: a sub-section parsed with ``rules``; ``auto_is_default`` where DeepSpeed
    validates it with pydantic (which drops "auto")."""
    return lambda key, value: _parse_section(_Section(key, rules, auto_is_default), value)


_DATA_TYPES_RULES: dict[str, _Rule] = {
    "param_dtype": _Map("param_dtype", _dtype_name,
                        "must equal the dtype that bf16/fp16 select (DeepSpeed asserts the same)"),
    "grad_accum_dtype": _Map("grad_accum_dtype", _dtype_name,
                             "dtype the micro-steps' gradients are summed in (null: the masters' dtype, fp32 unless "
                             "bf16_master_weights_and_grads; \"bf16\" / \"fp16\", the model's dtype: DeepSpeed's "
                             "default and its sums bit for bit, cast to the masters' dtype for the step)"),
    "buffer_dtype": _off(None, "zero3 leaves buffers at the dtype they were loaded in (DeepSpeed's "
                         "default); it does not cast buffers",
                         "Remove the key and cast the buffers yourself before initialize()."),
    "keep_in_fp32_modules": _Only(_is("auto", None), '"auto" (DeepSpeed\'s default)',
                                  "zero3 never changes a buffer's dtype, so buffers loaded in fp32 "
                                  "stay fp32; name patterns have nothing to select", _REMOVE),
}


def _data_types(key: str, value: Any) -> dict[str, Any]:
    return _parse_section(_Section(key, _DATA_TYPES_RULES, auto_is_default=False), value)


def _precision(values: Mapping[str, Any]) -> PrecisionConfig:
    """Build the PrecisionConfig from the parsed bf16 / fp16 / data_types sections."""
    bf16: dict = values.get("_bf16", {})
    fp16: dict = values.get("_fp16", {})
    bf16_key = values.get("_bf16_key", "bf16")
    if bf16.get("enabled") and fp16.get("enabled"):
        _fail(f"{bf16_key}.enabled + fp16.enabled", True, "bfloat16 and fp16 cannot both be enabled",
              "Enable only one of them.")
    dtype = torch.bfloat16 if bf16.get("enabled") else torch.float16 if fp16.get("enabled") else torch.float32
    if dtype == torch.float16 and fp16.get("loss_scale", 0.0) == 0.0:
        for name in ("loss_scale_window", "min_loss_scale"):
            if fp16.get(name, 1) <= 0:
                _fail(f"fp16.{name}", fp16[name], "must be > 0 with dynamic loss scaling (loss_scale 0)",
                      "Write a positive whole number.")
    if fp16.get("auto_cast") and dtype != torch.float16:  # DeepSpeed 0.19.8 reads it only with fp16 on
        _warn_inert("fp16.auto_cast", True, "it casts inputs to float16 only with fp16 enabled, and fp16 is off "
                    "(DeepSpeed ignores it too); remove it, or enable fp16")
        fp16 = {**fp16, "auto_cast": False}
    param_dtype = values.get("_data_types", {}).get("param_dtype")
    if param_dtype is not None and param_dtype != dtype:
        _fail("data_types.param_dtype", str(param_dtype).replace("torch.", ""),
              f"conflicts with the enabled precision ({str(dtype).replace('torch.', '')})",
              "Enable the matching bf16/fp16 section, or remove data_types.param_dtype.")
    check = {torch.float16: True, torch.bfloat16: bf16.get("check_grad_overflow", True)}.get(dtype, False)
    scale = {k: v for k, v in fp16.items() if k not in ("enabled", "auto_cast")}
    if "min_loss_scale" in scale:
        scale["min_loss_scale"] = float(scale["min_loss_scale"])
    masters = _master_precision(bf16, bf16_key, dtype, values.get("zero"))
    masters["grad_accum_dtype"] = _grad_accum_dtype(values.get("_data_types", {}).get("grad_accum_dtype"), dtype)
    autocast = _autocast(values.get("_torch_autocast", {}), dtype, values.get("_comm_dtype"))
    return PrecisionConfig(dtype=dtype, communication_data_type=values.get("_comm_dtype"),
                           auto_cast=bool(fp16.get("auto_cast", False)), check_grad_overflow=check, **scale,
                           **masters, **autocast)


def _grad_accum_dtype(accum: torch.dtype | None, dtype: torch.dtype) -> torch.dtype | None:
    """data_types.grad_accum_dtype: fp32, or the 16-bit dtype the model trains in."""
    if accum is None or accum == torch.float32:
        return accum
    if accum != dtype:
        name = str(accum).removeprefix("torch.")
        _fail("data_types.grad_accum_dtype", name, f"a {name} accumulation needs the model in {name} (it trains in "
              f"{str(dtype).removeprefix('torch.')})", f'Enable the {"bf16" if accum == torch.bfloat16 else "fp16"} '
              'section, or write "fp32" / remove the key.')
    return accum


def _master_precision(bf16: dict, bf16_key: str, dtype: torch.dtype, zero: "ZeroConfig | None") -> dict[str, Any]:
    """bf16_master_weights_and_grads / bf16_optimizer_states, checked as DeepSpeed 0.19.8 checks
    them: the second needs the first; bf16 masters with fp32 optimizer state need the optimizer
    offloaded to the CPU (DeepSpeed's ZeRO-Offload requirement). zero3 also asks for bf16.enabled,
    the only dtype a bf16 master can be a copy of."""
    masters, states = bf16.get("bf16_master_weights_and_grads", False), bf16.get("bf16_optimizer_states", False)
    if states and not masters:
        _fail(f"{bf16_key}.bf16_optimizer_states", True, "requires bf16_master_weights_and_grads (as in "
              "DeepSpeed)", f'Set "{bf16_key}": {{"bf16_master_weights_and_grads": true}} too, or remove '
              "bf16_optimizer_states.")
    if masters and dtype != torch.bfloat16:
        _fail(f"{bf16_key}.bf16_master_weights_and_grads", True, f"needs {bf16_key}.enabled true (the model "
              f"trains in {str(dtype).removeprefix('torch.')})", f'Set "{bf16_key}": {{"enabled": true}}, or '
              "remove bf16_master_weights_and_grads.")
    offloaded = zero is not None and zero.offload_optimizer.enabled
    if masters and not states and not offloaded:
        _fail(f"{bf16_key}.bf16_master_weights_and_grads", True, "with bf16_optimizer_states false the fp32 "
              "optimizer state must live on the CPU, as DeepSpeed requires (offload_optimizer.device is "
              f"{zero.offload_optimizer.device if zero is not None else 'none'!r})",
              'Set "bf16_optimizer_states": true (8 bytes a parameter on the device), or '
              '"zero_optimization": {"offload_optimizer": {"device": "cpu"}}.')
    bf16_dtype = torch.bfloat16
    return {"master_dtype": bf16_dtype if masters else torch.float32,
            "optimizer_state_dtype": bf16_dtype if states else torch.float32}


def _autocast(section: dict, dtype: torch.dtype, comm_dtype: torch.dtype | None) -> dict[str, Any]:
    """torch_autocast, checked: a 16-bit autocast dtype, the same as an enabled bf16/fp16
    section's; float16 over fp32 parameters (which needs gradient scaling) and
    communication_data_type (DeepSpeed ignores it under autocast) are refused."""
    if not section.get("autocast_enabled"):
        return {}
    wanted = section.get("autocast_dtype") or (dtype if dtype != torch.float32 else None)
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    if wanted is None:
        _fail("torch_autocast.dtype", None, "no autocast dtype given and neither bf16 nor fp16 is enabled",
              'Write "torch_autocast": {"enabled": true, "dtype": "bfloat16"}.')
    if wanted == torch.float32:
        _fail("torch_autocast.dtype", name(wanted), "autocast to float32 changes nothing",
              'Use "bfloat16" or "float16", or set "enabled": false.')
    if dtype != torch.float32 and wanted != dtype:
        _fail("torch_autocast.dtype", name(wanted), f"differs from the enabled precision ({name(dtype)}): the "
              "parameters would be cast to another 16-bit dtype in every op", f'Write "dtype": "{name(dtype)}".')
    if wanted == torch.float16 and dtype == torch.float32:
        _fail("torch_autocast.dtype", name(wanted), "float16 autocast over fp32 parameters needs gradient "
              "scaling, which zero3 applies only with fp16.enabled", 'Use "dtype": "bfloat16", or enable '
              '"fp16" (the parameters then train in float16 with loss scaling).')
    if comm_dtype is not None:
        _fail("communication_data_type", name(comm_dtype), "is not used under torch_autocast (gradients of "
              "lower_precision_safe_modules are reduced in the autocast dtype, the rest in their own), as in "
              "DeepSpeed", "Remove communication_data_type, or disable torch_autocast.")
    return {"autocast_dtype": wanted, "autocast_safe_modules": section.get("lower_precision_safe_modules")}


# --------------------------------------------------------------------------------------
# Optimizer and scheduler
# --------------------------------------------------------------------------------------

SUPPORTED_OPTIMIZERS: tuple[str, ...] = ("Adam", "AdamW", "SGD")
SUPPORTED_SCHEDULERS: tuple[str, ...] = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle")

_REQUIRED = object()


def _number_or_list(key: str, value: Any) -> Any:
    """A number, or a list of numbers (one per param group, as DeepSpeed accepts)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        _float(0.0)(key, item)
    return list(value) if isinstance(value, list) else float(value)


def _betas(key: str, value: Any) -> tuple[float, float]:
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        _fail(key, value, "expected two numbers", "Write e.g. [0.9, 0.999].")
    for beta in value:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            _fail(key, value, "each beta must be in [0, 1)", "Write e.g. [0.9, 0.999].")
    return (float(value[0]), float(value[1]))


def _optional_bool(key: str, value: Any) -> bool | None:
    return None if value is None else _bool(key, value)


# param -> converter; the value passes to the torch.optim constructor.
_TORCH_COMMON_PARAMS: dict[str, Converter] = {
    "lr": _float(0.0), "weight_decay": _float(0.0), "maximize": _bool, "foreach": _optional_bool,
    "differentiable": _bool, "fused": _optional_bool,
}
_ADAM_PARAMS: dict[str, Converter] = {
    **_TORCH_COMMON_PARAMS, "betas": _betas, "eps": _float(0.0), "amsgrad": _bool, "capturable": _bool,
}
_SGD_PARAMS: dict[str, Converter] = {
    **_TORCH_COMMON_PARAMS, "momentum": _float(0.0), "dampening": _float(0.0), "nesterov": _bool,
}
# What DeepSpeed 0.19.8 builds for "Adam" / "AdamW" (FusedAdam, or DeepSpeedCPUAdam under
# offload_optimizer) defaults to these; torch's AdamW differs in weight_decay (0.01). With
# "torch_adam": true DeepSpeed builds torch's own optimizer, so torch's defaults apply.
# "SGD" is torch's SGD under both. tests/optim/test_optimizer_defaults.py states each.
DEEPSPEED_ADAM_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# DeepSpeed-only Adam params: consumed here, never passed to torch.
_ADAM_DS_PARAMS: dict[str, Callable[[Any], bool] | None] = {
    "adam_w_mode": None,  # mapped: chooses Adam vs AdamW
    "torch_adam": None,  # torch.optim kernels vs FusedAdam: same update; zero3 always uses torch.optim
    "bias_correction": _is(True),
    "set_grad_none": _is(True),
    "fp32_optimizer_states": _is(True, None),
}


def _optimizer_params(key: str, kind: str, params: dict) -> tuple[str, dict]:
    """Validate optimizer params; return (torch.optim class name, constructor kwargs)."""
    allowed = _SGD_PARAMS if kind == "SGD" else _ADAM_PARAMS
    extras = {} if kind == "SGD" else _ADAM_DS_PARAMS
    kwargs: dict[str, Any] = {}
    for name, value in params.items():
        pkey = f"{key}.params.{name}"
        if name == "max_grad_norm":
            _fail(pkey, value, "not an optimizer parameter (DeepSpeed refuses it too)",
                  'Use the top-level "gradient_clipping" key.')
        if isinstance(value, str) and value == "auto":
            _fail(pkey, value, "'auto' is a placeholder that the Hugging Face Trainer fills in",
                  "zero3 needs a concrete value: write the number here.")
        if name in allowed:
            kwargs[name] = allowed[name](pkey, value)
        elif name in extras:
            accepts = extras[name]
            if accepts is None:
                _bool(pkey, value)
            elif not accepts(value):
                _fail(pkey, value, "zero3 supports only the default here: torch.optim applies bias "
                      "correction, zero3 frees gradients itself and keeps optimizer states in fp32",
                      "Remove the key.")
        else:
            near = difflib.get_close_matches(name, [*allowed, *extras], n=1, cutoff=0.5)
            hint = f"did you mean '{near[0]}'? " if near else ""
            _fail(pkey, value, f"unknown {kind} parameter",
                  f"{hint}Known: {', '.join(sorted([*allowed, *extras]))}.")
    if kind == "SGD":
        return "SGD", kwargs
    if not _bool(f"{key}.params.torch_adam", params.get("torch_adam", False)):
        kwargs = {**DEEPSPEED_ADAM_DEFAULTS, **kwargs}
    adamw = kind == "AdamW" or _bool(f"{key}.params.adam_w_mode", params.get("adam_w_mode", True))
    return ("AdamW" if adamw else "Adam"), kwargs  # DeepSpeed: Adam means AdamW unless adam_w_mode is false


_OPTIMIZER_HEADER: dict[str, _Rule] = {
    "type": _Map("type", lambda k, v: v, "Adam, AdamW or SGD (any case)"),
    "params": _Map("params", lambda k, v: v, "constructor parameters"),
    "legacy_fusion": _off(False, "zero3 has no fused legacy optimizer path"),
}
_SCHEDULER_HEADER: dict[str, _Rule] = {
    "type": _Map("type", lambda k, v: v, "WarmupLR, WarmupDecayLR, WarmupCosineLR or OneCycle"),
    "params": _Map("params", lambda k, v: v, "schedule parameters"),
}


def _header(key: str, value: Any, rules: Mapping[str, _Rule]) -> tuple[str, dict]:
    """Parse an optimizer/scheduler header: (type string, params dict)."""
    header = _parse_section(_Section(key, rules, auto_is_default=False), value)
    kind, params = header.get("type"), header.get("params", {})
    if not isinstance(kind, str) or not kind:
        _fail(f"{key}.type", kind, "missing or not a string", f'Write e.g. "type": "{_EXAMPLE[key]}".')
    if params is None:
        params = {}
    if not isinstance(params, dict):
        _fail(f"{key}.params", params, "expected a JSON object", 'Write "params": {...}.')
    return kind, params


_EXAMPLE = {"optimizer": "AdamW", "scheduler": "WarmupLR"}


def _optimizer(key: str, value: Any) -> ComponentSpec | None:
    """Converter for the ``optimizer`` section."""
    if value is None:
        return None
    kind, params = _header(key, value, _OPTIMIZER_HEADER)
    canonical = {name.lower(): name for name in SUPPORTED_OPTIMIZERS}.get(kind.lower())
    if canonical is None:
        _fail(f"{key}.type", kind, "optimizer type not supported by zero3",
              f"Use one of {', '.join(SUPPORTED_OPTIMIZERS)} (case-insensitive), or build any torch "
              "optimizer yourself and pass it to initialize(optimizer=...).")
    resolved, kwargs = _optimizer_params(key, canonical, params)
    return ComponentSpec(type=canonical, params=copy.deepcopy(params), resolved=resolved, kwargs=kwargs)


def _warmup_type(key: str, value: Any) -> str:
    if value not in ("log", "linear"):
        _fail(key, value, "unknown warmup_type (DeepSpeed would fall back to log with a warning)",
              'Use "log" or "linear".')
    return value


def _lr_or_none(key: str, value: Any) -> Any:
    return None if value is None else _number_or_list(key, value)


def _step_or_none(key: str, value: Any) -> int | None:
    return None if value is None else _to_int(key, value, None)


# Scheduler params: name -> (DeepSpeed's default or _REQUIRED, converter), from optim/lr_schedules.py.
_WARMUP: dict[str, tuple[Any, Converter]] = {
    "warmup_min_lr": (0.0, _number_or_list),
    "warmup_num_steps": (1000, _int(1)),
    "warmup_type": ("log", _warmup_type),
    "last_batch_iteration": (-1, _int(-1)),
}
_SCHEDULER_PARAMS: dict[str, dict[str, tuple[Any, Converter]]] = {
    "WarmupLR": {**_WARMUP, "warmup_max_lr": (None, _lr_or_none)},
    "WarmupDecayLR": {**_WARMUP, "warmup_max_lr": (0.001, _number_or_list),
                      "total_num_steps": (_REQUIRED, _int(1))},
    "WarmupCosineLR": {
        "total_num_steps": (_REQUIRED, _int(1)),
        "warmup_min_ratio": (0.0, _float(0.0)),
        "warmup_num_steps": (1000, _int(1)),
        "cos_min_ratio": (0.0001, _float(0.0)),
        "warmup_type": ("log", _warmup_type),
        "last_batch_iteration": (-1, _int(-1)),
    },
    "OneCycle": {
        "cycle_min_lr": (_REQUIRED, _number_or_list),
        "cycle_max_lr": (_REQUIRED, _number_or_list),
        "decay_lr_rate": (0.0, _float(0.0)),
        "cycle_first_step_size": (2000, _int(1)),
        "cycle_second_step_size": (None, _step_or_none),
        "cycle_first_stair_count": (0, _int(None)),
        "cycle_second_stair_count": (None, _step_or_none),
        "decay_step_size": (0, _int(0)),
        "cycle_momentum": (True, _bool),
        "cycle_min_mom": (0.8, _number_or_list),
        "cycle_max_mom": (0.9, _number_or_list),
        "decay_mom_rate": (0.0, _float(0.0)),
        "last_batch_iteration": (-1, _int(-1)),
    },
}


def _scheduler_kind(key: str, kind: str) -> str:
    """The supported scheduler name for ``kind`` (exact, as DeepSpeed matches it)."""
    if kind in SUPPORTED_SCHEDULERS:
        return kind
    if kind == "LRRangeTest":
        _fail(key, kind, "LRRangeTest is not supported by zero3: it is an exploration tool, not a "
              "training schedule", "Run the range test separately, then configure the schedule you "
              f"chose ({', '.join(SUPPORTED_SCHEDULERS)}).")
    near = difflib.get_close_matches(kind, SUPPORTED_SCHEDULERS, n=1, cutoff=0.5)
    hint = f"Did you mean '{near[0]}'? " if near else ""
    _fail(key, kind, "scheduler type not supported by zero3 (DeepSpeed would also look it up in "
          "torch.optim.lr_scheduler)", f"{hint}Use one of {', '.join(SUPPORTED_SCHEDULERS)}, or build a "
          "torch scheduler yourself and pass it to initialize(lr_scheduler=...).")


def _scheduler(key: str, value: Any) -> ComponentSpec | None:
    """Converter for the ``scheduler`` section."""
    if value is None:
        return None
    kind, params = _header(key, value, _SCHEDULER_HEADER)
    kind = _scheduler_kind(f"{key}.type", kind)
    table = _SCHEDULER_PARAMS[kind]
    kwargs: dict[str, Any] = {}
    for name, param_value in params.items():
        pkey = f"{key}.params.{name}"
        if name not in table:
            near = difflib.get_close_matches(name, list(table), n=1, cutoff=0.5)
            hint = f"did you mean '{near[0]}'? " if near else ""
            _fail(pkey, param_value, f"unknown {kind} parameter", f"{hint}Known: {', '.join(table)}.")
        if isinstance(param_value, str) and param_value == "auto":
            _fail(pkey, param_value, "'auto' is a placeholder that the Hugging Face Trainer fills in",
                  "zero3 needs a concrete value: write the number here.")
        kwargs[name] = table[name][1](pkey, param_value)
    for name, (default, _) in table.items():
        if name not in kwargs:
            if default is _REQUIRED:
                _fail(f"{key}.params.{name}", None, f"required by {kind}", f"Add {name} to {key}.params.")
            kwargs[name] = default
    return ComponentSpec(type=kind, params=copy.deepcopy(params), resolved=kind, kwargs=kwargs)


# --------------------------------------------------------------------------------------
# Other sections
# --------------------------------------------------------------------------------------

_CHECKPOINT_RULES: dict[str, _Rule] = {
    "tag_validation": _Map("tag_validation", _choice({"warn": "WARN", "ignore": "IGNORE", "fail": "FAIL"}),
                           "Warn / Ignore / Fail when ranks save with different tags"),
    "arrival_timeout": _Map("arrival_timeout", _float(0.0, strict=True),
                            "zero3: seconds save_checkpoint / load_checkpoint wait for every rank to arrive "
                            "before raising CheckpointArrivalError (default 60)"),
    "async_save": _Map("async_save", _bool,
                       "zero3: save_checkpoint returns once a host snapshot is taken and writes in the "
                       "background (default false; save_checkpoint(async_save=) overrides it per call); "
                       "initialize allocates the snapshot's host buffer"),
    "load_rng_state": _Map("load_rng_state", _bool,
                           "zero3: load_checkpoint also restores each rank's Python, NumPy and torch (and CUDA) "
                           "RNG states saved with the checkpoint (default false: as DeepSpeed, the RNG is left "
                           "as it is)"),
    "load_universal": _off(False, "DeepSpeed's universal checkpoint format is not read by zero3",
                           "Remove the key: zero3 checkpoints load on any world size."),
    "use_node_local_storage": _off(False, "zero3 writes every checkpoint to one shared directory"),
    "parallel_write": _Inert("it applies to pipeline stages only, and zero3 has no pipeline parallelism"),
    "writer": _off(None, "zero3 has its own checkpoint writer (manifest, checksums, commit marker)"),
    "checkpoint_serialization": _off(True, "zero3 chooses its own checkpoint serialization"),
}

_THROUGHPUT_RULES: dict[str, _Rule] = {
    "enabled": _Map("throughput_timer_enabled", _bool, "report samples/s every steps_per_print"),
    "synchronized": _Map("throughput_timer_synchronized", _bool, "synchronize the device when timing"),
}
_TIMERS_RULES: dict[str, _Rule] = {
    "throughput": _Map("throughput", _section_values(_THROUGHPUT_RULES),
                       "throughput timer: enabled, synchronized"),
}


def _timers(key: str, value: Any) -> dict[str, Any]:
    return _parse_section(_Section(key, _TIMERS_RULES, auto_is_default=False), value).get("throughput", {})


_ACTIVATION_CHECKPOINTING_RULES: dict[str, _Rule] = {
    "partition_activations": _Map("partition_activations", _bool,
                                  "split each checkpoint's saved inputs across the model-parallel group "
                                  "(an mpu given to configure); with no model parallelism there is nothing "
                                  "to split and the inputs are kept whole"),
    "contiguous_memory_optimization": _Map("contiguous_memory_optimization", _bool,
                                           "validated as DeepSpeed does (needs partition_activations and "
                                           "number_checkpoints); no further effect: zero3 keeps the saved "
                                           "inputs as they are, so there are no partition copies to pack"),
    "cpu_checkpointing": _Map("cpu_checkpointing", _bool,
                              "keep each checkpoint's saved inputs in pinned host memory (copied on a side "
                              "stream on a GPU) and bring them back for the recomputation"),
    "number_checkpoints": _Map("number_checkpoints", _int_or_none(1),
                               "checkpoints in a forward: sizes DeepSpeed's contiguous buffers; validated, "
                               "no further effect"),
    "synchronize_checkpoint_boundary": _Map("synchronize_checkpoint_boundary", _bool,
                                            "synchronize the device before and after each checkpoint's "
                                            "forward and recomputation"),
    "profile": _Map("profile", _bool, "log the time of each checkpoint's forward and recomputation (rank 0)"),
}


def _activation_checkpointing(key: str, value: Any) -> ActivationCheckpointingConfig:
    values = _parse_section(_Section(key, _ACTIVATION_CHECKPOINTING_RULES, auto_is_default=False), value)
    return checked_activation_checkpointing(ActivationCheckpointingConfig(**values), key + ".")


def checked_activation_checkpointing(settings: ActivationCheckpointingConfig,
                                     prefix: str = "") -> ActivationCheckpointingConfig:
    """`settings` if it holds ActivationCheckpointingConfig's invariant; else ConfigError naming
    the keys (each spelled with ``prefix``) and the fix."""
    if settings.contiguous_memory_optimization and not settings.partition_activations:
        _fail(f"{prefix}contiguous_memory_optimization", True, "contiguous checkpointing works only with "
              f"partitioned activations ({prefix}partition_activations is false)",
              "Set partition_activations true, or contiguous_memory_optimization false.")
    if settings.contiguous_memory_optimization and settings.number_checkpoints is None:
        _fail(f"{prefix}number_checkpoints", None, "contiguous checkpointing needs the number of "
              "checkpoints in a forward", "Set number_checkpoints to the number of checkpointed blocks.")
    return settings


def activation_checkpointing_of(config: "dict | str | os.PathLike") -> ActivationCheckpointingConfig:
    """The ``activation_checkpointing`` section of a DeepSpeed config (a dict, a JSON path or
    base64 JSON), parsed alone: the rest of the config is not validated here (DeepSpeed's
    ``checkpointing.configure(deepspeed_config=...)`` reads only this section too)."""
    raw = _load(config)
    return _activation_checkpointing("activation_checkpointing", raw.get("activation_checkpointing") or {})


_AIO_RULES: dict[str, _Rule] = {
    "block_size": _Map("block_size", _block_size, "bytes per read or write call of the swap files (a multiple "
                       "of 4096; DeepSpeed's default 1 MiB)"),
    "queue_depth": _Map("queue_depth", _int(1), "calls of one sub-group's read or write in flight at once "
                        "(DeepSpeed's default 8)"),
    "intra_op_parallelism": _Map("intra_op_parallelism", _int(1), "I/O threads (DeepSpeed's default 1)"),
    "thread_count": _Map("intra_op_parallelism", _int(1), "older DeepSpeed's name of intra_op_parallelism"),
    "single_submit": _Map("single_submit", _bool, "issue the calls of a request one after another instead of "
                          "queue_depth at a time"),
    "overlap_events": _Map("overlap_events", _bool, "issue the next window of calls while the last completes "
                           "(true) or after it (false)"),
    "use_gds": _Only(_is(False), "false (DeepSpeed's default)", "GPUDirect Storage moves files to GPU memory, "
                     "and zero3 steps NVMe state on the CPU through host buffers", _REMOVE),
}


def _aio(key: str, value: Any) -> AioConfig:
    """Converter for the ``aio`` section."""
    return AioConfig(**_parse_section(_Section(key, _AIO_RULES, auto_is_default=True), value))
_PIPELINE_DEFAULTS = {
    "stages": "auto", "partition": "best", "seed_layers": False, "activation_checkpoint_interval": 0,
    "pipe_partitioned": True, "grad_partitioned": True,
}

_LOG_LEVELS = {name: name for name in ("debug", "info", "warning", "error", "critical")}


def _log_level(key: str, value: Any) -> str | None:
    return None if value is None else _choice(_LOG_LEVELS)(key, value)


def _no_tensor_parallel(value: Any) -> bool:
    """Predicate: a tensor_parallel block that asks for no tensor parallelism."""
    if value is None:
        return True
    return isinstance(value, dict) and set(value) <= {"autotp_size"} and _is(0, 1)(value.get("autotp_size", 0))


def _optional_str(key: str, value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    _fail(key, value, "expected a string or null", "Write a string.")


def _str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    _fail(key, value, "expected a string", "Write a string.")


def _optional_bool(key: str, value: Any) -> bool | None:
    return None if value is None else _bool(key, value)


_FILE_MONITOR_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "write the training events (rank 0)"),
    "output_path": _Map("output_path", _str, 'folder of the job folder ("" the default: the working directory)'),
    "job_name": _Map("job_name", _str, 'the job folder\'s name ("DeepSpeedJobName", DeepSpeed\'s default)'),
}
_WANDB_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "log the training events to a Weights & Biases run (rank 0; needs wandb)"),
    "group": _Map("group", _optional_str, "the run's group"),
    "team": _Map("team", _optional_str, "the W&B team (entity)"),
    "project": _Map("project", _str, 'the W&B project ("deepspeed", DeepSpeed\'s default)'),
}
_COMET_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "log the training events to a Comet experiment (rank 0; needs comet_ml)"),
    "samples_log_interval": _Map("samples_log_interval", _int(1), "log at most once every N samples (100)"),
    **{name: _Map(name, _optional_str, f"comet_ml's {name} (null: its own configuration)")
       for name in ("project", "workspace", "api_key", "experiment_name", "experiment_key", "mode")},
    "online": _Map("online", _optional_bool, "log to the Comet server (true) or an offline archive (false)"),
}


def _op_names(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    _fail(key, value, "expected a list of operation names", 'Write e.g. ["all_gather", "reduce_scatter"].')


_COMMS_LOGGER_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "time the engine's collectives by operation and message size"),
    "verbose": _Map("verbose", _bool, "print each collective as it completes (rank of the caller)"),
    "prof_all": _Map("prof_all", _bool, "log every operation (true, DeepSpeed's default) or only prof_ops"),
    "debug": _Map("debug", _bool, "add the calling function's name to the verbose lines"),
    "prof_ops": _Map("prof_ops", _op_names, "the operations to log when prof_all is false (all_gather, "
                     "reduce_scatter, all_reduce, broadcast)"),
}


_FLOPS_PROFILER_RULES: dict[str, _Rule] = {
    "enabled": _Map("enabled", _bool, "profile one optimizer step's forward (rank 0) and print the summary"),
    "recompute_fwd_factor": _Map("recompute_fwd_factor", _float(0.0),
                                 "share of the forward run again in backward (activation checkpointing: 1.0); "
                                 "the backward counts (2 + factor) x the forward's flops"),
    "profile_step": _Map("profile_step", _int(0), "the optimizer step (global_steps) whose first forward is profiled"),
    "module_depth": _Map("module_depth", _int(-1), "depth of the aggregated profile (-1: every depth)"),
    "top_modules": _Map("top_modules", _int(1), "modules listed per depth in the aggregated profile"),
    "detailed": _Map("detailed", _bool, "also print the module tree with each module's profile"),
    "output_file": _Map("output_file", _optional_str, "write the summary to this file (null: standard output)"),
}


def _monitor(rules: Mapping[str, _Rule], build: type) -> Converter:
    """Converter: one monitor section (auto_is_default: DeepSpeed validates it with pydantic)."""
    return lambda key, value: build(**_parse_section(_Section(key, rules, auto_is_default=True), value))


_TOP_RULES: dict[str, _Rule] = {
    "train_batch_size": _Map("train_batch_size", _int(None), "global batch: micro * accumulation * world"),
    "train_micro_batch_size_per_gpu": _Map("train_micro_batch_size_per_gpu", _int(None),
                                           "batch per rank per forward"),
    "gradient_accumulation_steps": _Map("gradient_accumulation_steps", _int(None),
                                        "micro-steps per optimizer step"),
    "gradient_clipping": _Map("gradient_clipping", _float(0.0),
                              "clip the global gradient norm (0: off; absent: 1.0, DeepSpeed 0.19.8's default)"),
    "zero_optimization": _Map("zero", _zero, "ZeRO-3 settings (see the zero_optimization table)"),
    "bf16": _Map("_bf16", _section_values(_BF16_RULES), "bfloat16 training"),
    "bfloat16": _Map("_bf16", _section_values(_BF16_RULES), "DeepSpeed's alias of bf16"),
    "fp16": _Map("_fp16", _section_values(_FP16_RULES), "float16 training with loss scaling"),
    "communication_data_type": _Map("_comm_dtype", _comm_dtype,
                                    "dtype of gradient reduction (fp32/bf16/fp16; null: compute dtype)"),
    "data_types": _Map("_data_types", _data_types, "param_dtype check; see the data_types table"),
    "optimizer": _Map("optimizer", _optimizer, "Adam / AdamW / SGD built by zero3"),
    "scheduler": _Map("scheduler", _scheduler, "WarmupLR / WarmupDecayLR / WarmupCosineLR / OneCycle"),
    "zero_allow_untested_optimizer": _Map("zero_allow_untested_optimizer", _bool,
                                          "allow a client optimizer other than Adam/AdamW/SGD"),
    "prescale_gradients": _Map("prescale_gradients", _bool,
                               "divide gradients before the reduction instead of after"),
    "gradient_predivide_factor": _Map("gradient_predivide_factor", _float(0.0, strict=True),
                                      "divide by this before the reduction, by world/factor after"),
    "steps_per_print": _Map("steps_per_print", _steps_or_never, "log every N optimizer steps (null, or "
                            "Infinity as Accelerate writes it: never)"),
    "wall_clock_breakdown": _Map("wall_clock_breakdown", _bool, "log forward/backward/step timings"),
    "memory_breakdown": _Map("memory_breakdown", _bool, "log memory use around forward/backward/step"),
    "dump_state": _Map("dump_state", _bool, "print the engine configuration at initialize"),
    "log_level": _Map("log_level", _log_level, "zero3 logger level (debug ... critical)"),
    "vocabulary_size": _Map("vocabulary_size", _int_or_none(1),
                            "only a warning when not a multiple of 8 (as DeepSpeed)"),
    "timers": _Map("_timers", _timers, "throughput timer (timers.throughput.enabled / synchronized)"),
    "disable_python_gc": _Map("disable_python_gc", _bool,
                              "disable automatic Python GC; collect at safe boundaries"),
    "dataloader_drop_last": _Map("dataloader_drop_last", _bool,
                                 "drop the last incomplete batch of training_data's loader"),
    "checkpoint": _Map("_checkpoint", _section_values(_CHECKPOINT_RULES, auto_is_default=False),
                       "checkpoint.tag_validation; see the checkpoint table"),
    "placement": _Map("_placement", _section_values(_PLACEMENT_RULES, auto_is_default=False),
                      "zero3 only: the GPU memory budget of offloaded state; see the placement table"),
    # accepted with the values zero3 satisfies
    "managed_gradient_accumulation": _Only(_is(True), "true (DeepSpeed's default)",
                                           "zero3 steps the optimizer only at the accumulation boundary",
                                           "Remove the key; set gradient_accumulation_steps to 1 to step "
                                           "on every call."),
    "zero_force_ds_cpu_optimizer": _Only(_is_bool, "true or false",
                                         "zero3 runs any torch optimizer on CPU shards when offloading; "
                                         "there is no DeepSpeed CPU optimizer to force", _REMOVE),
    "gradient_allreduce_op": _Only(_is("mean"), '"mean" (DeepSpeed\'s default)',
                                   "gradients are averaged; DeepSpeed refuses \"sum\" at stage 3 too",
                                   _REMOVE),
    "disable_allgather": _off(False, "DeepSpeed 0.19.8 does not use this flag; zero3 always gathers"),
    "seq_parallel_communication_data_type": _Map("seq_parallel_communication_data_type", _seq_comm_dtype,
                                                 "with sequence_parallel_size > 1: the dtype gradients are "
                                                 "reduced in (fp32, the default, as DeepSpeed; bf16 / fp16)"),
    "sequence_parallel_size": _Map("sequence_parallel_size", _int(1), "Ulysses sequence parallelism: ranks that "
                                   "split each sequence (consecutive ranks; it must divide the world size)"),
    "data_parallel_size": _Map("data_parallel_size", _int(1), "checked: world_size / sequence_parallel_size"),
    "long_sequence": _Map("_long_sequence", _section_values(_LONG_SEQUENCE_RULES, auto_is_default=True),
                          "zero3 only: tiled MLP, tiled loss and hidden states on the host for HF causal LMs; "
                          "see the long_sequence table"),
    "use_data_before_expert_parallelism": _off(False, "expert parallelism is not implemented"),
    "activation_checkpointing": _Map("activation_checkpointing", _activation_checkpointing,
                                     "zero3.checkpointing.checkpoint's options (DeepSpeed's "
                                     "deepspeed.checkpointing); see the activation_checkpointing table"),
    "aio": _Map("aio", _aio, "how NVMe swap reads and writes are issued; see the aio table"),
    "pipeline": _Inert("DeepSpeed reads it only for a PipelineModule, and zero3 has no pipeline parallelism"),
    "tensor_parallel": _Only(_no_tensor_parallel, "{} or {\"autotp_size\": 0 or 1}",
                             "tensor parallelism is not implemented", _REMOVE),
    "torch_autocast": _Map("_torch_autocast", _section_values(_AUTOCAST_RULES, auto_is_default=False),
                           "run the forward under torch.autocast; see the torch_autocast table"),
    "tensorboard": _Map("_tensorboard", _monitor(_FILE_MONITOR_RULES, FileMonitorConfig),
                        "TensorBoard events of each step (zero3/monitor/); see the tensorboard table"),
    "csv_monitor": _Map("_csv_monitor", _monitor(_FILE_MONITOR_RULES, FileMonitorConfig),
                        "a CSV file per event (zero3/monitor/); see the csv_monitor table"),
    "wandb": _Map("_wandb", _monitor(_WANDB_RULES, WandbConfig), "W&B logging (zero3/monitor/); see the wandb table"),
    "comet": _Map("_comet", _monitor(_COMET_RULES, CometConfig), "Comet logging (zero3/monitor/); see the comet table"),
    "comms_logger": _Map("_comms_logger", _monitor(_COMMS_LOGGER_RULES, CommsLoggerConfig),
                         "time the engine's collectives; zero3.comm.log_summary() prints them (see the "
                         "comms_logger table)"),
    "flops_profiler": _Map("_flops_profiler", _monitor(_FLOPS_PROFILER_RULES, FlopsProfilerConfig),
                           "DeepSpeed's profile summary at profile_step from torch's flop counter (see the "
                           "flops_profiler table)"),
    "autotuning": _feature_block("autotuning", "Remove the block and set the sizes yourself."),
    "hybrid_engine": _feature_block("the hybrid (RLHF) engine", _REMOVE),
    "data_efficiency": _feature_block("data efficiency (curriculum sampling, random-LTD)", _REMOVE),
    "expert_parallel": _feature_block("expert parallelism", _REMOVE),
    "compile": _feature_block("DeepCompile", "Remove the block; call torch.compile on the model.",
                              flag="deepcompile"),
    "datastates_ckpt": _Only(_is(None, False), "false or null", "DataStates asynchronous checkpointing "
                             "is not implemented", _REMOVE),
    "weight_quantization": _Refuse("weight quantization is an inference feature", _REMOVE),
}
for _name in ("nebula", "compression_training", "amp", "quantize_training", "sparse_gradients",
              "eigenvalue", "sparse_attention", "elasticity", "graph_harvesting", "curriculum_learning",
              "progressive_layer_drop"):
    _TOP_RULES[_name] = _Refuse(_REMOVED_UPSTREAM, _REMOVE)
del _name
_TOP_RULES["amp"] = _Refuse(_REMOVED_UPSTREAM + " (Apex AMP)", 'Use "bf16" or "fp16".')
_TOP_RULES["curriculum_learning"] = _Refuse(_REMOVED_UPSTREAM, "Remove the key (zero3 does not "
                                            "implement data_efficiency curriculum learning either).")
_TOP_RULES["elasticity"] = _Refuse(_REMOVED_UPSTREAM, "Set train_batch_size / "
                                   "train_micro_batch_size_per_gpu / gradient_accumulation_steps.")


# --------------------------------------------------------------------------------------
# Batch sizes
# --------------------------------------------------------------------------------------

_TBS, _MICRO, _GAS = "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"


def _positive(key: str, value: int) -> None:
    if value <= 0:
        _fail(key, value, "must be > 0", "Write a positive whole number.")


def _derive(key: str, total: int, divisor: int, arithmetic: str) -> int:
    """``total // divisor`` when it divides exactly, else an error showing the arithmetic."""
    if total % divisor:
        _fail(key, total, f"is not a multiple of {arithmetic} = {divisor}",
              f"Make {key} a multiple of {divisor}, or give all three batch keys.")
    return total // divisor


def _batch_sizes(tbs: int | None, micro: int | None, gas: int | None, world: int) -> tuple[int, int, int]:
    """DeepSpeed's batch rules: train_batch_size = micro * accumulation * world_size."""
    for key, value in ((_TBS, tbs), (_MICRO, micro), (_GAS, gas)):
        if value is not None:
            _positive(key, value)
    if tbs is not None and micro is not None and gas is not None:
        if tbs != micro * gas * world:
            _fail(_TBS, tbs, f"must equal {_MICRO} * {_GAS} * world_size = {micro} * {gas} * {world} "
                  f"= {micro * gas * world}", "Fix one of the three, or drop train_batch_size and let "
                  "zero3 derive it.")
        return tbs, micro, gas
    if tbs is not None and micro is not None:
        return tbs, micro, _derive(_TBS, tbs, micro * world, f"{_MICRO} * world_size = {micro} * {world}")
    if tbs is not None and gas is not None:
        return tbs, _derive(_TBS, tbs, gas * world, f"{_GAS} * world_size = {gas} * {world}"), gas
    if micro is not None and gas is not None:
        return micro * gas * world, micro, gas
    if tbs is not None:
        return tbs, _derive(_TBS, tbs, world, f"world_size = {world}"), 1
    if micro is not None:
        return micro * world, micro, 1
    _fail(_MICRO, None, "no batch size given (need train_batch_size or train_micro_batch_size_per_gpu)",
          f"Add {_MICRO} (and optionally {_GAS}), or {_TBS}.")


# --------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict:
    """json object hook: refuse duplicate keys, as DeepSpeed does."""
    result: dict = {}
    for key, value in pairs:
        if key in result:
            raise ConfigError(f"{key}: duplicate key in the JSON config (got {_show(value)} after "
                              f"{_show(result[key])}). Keep only one.")
        result[key] = value
    return result


def _load(config: "dict | str | os.PathLike") -> dict:
    """The config as a dict: given, read from a JSON file, or decoded from base64 JSON."""
    if isinstance(config, dict):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"config: expected a dict or a path to a JSON file (got {type(config).__name__}). "
                          "Pass the DeepSpeed config dict or its file path.")
    path = os.fspath(config)
    if os.path.exists(path):
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        source = f"config file {path}"
    else:
        try:
            text = base64.urlsafe_b64decode(path).decode("utf-8")
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise ConfigError(f"config: no such file (got {path!r}). Pass an existing JSON file path, a "
                              "dict, or a base64-encoded JSON string.") from None
        source = "base64 config"
    try:
        loaded = json.loads(text, object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: {source} is not valid JSON ({exc.msg} at line {exc.lineno}, "
                          f"column {exc.colno}). Fix the JSON (zero3 reads plain JSON, no comments).") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config: {source} must hold a JSON object (got {_show(loaded)}). Write {{...}}.")
    return loaded


def _check_nvme_settings(values: dict[str, Any]) -> None:
    """placement.host_budget decides between the host and NVMe: it needs the NVMe tier; an
    asynchronous save holds a host copy of all of a rank's state, which the tier avoids."""
    zero = values.get("zero", ZeroConfig())
    nvme = zero.offload_optimizer.nvme
    on_nvme = [f"{name}.device" for name, section in (("offload_optimizer", zero.offload_optimizer),
                                                       ("offload_param", zero.offload_param)) if section.nvme]
    if on_nvme and values.get("_checkpoint", {}).get("async_save"):
        _fail("checkpoint.async_save", True, f"keeps a host copy of all of a rank's state, and {on_nvme[0]} "
              '"nvme" is there because the host cannot hold it', "Remove the key (saves then stream the state "
              'from the swap files), or offload to "cpu".')
    budget = values.get("_placement", {}).get("host_budget")
    if budget is not None and not nvme:
        _fail("placement.host_budget", budget, 'splits the optimizer state between the host and NVMe, and '
              'offload_optimizer.device is not "nvme"', 'Remove the key, or set offload_optimizer.device to '
              '"nvme" with an nvme_path.')


def _sequence_parallel_size(values: dict[str, Any], world_size: int, from_mpu: int | None) -> int:
    """sequence_parallel_size (default 1, or the mpu's) must divide the world and agree with the
    mpu's; data_parallel_size, when given, must be what is left (DeepSpeed's batch arithmetic is
    over world / sp)."""
    sp = values.get("sequence_parallel_size", from_mpu or 1)
    if from_mpu is not None and sp != from_mpu:
        _fail("sequence_parallel_size", sp, f"differs from the mpu's sequence-parallel world size {from_mpu}",
              "Give register_with_transformers and the config the same degree.")
    if world_size % sp:
        _fail("sequence_parallel_size", sp, f"does not divide the world size {world_size}",
              f"Launch a multiple of {sp} ranks, or pick a degree that divides {world_size}.")
    dp = values.get("data_parallel_size")
    if dp is not None and dp != world_size // sp:
        _fail("data_parallel_size", dp, f"must equal world_size / sequence_parallel_size = {world_size} / {sp} = "
              f"{world_size // sp}", "Remove the key (zero3 derives it), or fix it.")
    return sp


def from_deepspeed(config: "dict | str | os.PathLike", world_size: int,
                   sequence_parallel_size: int | None = None) -> Zero3Config:
    """Parse and validate a DeepSpeed config for ``world_size`` ranks (``sequence_parallel_size``:
    the degree of the mpu given to initialize, if any).

    Raises ConfigError for anything zero3 cannot honour, naming the key, the value and the fix.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size: must be a positive integer (got {world_size!r}). "
                          "Pass the number of data-parallel ranks.")
    raw = _load(config)
    values = _parse_section(_Section("", _TOP_RULES, auto_is_default=False), raw)
    values["_bf16_key"] = "bfloat16" if "bfloat16" in raw else "bf16"
    sequence_parallel = _sequence_parallel_size(values, world_size, sequence_parallel_size)
    tbs, micro, gas = _batch_sizes(values.get(_TBS), values.get(_MICRO), values.get(_GAS),
                                   world_size // sequence_parallel)
    timers = values.get("_timers", {})
    _check_nvme_settings(values)
    return Zero3Config(
        train_batch_size=tbs,
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=gas,
        gradient_clipping=values.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT),
        zero=values.get("zero", ZeroConfig()),
        precision=_precision(values),
        optimizer=values.get("optimizer"),
        scheduler=values.get("scheduler"),
        steps_per_print=values.get("steps_per_print"),
        wall_clock_breakdown=values.get("wall_clock_breakdown", False),
        zero_allow_untested_optimizer=values.get("zero_allow_untested_optimizer", False),
        prescale_gradients=values.get("prescale_gradients", False),
        gradient_predivide_factor=values.get("gradient_predivide_factor", 1.0),
        world_size=world_size,
        memory_breakdown=values.get("memory_breakdown", False),
        dump_state=values.get("dump_state", False),
        disable_python_gc=values.get("disable_python_gc", False),
        dataloader_drop_last=values.get("dataloader_drop_last", False),
        log_level=values.get("log_level"),
        vocabulary_size=values.get("vocabulary_size"),
        checkpoint_tag_validation=values.get("_checkpoint", {}).get("tag_validation", "WARN"),
        checkpoint_arrival_timeout=values.get("_checkpoint", {}).get("arrival_timeout", 60.0),
        checkpoint_async_save=values.get("_checkpoint", {}).get("async_save", False),
        placement=PlacementConfig(**values.get("_placement", {})),
        checkpoint_load_rng_state=values.get("_checkpoint", {}).get("load_rng_state", False),
        throughput_timer_enabled=timers.get("throughput_timer_enabled", True),
        throughput_timer_synchronized=timers.get("throughput_timer_synchronized", True),
        activation_checkpointing=values.get("activation_checkpointing", ActivationCheckpointingConfig()),
        raw=copy.deepcopy(raw),
        aio=values.get("aio", AioConfig()),
        sequence_parallel_size=sequence_parallel,
        seq_parallel_communication_data_type=values.get("seq_parallel_communication_data_type", torch.float32),
        long_sequence=LongSequenceConfig(**values.get("_long_sequence", {})),
        comms_logger=values.get("_comms_logger", CommsLoggerConfig()),
        flops_profiler=values.get("_flops_profiler", FlopsProfilerConfig()),
        monitor=MonitorConfig(values.get("_tensorboard", FileMonitorConfig()), values.get("_csv_monitor", FileMonitorConfig()),
                              values.get("_wandb", WandbConfig()), values.get("_comet", CometConfig())),
    )


# --------------------------------------------------------------------------------------
# Documentation
# --------------------------------------------------------------------------------------

# (heading, rules, where mapped fields land in Zero3Config)
_DOC_SECTIONS: tuple[tuple[str, Mapping[str, _Rule], str], ...] = (
    ("top level", _TOP_RULES, ""),
    ("zero_optimization", _ZERO_RULES, "zero."),
    ("zero_optimization.offload_param", _OFFLOAD_PARAM_RULES, "zero.offload_param."),
    ("zero_optimization.offload_optimizer", _OFFLOAD_OPTIMIZER_RULES, "zero.offload_optimizer."),
    ("zero_optimization.leaf_module", _LEAF_RULES, "zero.leaf_module."),
    ("bf16 / bfloat16", _BF16_RULES, "precision."),
    ("fp16", _FP16_RULES, "precision."),
    ("torch_autocast", _AUTOCAST_RULES, "precision."),
    ("data_types", _DATA_TYPES_RULES, ""),
    ("checkpoint", _CHECKPOINT_RULES, ""),
    ("activation_checkpointing", _ACTIVATION_CHECKPOINTING_RULES, "activation_checkpointing."),
    ("placement", _PLACEMENT_RULES, "placement."),
    ("long_sequence", _LONG_SEQUENCE_RULES, "long_sequence."),
    ("aio", _AIO_RULES, "aio."),
    ("tensorboard / csv_monitor", _FILE_MONITOR_RULES, "monitor.tensorboard."),
    ("wandb", _WANDB_RULES, "monitor.wandb."),
    ("comet", _COMET_RULES, "monitor.comet."),
    ("comms_logger", _COMMS_LOGGER_RULES, "comms_logger."),
    ("flops_profiler", _FLOPS_PROFILER_RULES, "flops_profiler."),
    ("timers", _TIMERS_RULES, ""),
    ("timers.throughput", _THROUGHPUT_RULES, ""),
    ("optimizer", _OPTIMIZER_HEADER, "optimizer."),
    ("scheduler", _SCHEDULER_HEADER, "scheduler."),
)

# Where the sections that are folded into other fields end up.
_DOC_FIELDS = {
    "_bf16": "precision", "_fp16": "precision", "_comm_dtype": "precision.communication_data_type",
    "_data_types": "checked against precision.dtype", "_timers": "throughput_timer_*",
    "_checkpoint": "checkpoint_tag_validation", "enabled": "precision.dtype",
    "check_grad_overflow": "precision.check_grad_overflow", "param_dtype": "checked against precision.dtype",
    "tag_validation": "checkpoint_tag_validation", "arrival_timeout": "checkpoint_arrival_timeout",
    "async_save": "checkpoint_async_save", "_placement": "placement", "_long_sequence": "long_sequence", "_tensorboard": "monitor.tensorboard", "_csv_monitor": "monitor.csv_monitor", "_wandb": "monitor.wandb", "_comet": "monitor.comet", "_comms_logger": "comms_logger", "_flops_profiler": "flops_profiler", "load_rng_state": "checkpoint_load_rng_state",
    "throughput": "throughput_timer_*",
    "_torch_autocast": "precision.autocast_*", "bf16_master_weights_and_grads": "precision.master_dtype",
    "bf16_optimizer_states": "precision.optimizer_state_dtype", "autocast_enabled": "precision.autocast_dtype",
    "autocast_dtype": "precision.autocast_dtype", "lower_precision_safe_modules": "precision.autocast_safe_modules",
}


_PRECISION_DOC_FIELDS = ("bf16_master_weights_and_grads", "bf16_optimizer_states", "autocast_enabled",
                         "autocast_dtype", "lower_precision_safe_modules")


def describe_keys() -> list[tuple[str, str, str, str]]:
    """Every known key as (section, key, rule, explanation), for docs/config.md."""
    rows = []
    for section, rules, prefix in _DOC_SECTIONS:
        for key, rule in rules.items():
            if isinstance(rule, _Map):
                where = _DOC_FIELDS.get(rule.field) if rule.field.startswith("_") or not prefix \
                    or rule.field in ("enabled", "check_grad_overflow", *_PRECISION_DOC_FIELDS) else None
                if prefix.startswith(("monitor.", "comms_logger.", "flops_profiler.")):
                    where = None
                where = where or prefix + rule.field
                shown = where if " " in where else f"`{where}`"
                rows.append((section, key, "mapped", f"{shown}: {rule.doc}"))
            elif isinstance(rule, _Only):
                other = "" if rule.shown == "true or false" else f" Other values: {rule.fix}"
                rows.append((section, key, "accepted: " + rule.shown, f"{rule.why}.{other}"))
            elif isinstance(rule, _Inert):
                when = " unless DeepSpeed's default" if rule.quiet is not None else ""
                rows.append((section, key, f"accepted, no effect (a warning{when})", f"{rule.why}."))
            else:
                rows.append((section, key, "refused", f"{rule.why}. {rule.fix}"))
    return rows
