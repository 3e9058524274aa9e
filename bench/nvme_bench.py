#!/usr/bin/env python
"""The NVMe tier measured: the disk's own bandwidth, zero3's swap bandwidth against it, and the
step time of a full fine-tune with part of its optimizer state on NVMe against the host tier.

One case per process (bench/nvme_gpu.sh runs them in turn; each prints one JSON line and
appends it to --rows):

    python3 bench/nvme_bench.py disk  --dir /nvme --gib 8          # direct I/O, large file
    python3 bench/nvme_bench.py swap  --dir /nvme --gib 8          # zero3's SwapIO + pager
    python3 bench/nvme_bench.py train --dir /nvme --tier host      # offload_optimizer "cpu"
    python3 bench/nvme_bench.py train --dir /nvme --tier nvme --host-share 0.5
    python3 bench/nvme_bench.py largest --dir /nvme --tier nvme    # the largest that fits, trained
    python3 bench/nvme_bench.py table --rows rows.jsonl            # the ratios

- `disk`: a file of --gib GiB written then read with O_DIRECT in --chunk-mib chunks from
  page-aligned buffers, --threads at once (positioned I/O on disjoint ranges), fsync before
  the clock stops; the page cache is out of the way, so this is the drive, not the memory.
- `swap`: the same bytes through zero3's own path: GroupPager over SwapIO (the backend zero3
  picks: KvikIO where it works, else POSIX; the `aio` settings given), groups of --group-mib,
  all written (writes behind, as the step does), then all read with the next read started
  while the current one is waited for; reported with its ratio to `disk` (target >= 0.8).
- `train`: a GPT (bench/models.py) in bf16 on the compute device (cuda if present), both
  offloads on, AdamW; `--tier host` keeps the optimizer state on the host, `--tier nvme` puts
  the share `1 - --host-share` of it in swap files under --dir (placement.host_budget from
  the plan's host bytes). Reports the median step, the time the step waited on swap reads and
  writes, the bytes per step, and the placement line. `--engine deepspeed` runs the same model
  and JSON under DeepSpeed (installed apart): ZeRO-Infinity with `--tier nvme` (all of its
  optimizer state on NVMe, its read and write pipelining on unless `--ds-pipeline 0`), beside
  zero3 at `--host-share 0`.
- `largest`: the largest GPT of --width (4096: a 7B-class shape) whose full fine-tune fits this
  machine with --tier's state placement, found by zero3's own planner (`zero3 estimate`'s)
  layer count by layer count: the GPU under --gpu-budget-gib, the host under its available
  memory less --host-margin-gib (what the plan does not count: the CUDA context, staging
  buffers, the allocator's slack; measured about 20 GiB at 6.7B), and for `nvme` the swap
  files under the free space at --dir less --disk-margin-gib. That model is then built (bf16,
  on the GPU) and trained --warmup + --steps steps; the row says the size, the plan, the
  step time, the host memory and swap bytes, and why one layer more does not fit.
The CPU run of every case is what the test of this script does (tiny sizes, tests/ none):
`python3 bench/nvme_bench.py train --device cpu --width 64 --layers 2 --steps 2 ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = os.environ.get("ZERO3_TREE") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

GIB = 1 << 30
MIB = 1 << 20


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("case", choices=["disk", "swap", "train", "largest", "table"])
    p.add_argument("--dir", default=None, help="a folder on the drive measured (default: a temporary one)")
    p.add_argument("--gib", type=float, default=8.0)
    p.add_argument("--chunk-mib", type=int, default=64)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--group-mib", type=int, default=256)
    p.add_argument("--block-mib", type=int, default=8, help="aio.block_size")
    p.add_argument("--queue-depth", type=int, default=8)
    p.add_argument("--buffers", type=int, default=4, help="offload_optimizer.buffer_count")
    p.add_argument("--ds-pipeline", type=int, default=1, choices=(0, 1),
                   help="DeepSpeed's offload_optimizer pipeline_read/pipeline_write (--engine deepspeed)")
    p.add_argument("--tier", choices=["host", "nvme"], default="nvme")
    p.add_argument("--host-share", type=float, default=0.5)
    p.add_argument("--ratio", type=float, default=None,
                   help="train: offload_optimizer.ratio for zero3 (1.0: none of the optimizer state on the GPU)")
    p.add_argument("--engine", choices=["zero3", "deepspeed"], default="zero3",
                   help="train: DeepSpeed runs the same model and JSON (its ZeRO-Infinity with --tier nvme)")
    p.add_argument("--gpu-budget-gib", type=float, default=12.0,
                   help="placement.gpu_budget on cuda: room for the parameter shards and little of the optimizer "
                        "state, which stays off the card (an auto budget would put a 2.9B model's whole state there)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--sub-group-mib", type=int, default=512, help="sub_group_size in MiB of fp32")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rows", default=None)
    p.add_argument("--host-margin-gib", type=float, default=24.0, help="largest: host memory the plan does not count")
    p.add_argument("--host-gib", type=float, default=None,
                   help="largest: the host memory to plan for (default: available less --host-margin-gib)")
    p.add_argument("--disk-margin-gib", type=float, default=4.0, help="largest: free disk left over")
    p.add_argument("--max-layers", type=int, default=160, help="largest: the search's upper end")
    return p.parse_args()


def emit(args: argparse.Namespace, row: dict) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if args.rows:
        with open(args.rows, "a") as handle:
            handle.write(line + "\n")


# ----------------------------------------------------------------------------- disk
def disk_case(args: argparse.Namespace, folder: Path) -> dict:
    """Direct-I/O write then read of one large file, `threads` disjoint ranges at once."""
    from zero3.nvme.buffers import aligned_empty

    total = int(args.gib * GIB) // (args.chunk_mib * MIB) * (args.chunk_mib * MIB)
    chunk = args.chunk_mib * MIB
    path = folder / "disk_bench.bin"
    buffers = [aligned_empty(chunk) for _ in range(args.threads)]
    for b in buffers:
        b.random_(0, 255)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0)
    fd = os.open(path, flags, 0o600)
    try:
        write = _timed_ranges(fd, total, chunk, buffers, os.pwritev, sync=True)
        read = _timed_ranges(fd, total, chunk, buffers, os.preadv, sync=False)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return {"case": "disk", "gib": total / GIB, "direct": hasattr(os, "O_DIRECT"), "threads": args.threads,
            "chunk_mib": args.chunk_mib, "write_gbps": total / write / 1e9, "read_gbps": total / read / 1e9}


def _timed_ranges(fd: int, total: int, chunk: int, buffers: list, call, sync: bool) -> float:
    """Seconds for `call` over every chunk of [0, total), one thread per buffer."""
    offsets = list(range(0, total, chunk))
    lock = threading.Lock()

    def worker(buffer) -> None:
        view = [memoryview(buffer.numpy()).cast("B")]
        while True:
            with lock:
                if not offsets:
                    return
                offset = offsets.pop()
            if call(fd, view, offset) != chunk:
                raise OSError(f"short transfer at {offset}")

    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(b,)) for b in buffers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if sync:
        os.fsync(fd)
    return time.perf_counter() - start


# ----------------------------------------------------------------------------- swap
def swap_case(args: argparse.Namespace, folder: Path) -> dict:
    """zero3's pager over SwapIO: every group written, then read back one ahead."""
    from zero3.nvme.backends import open_files
    from zero3.nvme.buffers import BufferPool
    from zero3.nvme.io import IssueSettings, SwapIO
    from zero3.nvme.pager import GroupPager

    size = args.group_mib * MIB
    count = max(int(args.gib * GIB) // size, 2)
    settings = IssueSettings(args.block_mib * MIB, args.queue_depth, args.threads, False, True)
    files, backend = open_files("auto", folder, settings.threads, settings.block_size)
    pool = BufferPool(args.buffers, size)
    pager = GroupPager(SwapIO(files, settings), pool, [folder / f"g{g}.swp" for g in range(count)], [size] * count)
    filled = min(args.buffers, count)
    for g in range(filled):  # the data, made before the clock starts (random_ runs at ~0.1-1 GB/s)
        pager.fresh(g).random_(0, 255)
    start = time.perf_counter()
    for g in range(count):
        if g >= filled:
            pager.fresh(g)
        pager.store(g)
    pager.drain()
    os.sync()
    write = time.perf_counter() - start
    start = time.perf_counter()
    for g in range(count):
        for ahead in range(g, min(g + args.buffers, count)):  # reads queued while g is waited for
            pager.prefetch(ahead)
        pager.resident(g)
        pager.release(g)
    read = time.perf_counter() - start
    pager.close()
    total = count * size
    return {"case": "swap", "backend": backend, "gib": total / GIB, "group_mib": args.group_mib,
            "block_mib": args.block_mib, "queue_depth": args.queue_depth, "threads": args.threads,
            "direct": files.direct, "write_gbps": total / write / 1e9, "read_gbps": total / read / 1e9}


# ----------------------------------------------------------------------------- train
def train_config(args: argparse.Namespace, folder: Path, host_budget: int | None) -> dict:
    optimizer = {"device": "cpu", "pin_memory": args.device == "cuda"}
    if args.tier == "nvme":
        optimizer.update(device="nvme", nvme_path=str(folder), buffer_count=args.buffers)
    if args.ratio is not None:
        optimizer["ratio"] = args.ratio
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
              "gradient_clipping": 1.0, "bf16": {"enabled": True},
              "zero_optimization": {"stage": 3, "sub_group_size": args.sub_group_mib * MIB // 4,
                                    "offload_param": {"device": "cpu"}, "offload_optimizer": optimizer},
              "aio": {"block_size": args.block_mib * MIB, "queue_depth": args.queue_depth,
                      "intra_op_parallelism": args.threads},
              "placement": {}}
    if host_budget is not None:
        config["placement"]["host_budget"] = host_budget
    if args.device == "cuda":
        config["placement"]["gpu_budget"] = int(args.gpu_budget_gib * GIB)
    return config


