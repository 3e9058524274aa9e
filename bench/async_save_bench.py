"""How long a checkpoint save stops training: synchronous against asynchronous saves.

A Llama (random weights, built from a LlamaConfig) trains with zero3 and AdamW; every
`--save-every` steps it saves a checkpoint, first with synchronous saves, then with
asynchronous ones (`save_checkpoint(..., async_save=True)`), each into a fresh folder.
Every save overwrites one tag (`rolling`), so the disk holds at most two copies of the
state (the committed one and the one being written); a mode's folder is removed at its end.
Per mode it reports:
- blocking: the wall time of each save_checkpoint call as a user meets it, from a barrier
  before the call to a barrier after it (the device synchronized, the slowest rank's time),
  the first save apart from the later ones. With `--async-buffer initialize` (the default)
  the config has checkpoint.async_save, so initialize allocates the host buffer of
  asynchronous saves; with `first-save` the first asynchronous save allocates it (and on a
  GPU pins it), as a script that only passes async_save=True without
  engine.prepare_async_checkpoint() has it;
- steps: the median step time of all steps that are not saves, and of the steps that ran
  while an asynchronous save was being written (the step right after a save);
- the snapshot: this rank's checkpoint bytes, the host copy bandwidth measured on 1 GiB
  (device to pinned host memory on a GPU, host to host on the CPU) with every rank copying
  at once, as they do in a save (the slowest rank's), and the copy time it predicts
  (bytes / bandwidth), the floor of an asynchronous save's blocking time.
Before training, rank 0 measures the write + fsync bandwidth of the checkpoint folder's
disk, so a slow disk is known before the first save.

`--save-every auto` keeps a fixed interval (`--auto-min` steps) for synchronous saves and
spaces the asynchronous ones so that each background write ends before the next save
begins (1.3x the synchronous save's time, in steps): a save that comes while the last
is still being written waits for it, which measures the disk, not the save. The interval
used is printed.

    # CPU, 2 gloo ranks (spawned), a small Llama:
    python bench/async_save_bench.py --ranks 2 --hidden 512 --layers 8 --vocab 8192 --seq 128
    # CPU, 2 gloo ranks, a 101M-parameter Llama (0.6 GB of state a rank with AdamW):
    python bench/async_save_bench.py --ranks 2 --hidden 1024 --layers 8 --vocab 8192 --seq 128 \
        --steps 12 --save-every auto --auto-min 3
    # one GPU, ~1B Llama full fine-tune in bf16, world size 1:
    torchrun --standalone --nproc_per_node=1 bench/async_save_bench.py --device cuda --dtype bf16 \\
        --hidden 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048 \\
        --micro-batch 2 --steps 12 --save-every auto --dir /tmp/async_save_bench
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--ranks", type=int, default=2, help="CPU: gloo processes to spawn (under torchrun: ignored)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=None, help="default: 2 x hidden")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=16,
                   help="measured steps per mode (after 2 warm-up steps) at --save-every's or --auto-min's interval")
    p.add_argument("--save-every", default="4", help="steps between saves, or auto (see above)")
    p.add_argument("--auto-min", type=int, default=4, help="auto: the synchronous interval and the least one")
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--async-buffer", choices=("initialize", "first-save"), default="initialize",
                   help="when the asynchronous saves' host buffer is allocated (see above)")
    p.add_argument("--dir", default="/tmp/zero3_async_save_bench", help="where the checkpoints go (emptied)")
    options = p.parse_args(argv)
    if options.save_every != "auto" and not options.save_every.isdigit():
        p.error(f"--save-every takes a number of steps or auto, got {options.save_every!r}")
    return options


def fixed_interval(options: argparse.Namespace) -> int:
    return options.auto_min if options.save_every == "auto" else int(options.save_every)


def build_engine(options: argparse.Namespace):
    import zero3
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=options.vocab, hidden_size=options.hidden, num_hidden_layers=options.layers,
                         intermediate_size=options.intermediate or 2 * options.hidden,
                         num_attention_heads=options.heads, num_key_value_heads=options.heads,
                         max_position_embeddings=options.seq, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(config)
    ds = {"train_micro_batch_size_per_gpu": options.micro_batch, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3}}
    if options.dtype == "bf16":
        ds["bf16"] = {"enabled": True}
    if options.async_buffer == "initialize":  # every save says async_save= itself: only the buffer changes
        ds["checkpoint"] = {"async_save": True}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=ds)
    return engine


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def all_ranks_here(device: str) -> None:
    """The device synchronized and every rank at this point (a barrier)."""
    import torch.distributed as dist

    synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def minor_faults() -> int:
    """Minor page faults of this process so far (every thread): first touches of new memory."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_save(engine, options: argparse.Namespace, folder: Path, mode: str) -> tuple[float, int]:
    """Seconds one save stops training as a user meets it: from every rank starting it
    together to every rank having returned from it (the slowest rank's time); and the
    minor page faults this rank took meanwhile (4 KiB each: a fresh buffer's first touch
    shows here whatever the machine's load)."""
    all_ranks_here(options.device)
    faults, start = minor_faults(), time.perf_counter()
    engine.save_checkpoint(str(folder), tag="rolling", async_save=(mode == "async"))
    all_ranks_here(options.device)
    return time.perf_counter() - start, minor_faults() - faults


