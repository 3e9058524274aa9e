"""What `engine.offload_states()` frees and costs, and what `cpu_checkpointing` saves (issue 37,
points 7 and 9), on one GPU at world size 1.

Part `offload` (point 7). A Llama (random weights from a LlamaConfig, built on the device)
trains with zero3 and the config's AdamW; after `--warmup` steps:
- the device memory (allocated / reserved) before `offload_states()`, after it, after it and
  `torch.cuda.empty_cache()` (what a generation phase could use), and after `reload_states()`;
- the time of each offload and reload (device synchronized), the bytes moved, for
  `--rounds` round trips with pinned host memory and non-blocking copies (as OpenRLHF and
  verl call it) and `--rounds` with the defaults of DeepSpeed's signature (pinned, blocking);
- exactness: every moved tensor equal after the round trips to a host snapshot taken
  before, the loss of a fixed batch (no grad) equal before and after, and the loss after one
  training step taken after the round trips equal to the one a second engine, built and
  trained the same way without any round trip, gives (`torch.use_deterministic_algorithms`
  on for this part; the warmup losses of both engines are compared too, which tells whether
  the steps themselves were deterministic).

Part `ckpt` (point 9). The same model, each decoder layer run through
`deepspeed.checkpointing.checkpoint` (zero3.checkpointing) or not; three modes, each
`--warmup` steps then `--steps` measured steps on one engine: `none` (no activation
checkpointing), `checkpoint` (each layer checkpointed, the config's
`activation_checkpointing` section without cpu_checkpointing), `cpu_checkpointing` (the
same with `cpu_checkpointing: true`: the saved layer inputs go to pinned host memory on a
side stream). Per mode: the peak device memory of the measured steps (allocated and
reserved), the median step time, the losses.

    # the GPU run (about 3 minutes on one H100):
    torchrun --standalone --nproc_per_node=1 bench/state_offload_bench.py --device cuda --dtype bf16 \\
        --width 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048 --micro-batch 2
    # every code path on the CPU with a small model (memory figures are n/a there):
    python bench/state_offload_bench.py --device cpu

Rank 0 prints one line per measurement and, last, `RESULT <json>` with everything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the exactness check
HERE = os.path.dirname(os.path.abspath(__file__))
if os.path.dirname(HERE) not in sys.path:
    sys.path.insert(0, os.path.dirname(HERE))  # this checkout's zero3
GIB = 2 ** 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="bf16")
    p.add_argument("--width", type=int, default=None, help="default: 2048 on cuda, 64 on cpu")
    p.add_argument("--layers", type=int, default=None, help="default: 16 on cuda, 2 on cpu")
    p.add_argument("--intermediate", type=int, default=None, help="default: 5632 on cuda, 160 on cpu")
    p.add_argument("--heads", type=int, default=None, help="default: 16 on cuda, 4 on cpu")
    p.add_argument("--vocab", type=int, default=None, help="default: 32000 on cuda, 256 on cpu")
    p.add_argument("--seq", type=int, default=None, help="default: 2048 on cuda, 32 on cpu")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="steps before each measurement")
    p.add_argument("--steps", type=int, default=4, help="ckpt: measured steps per mode")
    p.add_argument("--rounds", type=int, default=2, help="offload: round trips per variant")
    p.add_argument("--parts", default="offload,ckpt")
    options = p.parse_args(argv)
    big = options.device == "cuda"
    for name, gpu, cpu in (("width", 2048, 64), ("layers", 16, 2), ("intermediate", 5632, 160),
                           ("heads", 16, 4), ("vocab", 32000, 256), ("seq", 2048, 32)):
        if getattr(options, name) is None:
            setattr(options, name, gpu if big else cpu)
    return options


# ------------------------------------------------------------------ setup
def init_process_group(options: argparse.Namespace) -> None:
    """torchrun's group, or a one-process one (gloo on the CPU, nccl on a GPU)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29517")})
    if options.device == "cpu":
        os.environ["ZERO3_ACCELERATOR"] = "cpu"
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")