def host_bytes_of_state(args: argparse.Namespace, model) -> int:
    """The optimizer sides' host bytes of the host-tier plan (what host_share is a share of)."""
    from zero3.estimate import estimate_placement

    budget = int(args.gpu_budget_gib * GIB) if args.device == "cuda" else None
    plan = estimate_placement(model, 1, train_config(argparse.Namespace(**{**vars(args), "tier": "host"}),
                                                     Path("."), None), budget).plan
    return plan.host_bytes


def build_gpt(args: argparse.Namespace, dtype: torch.dtype):
    from models import GPT

    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # made in `dtype`: a 12B model in fp32 would not fit beside its bf16 copy
    try:
        with torch.device(args.device):  # random initialisation on the GPU: seconds, not minutes
            return GPT(vocab=args.vocab, width=args.width, layers=args.layers, seq=args.seq + 1)
    finally:
        torch.set_default_dtype(default)


def train_case(args: argparse.Namespace, folder: Path, host_budget: int | None = None,
               dtype: torch.dtype = torch.float32) -> dict:
    """`host_budget`: the NVMe tier's host budget (default: --host-share of the host tier's)."""
    if args.engine == "deepspeed":
        return deepspeed_train_case(args, folder)
    import zero3

    model = build_gpt(args, dtype)
    zero3.set_z3_leaf_modules(model, [type(model.h[0])])  # a block, one fetch unit
    if args.tier == "nvme" and host_budget is None:
        host_budget = int(host_bytes_of_state(args, model) * args.host_share)
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-4),
                                  config=train_config(args, folder, host_budget))
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=engine.device)
    disk_before = _disk_bytes()
    times, losses = _train(engine, tokens, args.warmup + args.steps, wait=engine.optimizer.wait)
    swap = engine.optimizer.swap
    waited = dict(getattr(swap, "waited", {}))
    pager = getattr(swap, "pager", None)
    moved = (pager.io.bytes_read + pager.io.bytes_written) / GIB if pager is not None else 0.0
    row = {"case": f"train_{args.tier}" + ("" if args.ratio is None else f"_ratio{args.ratio:g}"), "engine": "zero3", "device": args.device,
           "params_b": sum(p.numel() for p in model.parameters()) / 1e9,
           "host_share": args.host_share if args.tier == "nvme" else 1.0,
           "step_s": statistics.median(times[args.warmup:]), "steps": times, "losses": losses[:3],
           "swap_wait_s_per_step": {k: v / len(times) for k, v in waited.items()},
           "swap_gib_per_step": moved / len(times), "disk_gib_per_step": (_disk_bytes() - disk_before) / GIB / len(times),
           "plan": engine.placement.plan.describe(), "host_rss_gib": _rss_gib()}
    engine.destroy()
    return row


