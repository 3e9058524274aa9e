"""How long a checkpoint save stops training: synchronous against asynchronous saves.

A Llama (random weights, built from a LlamaConfig) trains with zero3 and AdamW; every
`--save-every` steps it saves a checkpoint, first with synchronous saves, then with
asynchronous ones (`save_checkpoint(..., async_save=True)`), each into a fresh folder.
Every save overwrites one tag (`rolling`), so the disk holds at most two copies of the
state (the committed one and the one being written); a mode's folder is removed at its end.
Per mode it reports:
- blocking: the wall time of each save_checkpoint call (the device synchronized before the
  call), the first save apart (an asynchronous save allocates, and on a GPU pins, its host
  buffer then);
- steps: the median step time of all steps that are not saves, and of the steps that ran
  while an asynchronous save was being written (the step right after a save);
- the snapshot: this rank's checkpoint bytes, the host copy bandwidth measured on 1 GiB
  (device to pinned host memory on a GPU, host to host on the CPU) and the copy time it
  predicts (bytes / bandwidth), the floor of an asynchronous save's blocking time.

    # CPU, 2 gloo ranks (spawned), a small Llama:
    python bench/async_save_bench.py --ranks 2 --hidden 512 --layers 8 --vocab 8192 --seq 128
    # one GPU, ~1B Llama full fine-tune in bf16, world size 1:
    torchrun --standalone --nproc_per_node=1 bench/async_save_bench.py --device cuda --dtype bf16 \\
        --hidden 2048 --layers 16 --intermediate 5632 --heads 16 --vocab 32000 --seq 2048 \\
        --micro-batch 2 --steps 16 --save-every 4 --dir /tmp/async_save_bench
"""

from __future__ import annotations

import argparse
import datetime
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
    p.add_argument("--steps", type=int, default=16, help="measured steps per mode (after 2 warm-up steps)")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--dir", default="/tmp/zero3_async_save_bench", help="where the checkpoints go (emptied)")
    return p.parse_args(argv)


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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = zero3.initialize(model=model, optimizer=optimizer, config=ds)
    return engine


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of one 1 GiB copy into host memory (pinned from a GPU)."""
    nbytes = 1 << 30
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device == "cuda")
    best = float("inf")
    for _ in range(3):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=device == "cuda")
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best


def run_mode(engine, options: argparse.Namespace, mode: str, rank: int, world: int) -> dict:
    import torch.distributed as dist

    folder = Path(options.dir) / mode
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier()
    generator = torch.Generator().manual_seed(100 + rank)
    steps, saves, overlapped = [], [], []
    writing = False
    for step in range(2 + options.steps):
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
        if step >= 2 and (step - 1) % options.save_every == 0:
            start = time.perf_counter()
            engine.save_checkpoint(str(folder), tag="rolling", async_save=(mode == "async"))
            synchronize(options.device)
            saves.append(time.perf_counter() - start)
            writing = mode == "async"
            if rank == 0:  # progress, so a run cut short still tells what it measured
                print(f"# {mode} save {len(saves)} at step {step}: blocked {saves[-1] * 1e3:.0f} ms; "
                      f"last step {elapsed * 1e3:.0f} ms", flush=True)
    start = time.perf_counter()
    engine.wait_for_checkpoint()
    final_wait = time.perf_counter() - start
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        shutil.rmtree(folder, ignore_errors=True)  # at most two copies of the state on disk at a time
    return {"mode": mode, "saves": saves, "steps": steps, "overlapped": overlapped, "final_wait": final_wait,
            "snapshot_bytes": engine.checkpointer.snapshot.held_bytes}


def bench(rank: int, world: int, options: argparse.Namespace) -> None:
    import torch.distributed as dist

    engine = build_engine(options)
    results = [run_mode(engine, options, mode, rank, world) for mode in options.modes.split(",")]
    bandwidth = copy_bandwidth(options.device) if rank == 0 else 0.0
    gathered = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if rank == 0:
        report(options, world, gathered, bandwidth, engine)
    engine.destroy()


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f}"


def report(options, world: int, per_rank: list[list[dict]], bandwidth: float, engine) -> None:
    params = sum(sp.numel for sp in engine.table.values())
    print(f"Llama {params / 1e6:.1f}M parameters, {options.dtype}, AdamW, {world} rank(s) on {options.device}, "
          f"a save every {options.save_every} steps, {options.steps} measured steps per mode, into {options.dir}")
    snapshot = max(r[-1]["snapshot_bytes"] for r in per_rank) if any(
        m["mode"] == "async" for m in per_rank[0]) else 0
    print(f"host copy bandwidth (rank 0, 1 GiB, {'device->pinned' if options.device == 'cuda' else 'host->host'}):"
          f" {bandwidth / 2**30:.1f} GiB/s")
    if snapshot:
        print(f"snapshot per rank: {snapshot / 2**30:.3f} GiB -> predicted copy time "
              f"{snapshot / bandwidth * 1e3:.1f} ms")
    print(f"{'mode':6} {'first save':>10} {'save med':>9} {'save max':>9} {'step med':>9} "
          f"{'step med during write':>22} {'final wait':>10}   (ms; slowest rank per save)")
    summary = {}
    for index, mode_result in enumerate(per_rank[0]):
        mode = mode_result["mode"]
        saves = [max(r[index]["saves"][i] for r in per_rank) for i in range(len(mode_result["saves"]))]
        steps = [s for r in per_rank for s in r[index]["steps"]]
        during = [s for r in per_rank for s in r[index]["overlapped"]]
        later = saves[1:] or saves
        summary[mode] = {"save": statistics.median(later), "step": statistics.median(steps),
                         "during": statistics.median(during) if during else None}
        print(f"{mode:6} {_ms(saves[0]):>10} {_ms(statistics.median(later))} {_ms(max(later))} "
              f"{_ms(statistics.median(steps))} {(_ms(statistics.median(during)) if during else '-'):>22} "
              f"{_ms(max(r[index]['final_wait'] for r in per_rank)):>10}")
    if "sync" in summary and "async" in summary:
        sync, asyn = summary["sync"], summary["async"]
        print(f"blocking per save (after the first): sync / async = {sync['save'] / asyn['save']:.1f}x")
        if snapshot:
            print(f"async blocking / predicted copy time = {asyn['save'] / (snapshot / bandwidth):.2f}")
        print(f"step time, async vs sync (steps that are not saves): {100 * (asyn['step'] / sync['step'] - 1):+.1f}%")
        if asyn["during"] is not None:
            print(f"step time while a save is written vs sync steps: {100 * (asyn['during'] / sync['step'] - 1):+.1f}%")
    sys.stdout.flush()


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