def ds_config(options: argparse.Namespace, cpu_checkpointing: bool = False) -> dict:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": options.micro_batch, "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0, "zero_optimization": {"stage": 3},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
        "activation_checkpointing": {"cpu_checkpointing": cpu_checkpointing},
    }
    if options.dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def build_model(options: argparse.Namespace) -> torch.nn.Module:
    """A Llama built on the device from seed 0 (the same every time), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=options.vocab, hidden_size=options.width, num_hidden_layers=options.layers,
                         intermediate_size=options.intermediate, num_attention_heads=options.heads,
                         num_key_value_heads=options.heads, max_position_embeddings=options.seq,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    with torch.device(options.device):
        return LlamaForCausalLM(config)


def build_engine(options: argparse.Namespace, model: torch.nn.Module | None = None):
    """A fresh engine (the config's AdamW) on `model`, or on a new build_model()."""
    import zero3

    engine, *_ = zero3.initialize(model=model if model is not None else build_model(options),
                                  config=ds_config(options))
    return engine


def batch(options: argparse.Namespace, index: int) -> torch.Tensor:
    """Token ids of micro-batch `index` (the same for every engine)."""
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randint(0, options.vocab, (options.micro_batch, options.seq), generator=g).to(options.device)


def train_step(engine, ids: torch.Tensor) -> float:
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def eval_loss(engine, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return engine(input_ids=ids, labels=ids).loss.item()


def sync(options: argparse.Namespace) -> None:
    if options.device == "cuda":
        torch.cuda.synchronize()


def memory(options: argparse.Namespace) -> dict[str, float] | str:
    """Device memory now, GiB (n/a on the CPU)."""
    if options.device != "cuda":
        return "n/a"
    sync(options)
    return {"allocated": round(torch.cuda.memory_allocated() / GIB, 3),
            "reserved": round(torch.cuda.memory_reserved() / GIB, 3)}


def report(line: str) -> None:
    print(line, flush=True)


# ------------------------------------------------- part offload (point 7)
VARIANTS = (("pin_memory=True non_blocking=True", {"pin_memory": True, "non_blocking": True}),
            ("pin_memory=True (DeepSpeed's default)", {"pin_memory": True}),
            ("pin_memory=False", {"pin_memory": False}))


def state_tensors(engine) -> list[torch.Tensor]:
    """Every tensor of the state kinds offload_states() moves (engine_parts/state_offload.py),
    each once; the engine keeps owning them."""
    from zero3.engine_parts.state_offload import KINDS

    seen: set[int] = set()
    found = []
    for kind in KINDS:
        for tensor in engine.state_offload._tensors_of(kind):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found.append(tensor)
    return found


def round_trip(engine, options: argparse.Namespace, variant: str, kwargs: dict) -> dict:
    """One offload_states() / reload_states() with memory and times around it."""
    out: dict[str, Any] = {"variant": variant}
    sync(options)
    start = time.perf_counter()
    engine.offload_states(**kwargs)
    sync(options)
    out["offload_s"] = round(time.perf_counter() - start, 4)
    out["moved_gib"] = round(sum(t.numel() * t.element_size() for t, _ in engine.state_offload._moved) / GIB, 3)
    out["after_offload"] = memory(options)
    if options.device == "cuda":
        torch.cuda.empty_cache()
    out["after_offload_and_empty_cache"] = memory(options)
    start = time.perf_counter()
    engine.reload_states(non_blocking=kwargs.get("non_blocking", False))
    sync(options)
    out["reload_s"] = round(time.perf_counter() - start, 4)
    out["after_reload"] = memory(options)
    report(f"offload [{variant}]: {out['moved_gib']} GiB moved, offload {out['offload_s']} s, reload "
           f"{out['reload_s']} s; memory after offload {out['after_offload']}, after empty_cache "
           f"{out['after_offload_and_empty_cache']}, after reload {out['after_reload']}")
    return out


def trained(options: argparse.Namespace):
    """A fresh engine after the warmup steps, and their losses."""
    engine = build_engine(options)
    losses = [train_step(engine, batch(options, i)) for i in range(options.warmup)]
    return engine, losses


def after_one_more_step(engine, options: argparse.Namespace) -> tuple[float, float]:
    """The loss of the next training step, and the loss of the probe batch after it."""
    step_loss = train_step(engine, batch(options, options.warmup))
    return step_loss, eval_loss(engine, batch(options, 10_000))


def part_offload(options: argparse.Namespace) -> dict:
    torch.use_deterministic_algorithms(True, warn_only=True)
    engine, warmup = trained(options)
    probe = batch(options, 10_000)
    out: dict[str, Any] = {"loss_before": eval_loss(engine, probe)}
    tensors = state_tensors(engine)
    snapshot = [t.detach().to("cpu", copy=True) for t in tensors]
    out["state_gib"] = round(sum(t.numel() * t.element_size() for t in tensors) / GIB, 3)
    out["sharded_bytes"] = engine.sharded_bytes()
    out["before"] = memory(options)
    report(f"offload: state {out['state_gib']} GiB in {len(tensors)} tensors; memory before {out['before']}")
    out["rounds"] = [round_trip(engine, options, name, kwargs) for name, kwargs in VARIANTS
                     for _ in range(options.rounds)]
    out["tensors_equal_after"] = f"{sum(torch.equal(t.detach().cpu(), s) for t, s in zip(tensors, snapshot))} " \
                                 f"of {len(tensors)}"
    del snapshot
    out["loss_after"] = eval_loss(engine, probe)
    out["step_after_round_trips"] = after_one_more_step(engine, options)
    engine.destroy()
    del engine, tensors
    free_device(options)
    reference, reference_warmup = trained(options)
    out["step_without_round_trip"] = after_one_more_step(reference, options)
    out["warmup_losses_equal"] = warmup == reference_warmup
    out["warmup_losses"] = [warmup, reference_warmup]
    reference.destroy()
    del reference
    free_device(options)
    torch.use_deterministic_algorithms(False)
    report(f"offload: tensors equal after the round trips {out['tensors_equal_after']}; probe loss before/after "
           f"{out['loss_before']} / {out['loss_after']}; step and probe after the round trips "
           f"{out['step_after_round_trips']}, without {out['step_without_round_trip']} (warmup losses of the two "
           f"engines equal: {out['warmup_losses_equal']})")
    return out


def free_device(options: argparse.Namespace) -> None:
    import gc

    gc.collect()
    if options.device == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------- part ckpt (point 9)
class _Switch:
    """Whether the wrapped decoder layers run through deepspeed.checkpointing.checkpoint."""

    enabled = False


class CheckpointedLayer(torch.nn.Module):
    """A decoder layer that Megatron-style code runs through `deepspeed.checkpointing.checkpoint`
    (the layer itself is called inside, so its hooks run in the forward and the recomputation);
    only the hidden states are checkpoint inputs, the rest (position embeddings, mask) are
    captured as they are."""

    def __init__(self, layer: torch.nn.Module, switch: _Switch) -> None:
        super().__init__()
        self.layer = layer
        self.switch = switch

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from zero3 import checkpointing

        if not self.switch.enabled or not torch.is_grad_enabled():
            return self.layer(hidden_states, *args, **kwargs)
        return checkpointing.checkpoint(lambda h: self.layer(h, *args, **kwargs), hidden_states)


def build_checkpointable_engine(options: argparse.Namespace):
    """An engine on build_model()'s Llama, its decoder layers wrapped (before initialize) in
    CheckpointedLayer; and the switch that turns their checkpointing on."""
    model = build_model(options)
    switch = _Switch()
    model.model.layers = torch.nn.ModuleList(CheckpointedLayer(layer, switch) for layer in model.model.layers)
    return build_engine(options, model), switch


def run_mode(engine, switch: _Switch, options: argparse.Namespace, name: str, checkpoint: bool,
             cpu: bool) -> dict:
    """`--warmup` then `--steps` measured steps with the mode's settings: peak memory, times."""
    from zero3 import checkpointing
    from zero3.checkpointing import offload

    switch.enabled = checkpoint
    checkpointing.configure(None, deepspeed_config=ds_config(options, cpu_checkpointing=cpu))
    for i in range(options.warmup):
        train_step(engine, batch(options, i))
    free_device(options)
    if options.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    offload.reset_counts()
    times, losses = [], []
    for i in range(options.steps):
        sync(options)
        start = time.perf_counter()
        losses.append(train_step(engine, batch(options, options.warmup + i)))
        sync(options)
        times.append(time.perf_counter() - start)
    out = {"mode": name, "median_step_s": round(statistics.median(times), 4), "step_s": [round(t, 4) for t in times],
           "losses": losses, "offloaded_tensors": offload.COUNTS.tensors,
           "offloaded_gib": round(offload.COUNTS.bytes / GIB, 3)}
    out["peak"] = "n/a" if options.device != "cuda" else {
        "allocated": round(torch.cuda.max_memory_allocated() / GIB, 3),
        "reserved": round(torch.cuda.max_memory_reserved() / GIB, 3)}
    report(f"ckpt [{name}]: median step {out['median_step_s']} s, peak {out['peak']}, offloaded "
           f"{out['offloaded_tensors']} tensors ({out['offloaded_gib']} GiB over {options.steps} steps)")
    return out


def part_ckpt(options: argparse.Namespace) -> dict:
    from zero3 import checkpointing

    engine, switch = build_checkpointable_engine(options)
    modes = [run_mode(engine, switch, options, name, checkpoint, cpu) for name, checkpoint, cpu in
             (("none", False, False), ("checkpoint", True, False), ("cpu_checkpointing", True, True))]
    checkpointing.reset()
    engine.destroy()
    free_device(options)
    return {"modes": modes}


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    init_process_group(options)
    import torch.distributed as dist

    result: dict[str, Any] = {"options": vars(options), "torch": torch.__version__,
                              "device_name": torch.cuda.get_device_name() if options.device == "cuda" else "cpu"}
    report(f"# {result['device_name']}, torch {torch.__version__}, {vars(options)}")
    parts = options.parts.split(",")
    if "offload" in parts:
        result["offload"] = part_offload(options)
    if "ckpt" in parts:
        result["ckpt"] = part_ckpt(options)
    if dist.get_rank() == 0:
        report("RESULT " + json.dumps(result, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