def deepspeed_train_case(args: argparse.Namespace, folder: Path) -> dict:
    """The same GPT, JSON and steps under DeepSpeed (installed apart, never zero3's dependency):
    `--tier nvme` is its ZeRO-Infinity, all of the optimizer state in swap files under --dir (it
    has no host share), its read and write pipelining on with `--ds-pipeline 1`; `--tier host`
    its ZeRO-Offload."""
    import logging

    import deepspeed

    deepspeed.utils.logger.setLevel(logging.WARNING)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29561"}.items():
        os.environ.setdefault(key, value)  # one process without a launcher
    model = build_gpt(args, torch.bfloat16)
    config = train_config(args, folder, None)
    del config["placement"]  # zero3's own section
    config["zero_optimization"]["offload_optimizer"].pop("ratio", None)  # DeepSpeed's applies to "cpu" alone
    config.update(optimizer={"type": "AdamW", "params": {"lr": 1e-4}}, steps_per_print=10**9)
    if args.tier == "nvme" and args.ds_pipeline:
        config["zero_optimization"]["offload_optimizer"].update(pipeline_read=True, pipeline_write=True)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), device=engine.device)
    disk_before = _disk_bytes()
    times, losses = _train(engine, tokens, args.warmup + args.steps, wait=lambda: None)
    pipelined = "_pipelined" if args.tier == "nvme" and args.ds_pipeline else ""
    return {"case": f"deepspeed_{args.tier}{pipelined}_buffers{args.buffers}",
            "engine": f"DeepSpeed {deepspeed.__version__}", "device": args.device,
            "params_b": sum(p.ds_numel for p in model.parameters()) / 1e9,
            "host_share": 0.0 if args.tier == "nvme" else 1.0,
            "step_s": statistics.median(times[args.warmup:]), "steps": times, "losses": losses[:3],
            "disk_gib_per_step": (_disk_bytes() - disk_before) / GIB / len(times), "host_rss_gib": _rss_gib()}