def copy_bandwidth(device: str) -> float:
    """Bytes per second of one 1 GiB copy into host memory (pinned from a GPU), every rank
    copying at the same time (a barrier before each copy); this rank's best of 3."""
    import torch.distributed as dist

    nbytes = 1 << 30
    # Both written first: an untouched host allocation reads as the kernel's one zero page,
    # from the cache, and would overstate the bandwidth by a third.
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.ones(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        if dist.is_initialized():
            dist.barrier()
        start = time.perf_counter()
        target.copy_(source, non_blocking=device == "cuda")
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def disk_bandwidth(folder: Path, nbytes: int = 1 << 30) -> float:
    """Bytes per second of one write + fsync of `nbytes` into `folder` (the file is removed)."""
    folder.mkdir(parents=True, exist_ok=True)
    probe = folder / "disk_probe.bin"
    block = os.urandom(1 << 24)
    start = time.perf_counter()
    with open(probe, "wb") as f:
        for _ in range(nbytes // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    elapsed = time.perf_counter() - start
    probe.unlink()
    return nbytes / elapsed


def async_interval(options: argparse.Namespace, sync_result: dict) -> int:
    """Steps between asynchronous saves: `--save-every`, or for auto enough steps for a
    background write (about a synchronous save's time, 1.3x) to end before the next save.
    The same on every rank (the slowest rank's save)."""
    import torch.distributed as dist

    if options.save_every != "auto":
        return fixed_interval(options)
    save_s = statistics.median(sync_result["saves"][1:] or sync_result["saves"])
    step_s = statistics.median(sync_result["steps"])
    steps = max(options.auto_min, math.ceil(1.3 * save_s / step_s))
    if dist.is_initialized():
        wanted = [0] * dist.get_world_size()
        dist.all_gather_object(wanted, steps)
        steps = max(wanted)
    return steps


def run_mode(engine, options: argparse.Namespace, mode: str, rank: int, world: int, interval: int) -> dict:
    """Train 2 warm-up steps, then as many saves as `--steps` holds at the fixed interval, a
    save every `interval` steps, and one step after the last save."""
    import torch.distributed as dist

    folder = Path(options.dir) / mode
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
        print(f"# {mode}: a save every {interval} steps", flush=True)
    if dist.is_initialized():
        dist.barrier()
    generator = torch.Generator().manual_seed(100 + rank)
    held_before = engine.checkpointer.snapshot.held_bytes
    steps, saves, faults, overlapped = [], [], [], []
    writing = False
    n_saves = max(1, options.steps // fixed_interval(options))
    for step in range(2 + n_saves * interval + 1):
        tokens = torch.randint(0, options.vocab, (options.micro_batch, options.seq), generator=generator)
        tokens = tokens.to(engine.device)
        synchronize(options.device)
        start = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        synchronize(options.device)
        elapsed = time.perf_counter() - start
        if step >= 2:
            (overlapped if writing else steps).append(elapsed)
        writing = False
        if step >= 2 and (step - 1) % interval == 0:
            seconds, save_faults = timed_save(engine, options, folder, mode)
            saves.append(seconds)
            faults.append(save_faults)
            writing = mode == "async"
            if rank == 0:  # progress, so a run cut short still tells what it measured
                print(f"# {mode} save {len(saves)} at step {step}: blocked {saves[-1] * 1e3:.0f} ms "
                      f"({faults[-1]} page faults on rank 0); "
                      f"last step {elapsed * 1e3:.0f} ms", flush=True)
    start = time.perf_counter()
    engine.wait_for_checkpoint()
    final_wait = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # at most two copies of the state on disk at a time
    return {"mode": mode, "saves": saves, "faults": faults, "steps": steps, "overlapped": overlapped,
            "final_wait": final_wait,
            "snapshot_bytes": engine.checkpointer.snapshot.held_bytes, "held_before": held_before,
            "interval": interval}


def bench(rank: int, world: int, options: argparse.Namespace) -> None:
    import torch.distributed as dist

    start = time.perf_counter()
    engine = build_engine(options)
    if rank == 0:
        disk = disk_bandwidth(Path(options.dir))
        print(f"# engine built in {time.perf_counter() - start:.1f} s; write + fsync into {options.dir}: "
              f"{disk / 2**30:.2f} GiB/s (1 GiB)", flush=True)
    results = []
    for mode in options.modes.split(","):
        sync = next((r for r in results if r["mode"] == "sync"), None)
        interval = async_interval(options, sync) if mode == "async" and sync else fixed_interval(options)
        results.append(run_mode(engine, options, mode, rank, world, interval))
    bandwidth = copy_bandwidth(options.device)
    gathered, bandwidths = [results], [bandwidth]
    if dist.is_initialized():
        gathered, bandwidths = [None] * world, [0.0] * world
        dist.all_gather_object(gathered, results)
        dist.all_gather_object(bandwidths, bandwidth)
    bandwidth = min(bandwidths)
    if rank == 0:
        report(options, world, gathered, bandwidth, engine)
    engine.destroy()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def report(options, world: int, per_rank: list[list[dict]], bandwidth: float, engine) -> None:
    params = sum(sp.numel for sp in engine.table.values())
    intervals = ", ".join(f"{m['mode']} every {m['interval']}" for m in per_rank[0])
    print(f"Llama {params / 1e6:.1f}M parameters, {options.dtype}, AdamW, {world} rank(s) on {options.device}, "
          f"saves: {intervals} steps, into {options.dir}")
    snapshot = max(r[-1]["snapshot_bytes"] for r in per_rank) if any(
        m["mode"] == "async" for m in per_rank[0]) else 0
    print(f"host copy bandwidth (1 GiB, {'device->pinned' if options.device == 'cuda' else 'host->host'}, "
          f"every rank at once, slowest rank): {bandwidth / 2**30:.1f} GiB/s")
    if snapshot:
        print(f"snapshot per rank: {snapshot / 2**30:.3f} GiB -> predicted copy time "
              f"{snapshot / bandwidth * 1e3:.1f} ms")
    async_held = [m["held_before"] for m in per_rank[0] if m["mode"] == "async"]
    if async_held:
        print(f"asynchronous saves' host buffer before the first async save: {async_held[0] / 2**30:.3f} GiB "
              f"(--async-buffer {options.async_buffer})")
    print(f"{'mode':6} {'first save':>10} {'later med':>9} {'later max':>9} {'step med':>9} "
          f"{'step med during write':>22} {'final wait':>10} {'faults first / later max':>25}"
          "   (ms; barrier to barrier, all ranks; page faults: the rank with most)")
    summary = {m["mode"]: _mode_row(index, per_rank) for index, m in enumerate(per_rank[0])}
    if "sync" in summary and "async" in summary:
        _ratios(summary["sync"], summary["async"], snapshot / bandwidth if snapshot else None)
    sys.stdout.flush()


def _mode_row(index: int, per_rank: list[list[dict]]) -> dict:
    """Print mode `index`'s row of the table; its summary (seconds)."""
    mode = per_rank[0][index]["mode"]
    count = len(per_rank[0][index]["saves"])
    saves = [max(r[index]["saves"][i] for r in per_rank) for i in range(count)]
    faults = [max(r[index]["faults"][i] for r in per_rank) for i in range(count)]
    steps = [s for r in per_rank for s in r[index]["steps"]]
    during = [s for r in per_rank for s in r[index]["overlapped"]]
    later = saves[1:] or saves
    print(f"{mode:6} {_ms(saves[0]):>10} {_ms(statistics.median(later))} {_ms(max(later))} "
          f"{_ms(statistics.median(steps))} {(_ms(statistics.median(during)) if during else '-'):>22} "
          f"{_ms(max(r[index]['final_wait'] for r in per_rank)):>10} "
          f"{f'{faults[0]} / {max(faults[1:] or faults)}':>25}")
    return {"first": saves[0], "save": statistics.median(later), "worst": max(saves),
            "all": statistics.median(saves), "step": statistics.median(steps),
            "during": statistics.median(during) if during else None}


def _ratios(sync: dict, asyn: dict, copy_s: float | None) -> None:
    """The summary lines comparing the modes (times in seconds)."""
    print(f"blocking, sync save median / async: first save {sync['all'] / asyn['first']:.1f}x, later saves "
          f"(median) {sync['all'] / asyn['save']:.1f}x, slowest async save {sync['all'] / asyn['worst']:.1f}x")
    print(f"async first save / later median = {asyn['first'] / asyn['save']:.2f}")
    if copy_s:
        print(f"async blocking (later median) / predicted copy time = {asyn['save'] / copy_s:.2f}")
    print(f"step time, async vs sync (steps that are not saves): {100 * (asyn['step'] / sync['step'] - 1):+.1f}%")
    if asyn["during"] is not None:
        print(f"step time while a save is written vs sync steps: {100 * (asyn['during'] / sync['step'] - 1):+.1f}%")


def _spawned(rank: int, world: int, port: int, options: argparse.Namespace) -> None:
    import torch.distributed as dist

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "ZERO3_ACCELERATOR": "cpu"})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(minutes=10))
    try:
        bench(rank, world, options)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    options = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun
        import torch.distributed as dist

        import zero3

        zero3.init_distributed()
        if options.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        bench(dist.get_rank(), dist.get_world_size(), options)
        dist.destroy_process_group()
        return
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_spawned, args=(options.ranks, port, options), nprocs=options.ranks, join=True)


if __name__ == "__main__":
    main()
