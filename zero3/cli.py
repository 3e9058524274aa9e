"""The `zero3` command: inspect, verify and export checkpoints, offline, in one process.

    zero3 checkpoint inspect DIR [--json]
    zero3 checkpoint verify  DIR [--tag T | --all]
    zero3 checkpoint export  DIR OUT.safetensors [--tag T] [--dtype fp32|bf16|fp16]
    zero3 checkpoint import-deepspeed SRC DST [--tag T]
    zero3 checkpoint export-deepspeed SRC DST --world-size N [--sub-group-size S] [--optimizer O] [--tag T]
    zero3 estimate (--params N [--trainable N] | --model-config config.json) --world-size W
                   [--config ds_config.json] [--dtype ...] [--offload-param] [--offload-optimizer]
                   [--persistence-threshold N] [--optimizer adamw|sgd|sgd-momentum] [--json]
                   [--gpu-budget BYTES | --gpu-memory BYTES] [--activation-reserve BYTES] [--ratio R]

DIR is a save_dir (holding tags and `latest`) or one tag folder. Without --tag, verify
and export take the checkpoint a tag-less `engine.load_checkpoint(DIR)` would load.
Nothing here starts torch.distributed; everything is read from the files. `inspect`
also recognizes a DeepSpeed ZeRO-3 checkpoint (checkpoint/deepspeed/layout.py) and says what it holds;
`import-deepspeed` rewrites one as a zero3 checkpoint (checkpoint/deepspeed/importer.py);
`export-deepspeed` writes a zero3 checkpoint in DeepSpeed's ZeRO-3 layout for N ranks
(checkpoint/deepspeed/exporter.py), which DeepSpeed's `load_checkpoint` resumes; given a
Hugging Face Trainer `checkpoint-N` folder, DST becomes one too (the Trainer's files copied
beside DeepSpeed's), which the Trainer with `deepspeed=` resumes.

Exit status: 0 when all is well, 1 when a problem was found (each printed with the file
it concerns), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from zero3.checkpoint import format as ckpt
from zero3.checkpoint.deepspeed.layout import DeepSpeedCheckpoint, is_deepspeed_checkpoint
from zero3.checkpoint.deepspeed.unpickle import DeepSpeedCheckpointError
from zero3.checkpoint.paths import checked_tag



def _human(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _is_tag_folder(path: Path) -> bool:
    return ckpt.looks_like_checkpoint(path) and not (path / ckpt.LATEST).exists()


def _target(directory: Path, tag: str | None) -> tuple[Path, list[str]]:
    """The tag folder to act on, and problems met while choosing it (printed, exit 1)."""
    if is_deepspeed_checkpoint(directory, tag):
        raise ckpt.CheckpointError(
            f"{directory} is a DeepSpeed ZeRO-3 checkpoint: `zero3 checkpoint inspect` checks it, "
            f"`zero3 checkpoint import-deepspeed {directory} DST` converts it; verify or export DST")
    if tag is not None:
        folder = directory / checked_tag(tag, "--tag")
        if not folder.is_dir():
            raise ckpt.CheckpointError(f"{folder}: no such checkpoint tag")
        return folder, []
    if _is_tag_folder(directory):
        return directory, []
    resolved, warning = ckpt.resolve_tag(directory, None)
    if resolved is None:
        raise ckpt.CheckpointError(f"{directory}: no '{ckpt.LATEST}' file; pass --tag (or see `inspect`)")
    return directory / resolved, [warning.removeprefix("zero3: ")] if warning else []


# --------------------------------------------------------------------- inspect
def _tag_row(info: ckpt.TagInfo) -> dict:
    row = {"tag": info.tag, "complete": info.complete, "files": info.files, "size_bytes": info.size_bytes}
    if info.manifest is not None:
        m = info.manifest
        row.update({
            "global_steps": m["global_steps"], "micro_steps": m.get("micro_steps"),
            "world_size": m["world_size"], "params": len(m["params"]),
            "elements": sum(p["numel"] for p in m["params"].values()),
            "compute_dtype": m.get("compute_dtype"), "zero3_version": m.get("zero3_version"),
            "torch_version": m.get("torch_version"),
            "saved": datetime.datetime.fromtimestamp(m["created_unix"]).isoformat(timespec="seconds"),
        })
    elif not (info.folder / ckpt.MANIFEST).exists():
        partial = sorted(p.name for p in info.folder.iterdir() if p.name.endswith(".tmp"))
        row["problem"] = f"no {ckpt.MANIFEST}: the save did not finish" + (
            f"; half-written: {', '.join(partial)}" if partial else "")
    else:
        row["problem"] = info.problem
    return row


def inspect(directory: Path, as_json: bool) -> int:
    if is_deepspeed_checkpoint(directory):
        return inspect_deepspeed(directory, as_json)
    if _is_tag_folder(directory):
        infos, latest = [ckpt.tag_info(directory)], None
    else:
        infos, latest = ckpt.list_tags(directory), ckpt.read_latest(directory)
    rows = [_tag_row(i) for i in infos]
    status = _inspect_status(directory, rows, latest)
    if as_json:
        print(json.dumps({"directory": str(directory), "latest": latest, "tags": rows}, indent=1))
        return status
    print(f"checkpoint directory {directory}")
    if not _is_tag_folder(directory):
        named = next((r for r in rows if r["tag"] == latest), None)
        note = "" if latest is None or (named and named["complete"]) else "  (NOT a complete checkpoint)"
        print(f"latest: {latest if latest is not None else '(no latest file)'}{note}")
    if not rows:
        print("no checkpoint folders")
        return status
    print(f"{'TAG':<24} {'COMPLETE':<9} {'STEP':>7} {'WORLD':>5} {'PARAMS':>7} {'FILES':>5} {'SIZE':>10}  SAVED")
    for r in rows:
        if r["complete"]:
            print(f"{r['tag']:<24} {'yes':<9} {r['global_steps']:>7} {r['world_size']:>5} {r['params']:>7} "
                  f"{r['files']:>5} {_human(r['size_bytes']):>10}  {r['saved']} ({r['compute_dtype']}, "
                  f"zero3 {r['zero3_version']}, torch {r['torch_version']})")
        else:
            print(f"{r['tag']:<24} {'NO':<9} {'-':>7} {'-':>5} {'-':>7} {r['files']:>5} "
                  f"{_human(r['size_bytes']):>10}  incomplete: {r['problem']}")
    return status


def _inspect_status(directory: Path, rows: list[dict], latest: str | None) -> int:
    """1 when what would be loaded is not a complete checkpoint: the tag folder inspected
    is incomplete, or `latest` names a tag that is missing or incomplete; else 0."""
    if _is_tag_folder(directory):
        return 0 if all(r["complete"] for r in rows) else 1
    if latest is None:
        return 0
    named = next((r for r in rows if r["tag"] == latest), None)
    return 0 if named is not None and named["complete"] else 1


def inspect_deepspeed(directory: Path, as_json: bool) -> int:
    """What a DeepSpeed ZeRO-3 checkpoint holds (validated: every rank file, element counts)."""
    with DeepSpeedCheckpoint.open(directory) as source:
        info = source.describe()
    if as_json:
        print(json.dumps({"directory": str(directory), "deepspeed": info}, indent=1))
        return 0
    print(f"DeepSpeed ZeRO-3 checkpoint {directory}: tag {info['tag']}, DeepSpeed {info['ds_version']}")
    print(f"  saved on {info['world_size']} ranks, {info['compute_dtype']}, global step {info['global_steps']} "
          f"({info['global_samples']} samples, {info['skipped_steps']} skipped)")
    frozen = "saved" if info["frozen_saved"] else "left out (exclude_frozen_parameters)"
    print(f"  {info['params']} parameters, {info['elements']:,} elements; {info['trainable']} trainable "
          f"({info['trainable_elements']:,} elements) in {info['sub_groups']} sub-groups and "
          f"{info['param_groups']} param groups; frozen parameters {frozen}; {info['buffers']} buffers")
    print(f"  optimizer state: {', '.join(info['optimizer_state']) or 'none (never stepped)'}; lr scheduler: "
          f"{info['lr_scheduler'] or 'none'}; loss scale: {info['loss_scale'] if info['loss_scale'] else 'none'}")
    print(f"  client_state keys: {', '.join(info['client_state_keys']) or 'none'}")
    print(f"  resume it with engine.load_checkpoint({str(directory)!r}) on any number of ranks, or convert it: "
          f"zero3 checkpoint import-deepspeed {directory} DST")
    return 0


def import_deepspeed(src: Path, dst: Path, tag: str | None) -> int:
    from zero3.checkpoint.deepspeed.importer import import_deepspeed as run_import

    summary = run_import(src, dst, tag)
    print(f"wrote {summary['folder']}: {summary['params']} parameters, {_human(summary['bytes'])}, global step "
          f"{summary['global_steps']} (saved by DeepSpeed on {summary['source_world_size']} ranks; loads on any "
          f"number); {dst / ckpt.LATEST} -> {summary['tag']}")
    return 0


def export_deepspeed(src: Path, dst: Path, world_size: int, sub_group_size: int | None, tag: str | None,
                     optimizer: str | None = None) -> int:
    from zero3.checkpoint.deepspeed.exporter import export_deepspeed as run_export

    summary = run_export(src, dst, world_size, sub_group_size, tag, optimizer)
    print(f"wrote {summary['folder']}: DeepSpeed ZeRO-3 layout for {summary['world_size']} ranks, "
          f"{summary['sub_groups']} sub-groups, {len(summary['files'])} files, {_human(summary['bytes'])}, global "
          f"step {summary['global_steps']}; {dst / ckpt.LATEST} -> {summary['tag']}. Load it with DeepSpeed on "
          f"{summary['world_size']} ranks with zero_optimization.sub_group_size {summary['sub_group_size']} "
          f"({summary['sub_group_size_from']}); param groups and steps written for DeepSpeed's "
          f"{summary['optimizer']} optimizer ({summary['optimizer_from']}; --optimizer fused|cpu-adam|torch "
          "overrides)")
    if summary["trainer_files"]:
        print(f"a Trainer checkpoint: copied {', '.join(summary['trainer_files'])} into {dst}; resume it with "
              f"Trainer(args=TrainingArguments(..., deepspeed=ds_config)).train(resume_from_checkpoint={str(dst)!r})")
    if summary["trainer_note"]:
        print(f"note: {summary['trainer_note']}")
    return 0


# ---------------------------------------------------------------------- verify
def verify(directory: Path, tag: str | None, every: bool) -> int:
    problems: list[str] = []
    if every:
        folders = [directory] if _is_tag_folder(directory) else [i.folder for i in ckpt.list_tags(directory)]
        if not folders:
            problems.append(f"{directory}: no checkpoint folders")
    else:
        folder, problems = _target(directory, tag)
        folders = [folder]
    for problem in problems:
        print(f"PROBLEM {problem}")
    for folder in folders:
        found = ckpt.verify_checkpoint(folder)
        if found:
            print(f"FAILED  {folder}")
            for problem in found:
                print(f"  {problem}")
        else:
            manifest = ckpt.read_manifest(folder)
            print(f"OK      {folder} (global step {manifest['global_steps']}, world size {manifest['world_size']}, "
                  f"{len(manifest['files'])} files: sizes and sha256 match the manifest, pickled state loads safely)")
        problems += found
    if problems:
        print(f"zero3: {len(problems)} problem(s) found", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------- export
def export(directory: Path, out: Path, tag: str | None, dtype_name: str) -> int:
    from zero3.checkpoint.offline_export import EXPORT_DTYPES, export_checkpoint

    folder, problems = _target(directory, tag)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    summary = export_checkpoint(folder, out, EXPORT_DTYPES[dtype_name])
    manifest = ckpt.read_manifest(folder)
    note = ""
    if manifest.get("exclude_frozen_parameters"):
        note = " (frozen parameters were not saved: load with strict=False)"
    print(f"wrote {out}: {summary['tensors']} tensors, {_human(summary['bytes'])}, {dtype_name}, from {folder}{note}")
    return 0


# -------------------------------------------------------------------- estimate
def _estimate_config(args: argparse.Namespace) -> dict:
    """The DeepSpeed config to estimate for: --config, with the flags given on top."""
    config = json.loads(Path(args.config).read_text()) if args.config else {}
    if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu")):
        config["train_micro_batch_size_per_gpu"] = 1
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = 3
    if args.offload_param:
        zero["offload_param"] = {"device": "cpu"}
    if args.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    if args.persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = args.persistence_threshold
    if args.dtype:
        config.pop("bf16", None)
        config.pop("fp16", None)
        if args.dtype != "fp32":
            config[args.dtype] = {"enabled": True}
    if args.async_checkpoint:
        config.setdefault("checkpoint", {})["async_save"] = True
    if args.ratio is not None:
        zero.setdefault("offload_optimizer", {"device": "cpu"})["ratio"] = args.ratio
    if args.optimizer:
        momentum = 0.9 if args.optimizer == "sgd-momentum" else 0.0
        config["optimizer"] = ({"type": "AdamW", "params": {"lr": 1e-3}} if args.optimizer == "adamw"
                               else {"type": "SGD", "params": {"lr": 1e-3, "momentum": momentum}})
    return config


def estimate(args: argparse.Namespace) -> int:
    from zero3.estimate import estimate_memory, model_from_hf_config

    model = model_from_hf_config(args.model_config) if args.model_config else args.params
    result = estimate_memory(model, args.world_size, _estimate_config(args), trainable=args.trainable,
                             device_type=args.device)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return 0
    print(f"{result.parameters:,} parameters ({result.trainable:,} trainable, {result.resident:,} resident "
          f"on every rank), {str(result.dtype).replace('torch.', '')}, {result.world_size} ranks: per rank")
    print(f"  {'':18} {'device':>12} {'host':>12}")
    for name in result.by_category():
        print(f"  {name:18} {_human(result.device.get(name, 0)):>12} {_human(result.host.get(name, 0)):>12}")
    if result.checkpoint_snapshot:
        print(f"  {'checkpoint_snapshot':18} {'':>12} {_human(result.checkpoint_snapshot):>12}")
    print(f"  {'total':18} {_human(result.device_total):>12} {_human(result.host_total):>12}")
    if result.gathered_unit is None:
        print("  plus the fetch units gathered while they run (unknown for a bare count) and activations")
    else:
        print(f"  plus the largest fetch unit gathered while it runs ({_human(result.gathered_unit)}, "
              "twice with prefetch) and activations")
    if args.seq:
        _print_activations(args)
    zero = _estimate_config(args)["zero_optimization"]
    nvme = any((zero.get(key) or {}).get("device") == "nvme" for key in ("offload_param", "offload_optimizer"))
    if args.gpu_budget or args.gpu_memory or args.ratio is not None or nvme:
        _print_placement(args, model)
    return 0


def _print_activations(args: argparse.Namespace) -> None:
    """Activations at --seq tokens a sequence (placement/activations.py), with the config's
    long_sequence section and sequence_parallel_size."""
    from zero3.config import from_deepspeed
    from zero3.placement.activations import ModelShape, estimate_activations

    if not args.model_config:
        raise SystemExit("zero3 estimate --seq needs --model-config (the layer sizes set the activations)")
    from transformers import AutoConfig

    shape = ModelShape.of_hf_config(AutoConfig.from_pretrained(args.model_config))
    parsed = from_deepspeed(_estimate_config(args), world_size=args.world_size)
    section = parsed.long_sequence
    result = estimate_activations(
        shape, args.seq, parsed.train_micro_batch_size_per_gpu, torch_width(parsed.precision.dtype),
        parsed.sequence_parallel_size, checkpointing=not args.no_checkpointing, tiled_mlp=section.tiled_mlp,
        mlp_tiles=section.mlp_tiles, tiled_loss=section.tiled_loss,
        loss_tile_bytes=section.loss_tile_bytes or (1 << 30), offload_hidden_states=section.offload_hidden_states)
    kept = "host" if section.offload_hidden_states else "device"
    print(f"  activations at seq {args.seq:,} ({result.tokens:,} tokens a rank): device {_human(result.device)} "
          f"(layer inputs {_human(result.kept_inputs)} on the {kept}, one layer's backward "
          f"{_human(result.layer_working)}, loss {_human(result.loss)}), host {_human(result.host)}")


def torch_width(dtype) -> int:
    import torch

    return torch.empty(0, dtype=dtype).element_size()


def _print_placement(args: argparse.Namespace, model) -> None:
    """The placement the engine would make (estimate.estimate_placement) and its peak."""
    from zero3.config import bytes_or_auto
    from zero3.estimate import estimate_placement
    from zero3.placement.budget import margin

    reserve = bytes_or_auto("--activation-reserve", args.activation_reserve) or 0
    budget = bytes_or_auto("--gpu-budget", args.gpu_budget) if args.gpu_budget else None
    if args.gpu_memory:
        capacity = bytes_or_auto("--gpu-memory", args.gpu_memory)
        budget = max(capacity - reserve - margin(capacity), 0)
    found = estimate_placement(model, args.world_size, _estimate_config(args), budget, reserve, args.trainable)
    print(found.plan.describe())
    for unit in found.plan.units:
        print(f"  {unit.name:40} shards: {unit.params.value:6}  optimizer: {unit.state.value}")
    print(f"predicted device peak: {_human(found.predicted_peak)} (engine {_human(found.plan.device_bytes)} "
          f"+ activations {_human(reserve)})")


# ------------------------------------------------------------------------ main
def _estimate_parser(commands) -> None:
    """`zero3 estimate`'s arguments."""
    p = commands.add_parser("estimate", help="per-rank memory of a model for a world size and config")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=int, help="a parameter count")
    source.add_argument("--model-config", help="a Hugging Face config.json (or its folder); needs zero3[hf]")
    p.add_argument("--trainable", type=int, help="with --params: how many train (default: all)")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--config", help="a DeepSpeed config JSON; the flags below override it")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], help="compute dtype (default: the config's)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="the accelerator (default: cuda)")
    p.add_argument("--offload-param", action="store_true", help="offload_param to cpu")
    p.add_argument("--offload-optimizer", action="store_true", help="offload_optimizer to cpu")
    p.add_argument("--persistence-threshold", type=int, help="stage3_param_persistence_threshold")
    p.add_argument("--async-checkpoint", action="store_true",
                   help="checkpoint.async_save: count the host buffer of asynchronous saves")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "sgd-momentum"], help="default: the config's, else AdamW")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--gpu-budget", help='placement.gpu_budget: bytes the engine\'s tensors may hold on the GPU '
                   '("40GiB"); prints the placement and the predicted peak')
    p.add_argument("--gpu-memory", help="instead of --gpu-budget: the card's memory (\"80GB\"); the budget is it "
                   "less --activation-reserve and the engine's margin, as the engine's auto budget")
    p.add_argument("--activation-reserve", default="0", help="activations at your micro-batch (the engine logs "
                   "what it measured after its first window under an auto budget); added to the predicted peak")
    p.add_argument("--ratio", type=float, help="offload_optimizer.ratio (DeepSpeed's share of the optimizer "
                   "state on the host)")
    p.add_argument("--seq", type=int, help="with --model-config: the activations of one sequence of this many "
                   "tokens a micro-batch row, with the config's long_sequence section and sequence_parallel_size")
    p.add_argument("--no-checkpointing", action="store_true", help="with --seq: no activation checkpointing")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zero3", description="zero3 tools")
    commands = parser.add_subparsers(dest="command", required=True)
    checkpoint = commands.add_parser("checkpoint", help="inspect, verify and export checkpoints")
    actions = checkpoint.add_subparsers(dest="action", required=True)
    p = actions.add_parser("inspect", help="list tags: steps, world size, sizes, complete or not")
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = actions.add_parser("verify", help="check manifest, sizes and sha256 of every file")
    p.add_argument("dir", type=Path)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--tag", help="the tag to verify (default: what a tag-less load would pick)")
    group.add_argument("--all", action="store_true", help="verify every tag folder")
    p = actions.add_parser("export", help="write the consolidated weights as one safetensors file")
    p.add_argument("dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--tag", help="the tag to export (default: what a tag-less load would pick)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    p = actions.add_parser("import-deepspeed", help="rewrite a DeepSpeed ZeRO-3 checkpoint as a zero3 checkpoint")
    p.add_argument("dir", type=Path, help="the DeepSpeed save_dir (with latest) or tag folder")
    p.add_argument("dst", type=Path, help="the zero3 save_dir to write (its tag folder must not exist)")
    p.add_argument("--tag", help="the DeepSpeed tag to import (default: the one `latest` names)")
    p = actions.add_parser("export-deepspeed", help="write a zero3 checkpoint in DeepSpeed's ZeRO-3 layout")
    p.add_argument("dir", type=Path, help="the zero3 save_dir (with latest), tag folder or Trainer checkpoint-N")
    p.add_argument("dst", type=Path, help="the DeepSpeed save_dir (or Trainer checkpoint-N) to write; its tag "
                   "folder must not exist")
    p.add_argument("--world-size", type=int, required=True, help="data-parallel ranks DeepSpeed will load it on")
    p.add_argument("--sub-group-size", type=int,
                   help="the DeepSpeed run's zero_optimization.sub_group_size (default: the checkpoint's recorded "
                        "config's, else DeepSpeed's 1e9)")
    p.add_argument("--optimizer", choices=["fused", "cpu-adam", "torch"],
                   help="the optimizer the DeepSpeed run builds: FusedAdam (config Adam/AdamW), DeepSpeedCPUAdam "
                        "(the same under offload_optimizer) or a torch optimizer (client, or torch_adam); default: "
                        "what the checkpoint's recorded config builds, else torch")
    p.add_argument("--tag", help="the zero3 tag to export (default: what a tag-less load would pick)")
    _estimate_parser(commands)
    commands.add_parser("launch", add_help=False,
                        help="accelerate launch for an Accelerate DeepSpeed yaml, DeepSpeed not installed "
                             "(zero3 launch --config_file ds.yaml train.py; needs the hf extra)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # Accelerate's launcher flags, parsed by Accelerate (the hf extra)
        from zero3.hf.launch import main as launch

        return launch(argv[1:])
    args = _parser().parse_args(argv)
    if args.command == "estimate":
        try:
            return estimate(args)
        except (ValueError, OSError, ImportError) as exc:  # ConfigError is a ValueError
            print(f"zero3 estimate: {exc}", file=sys.stderr)
            return 2
    if not args.dir.exists():
        print(f"zero3: {args.dir}: no such directory", file=sys.stderr)
        return 1
    try:
        if args.action == "inspect":
            return inspect(args.dir, args.json)
        if args.action == "verify":
            return verify(args.dir, args.tag, args.all)
        if args.action == "import-deepspeed":
            return import_deepspeed(args.dir, args.dst, args.tag)
        if args.action == "export-deepspeed":
            return export_deepspeed(args.dir, args.dst, args.world_size, args.sub_group_size, args.tag,
                                    args.optimizer)
        return export(args.dir, args.out, args.tag, args.dtype)
    except (ckpt.CheckpointError, DeepSpeedCheckpointError) as exc:
        print(f"zero3: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