def _disk_bytes() -> int:
    """This process's bytes read from and written to storage so far (/proc/self/io; direct I/O
    included, page-cache hits not)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["read_bytes"]) + int(fields["write_bytes"])


def largest_case(args: argparse.Namespace, folder: Path) -> dict:
    """The largest --width GPT whose plan fits this machine with --tier, then trained."""
    import shutil

    host_gib = args.host_gib if args.host_gib is not None else _available_host_gib() - args.host_margin_gib
    if host_gib <= 0:
        raise SystemExit(f"largest: {host_gib:.1f} GiB of host memory to plan for; lower --host-margin-gib")
    host = int(host_gib * GIB)
    disk = int(shutil.disk_usage(folder).free - args.disk_margin_gib * GIB) if args.tier == "nvme" else 0
    fits, refusal, host_budget = None, None, None
    for layers in range(1, args.max_layers + 1):
        trial = argparse.Namespace(**{**vars(args), "layers": layers})
        verdict = _fits(trial, folder, host, disk)
        if verdict is not None:
            refusal = f"{layers} layers: {verdict}"
            break
        fits, host_budget = layers, trial.host_budget
    if fits is None:
        return {"case": f"largest_{args.tier}", "failed": refusal}
    args.layers = fits
    row = train_case(args, folder, host_budget=host_budget, dtype=torch.bfloat16)
    row.update(case=f"largest_{args.tier}", layers=fits, next_refused=refusal, host_capacity_gib=host / GIB,
               host_budget_gib=None if host_budget is None else host_budget / GIB,
               disk_capacity_gib=disk / GIB, free_disk_gib_after=shutil.disk_usage(folder).free / GIB)
    return row


def _fits(args: argparse.Namespace, folder: Path, host: int, disk: int) -> str | None:
    """None when the plan of `args`' model fits; else why not."""
    from models import GPT
    from zero3.estimate import estimate_placement
    from zero3.placement.plan import PlacementError

    with torch.device("meta"):
        model = GPT(vocab=args.vocab, width=args.width, layers=args.layers, seq=args.seq + 1)
    host_budget = host if args.tier == "nvme" else None
    for _ in range(40):  # host_budget bounds the optimizer sides alone: lowered by what else the host holds
        config = train_config(args, folder, host_budget)
        try:
            plan = estimate_placement(model, 1, config, config["placement"].get("gpu_budget")).plan
        except PlacementError as exc:
            return str(exc)
        if host_budget is None or plan.host_bytes <= host or host_budget <= 0:
            break
        host_budget = max(0, host_budget - (plan.host_bytes - host) - GIB // 2)
    args.host_budget = host_budget
    if plan.host_bytes > host:
        return f"host {plan.host_bytes / GIB:.1f} GiB planned, {host / GIB:.1f} GiB available"
    if plan.nvme_bytes > disk:
        return f"NVMe {plan.nvme_bytes / GIB:.1f} GiB planned, {disk / GIB:.1f} GiB free"
    return None


def _available_host_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 / GIB
    raise RuntimeError("largest: /proc/meminfo has no MemAvailable line")


def _train(engine, tokens: torch.Tensor, steps: int, wait) -> tuple[list[float], list[float]]:
    times, losses = [], []
    for _ in range(steps):
        _sync(engine.device)
        start = time.perf_counter()
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        wait()  # zero3: the overlapped host step (and its swap I/O) inside the step time
        _sync(engine.device)
        times.append(time.perf_counter() - start)
        losses.append(float(loss.float().item()))
    return times, losses


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB


# ----------------------------------------------------------------------------- table
def table(rows_path: str) -> None:
    rows = [json.loads(line) for line in Path(rows_path).read_text().splitlines() if line.strip()]
    by = {r["case"]: r for r in rows}
    disk, swap = by.get("disk"), by.get("swap")
    if disk and swap:
        print(f"disk (direct I/O): write {disk['write_gbps']:.2f} GB/s, read {disk['read_gbps']:.2f} GB/s")
        print(f"zero3 swap ({swap['backend']}): write {swap['write_gbps']:.2f} GB/s "
              f"({swap['write_gbps'] / disk['write_gbps']:.0%} of the disk), read {swap['read_gbps']:.2f} GB/s "
              f"({swap['read_gbps'] / disk['read_gbps']:.0%}); target >= 80%")
    for suffix in ("", "_ratio1"):
        _train_line(by.get(f"train_host{suffix}"), by.get(f"train_nvme{suffix}"))
    zero3_nvme = by.get("train_nvme_ratio1") or by.get("train_nvme")
    for deepspeed in (r for r in rows if r["case"].startswith("deepspeed_nvme")):
        line = (f"{deepspeed['engine']} ZeRO-Infinity ({deepspeed['case']}), {deepspeed['params_b']:.2f}B params, all "
                f"of the optimizer state on NVMe: {deepspeed['step_s']:.2f} s/step, "
                f"{deepspeed['disk_gib_per_step']:.1f} GiB of disk I/O a step")
        if zero3_nvme and zero3_nvme["params_b"] == deepspeed["params_b"]:
            line += (f"; zero3 with {1 - zero3_nvme['host_share']:.0%} on NVMe {zero3_nvme['step_s']:.2f} s/step, "
                     f"{zero3_nvme['disk_gib_per_step']:.1f} GiB (DeepSpeed / zero3 x{deepspeed['step_s'] / zero3_nvme['step_s']:.2f})")
        print(line)
    for tier in ("host", "nvme"):
        row = by.get(f"largest_{tier}")
        if row and "failed" in row:
            print(f"largest, {tier} tier: nothing fits ({row['failed']})")
        elif row:
            print(f"largest, {tier} tier: {row['params_b']:.2f}B params ({row['layers']} layers) trained at "
                  f"{row['step_s']:.1f} s/step, host RSS {row['host_rss_gib']:.0f} GiB of {row['host_capacity_gib']:.0f} "
                  f"planned, swap {row['swap_gib_per_step']:.1f} GiB a step; one more layer: {row['next_refused']}")


def _train_line(host: dict | None, nvme: dict | None) -> None:
    if host and nvme:
        off_gpu = " (no optimizer state on the GPU)" if "ratio1" in host["case"] else ""
        print(f"train {nvme['params_b']:.2f}B params{off_gpu}: host tier {host['step_s']:.2f} s/step, "
              f"{1 - nvme['host_share']:.0%} of the optimizer state on NVMe {nvme['step_s']:.2f} s/step "
              f"(x{nvme['step_s'] / host['step_s']:.2f}); the NVMe step waited "
              f"{nvme['swap_wait_s_per_step']} s on swap I/O, moving {nvme['swap_gib_per_step']:.2f} GiB a step")


def main() -> None:
    args = parse()
    if args.case == "table":
        table(args.rows)
        return
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    with tempfile.TemporaryDirectory(dir=base, prefix="zero3_nvme_bench_") as scratch:
        case = {"disk": disk_case, "swap": swap_case, "train": train_case, "largest": largest_case}[args.case]
        emit(args, case(args, Path(scratch)))


if __name__ == "__main__":
    main()
