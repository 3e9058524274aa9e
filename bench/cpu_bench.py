#!/usr/bin/env python
"""Side-by-side training benchmark: plain/DDP, FSDP2, DeepSpeed ZeRO-3 and zero3.

    torchrun --standalone --nproc_per_node=2 bench/cpu_bench.py \
        --width 128 --layers 8 --seq 128 --micro-batch 4 --steps 10 --warmup 3 --rounds 3

Every peer is built fresh from the same seed and trains on the same random tokens (each
rank its own slice of a global batch). Rounds alternate the peers (ddp, fsdp2, deepspeed,
zero3, then again) so that a noisy machine hurts them alike; step times are the slowest
rank's, and the table reports the median over all measured steps of all rounds.

Collectives: zero3 reports its own counters (``engine.comm_stats()``); for the other
peers this script wraps the Python collectives of ``torch.distributed`` inside this
process only (DDP is given the stock Python all-reduce comm hook so that its buckets go
through them). Bytes are per rank and, as zero3's counters do, count the local input of
each call: for an all-gather the shard this rank contributes, for a reduce-scatter the
full buffer it reduces, for an all-reduce / broadcast the tensor. For zero3 the table
shows the engine's own counters and the detail lines what torch.distributed saw, as a
cross-check.

Memory: on CPU, the peak RSS of the process while the peer is built and trained, minus
the RSS just before (the kernel's high-water mark is reset through
/proc/self/clear_refs); on CUDA, torch.cuda.max_memory_allocated() minus the bytes
allocated before.

A peer whose import or initialize fails is reported as failed in the table; the others
still run.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import inspect
import json
import logging
import os
import socket
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections import defaultdict
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
# Benchmark the working tree's zero3 (the editable install points here too), or the tree
# named by ZERO3_TREE (a baseline copy, for A/B runs).
ZERO3_TREE = os.path.abspath(os.environ.get("ZERO3_TREE", ROOT))
if ZERO3_TREE not in sys.path:
    sys.path.insert(1, ZERO3_TREE)

ALL_PEERS = ("ddp", "fsdp2", "deepspeed", "zero3")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("gpt", "llama"), default="gpt")
    p.add_argument("--width", type=int, default=128, help="hidden size")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=None, help="default: width // 64")
    p.add_argument("--kv-heads", type=int, default=None, help="llama only; default: heads")
    p.add_argument("--intermediate", type=int, default=None,
                   help="llama only; default: 4 * width")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4, help="per rank")
    p.add_argument("--steps", type=int, default=10, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--peers", default=",".join(ALL_PEERS),
                   help="comma list of ddp (plain at world size 1), plain, fsdp2, "
                        "deepspeed, zero3")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--build-on", choices=("cpu", "device"), default="cpu",
                   help="where each peer's fp32 model is built and initialised (device: fast for 7B)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (CPU); default: cores / local ranks")
    p.add_argument("--fused", choices=("auto", "on", "off"), default="auto",
                   help="fused torch AdamW for every peer (auto: on for cuda)")
    p.add_argument("--config-extra", default=None,
                   help="JSON merged into the DeepSpeed config dict of deepspeed and zero3, "
                        "e.g. '{\"zero_optimization\": {\"stage3_prefetch_bucket_size\": 0}}'")
    p.add_argument("--print-losses", type=int, default=5, help="first N losses per peer")
    p.add_argument("--timeout", type=int, default=900,
                   help="process-group timeout in seconds (a hung peer becomes an error)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("--steps and --rounds must be at least 1, --warmup at least 0")
    return args


# --------------------------------------------------------------------------------------
# Environment: decide CPU accelerator etc. *before* deepspeed is imported anywhere.

def _prepare_env(args):
    if args.device == "cpu":
        # DeepSpeed auto-detects the CPU accelerator when no GPU is found, but say so
        # explicitly; without oneccl_bindings_for_pytorch it falls back to gloo.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    else:
        os.environ.setdefault("DS_ACCELERATOR", "cuda")
    # Allow `python bench/cpu_bench.py` without torchrun (world size 1).
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])


# --------------------------------------------------------------------------------------
# Collective counting (this process only).

_OPS = {  # torch.distributed function -> (reported op, the argument whose bytes count)
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "_all_gather_base": ("all_gather", "input_tensor"),
    "all_gather": ("all_gather", "tensor"),
    "all_gather_coalesced": ("all_gather", "input_tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_reduce": ("all_reduce", "tensor"),
    "all_reduce_coalesced": ("all_reduce", "tensors"),
    "broadcast": ("broadcast", "tensor"),
    "reduce": ("reduce", "tensor"),
    "all_to_all_single": ("all_to_all", "input"),
    "all_to_all": ("all_to_all", "input_tensor_list"),
}


def _nbytes(x) -> int:
    import torch
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CommCounter:
    """Counts calls and bytes of torch.distributed collectives while enabled. Nested calls
    (all_gather_into_tensor -> all_gather_single) count once, as the outermost."""

    def __init__(self):
        self.enabled = False
        self.stats = defaultdict(lambda: [0, 0])
        self._tls = threading.local()
        self.installed = []

    def install(self):
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        for name, (op, argname) in _OPS.items():
            orig = getattr(c10d, name, None)
            if orig is None or getattr(orig, "_bench_wrapped", False):
                continue
            wrapped = self._wrap(orig, op, argname)
            for mod in (dist, c10d):
                if getattr(mod, name, None) is orig:
                    setattr(mod, name, wrapped)
            self.installed.append(name)

    def _wrap(self, fn, op, argname):
        try:
            sig = inspect.signature(fn)
            params = list(sig.parameters)
            pos = params.index(argname)
        except (TypeError, ValueError):  # unknown signature: count calls, not bytes
            pos, argname = 1 << 30, None
        counter = self

        def wrapper(*a, **kw):
            tls = counter._tls
            depth = getattr(tls, "depth", 0)
            if counter.enabled and depth == 0:
                arg = kw.get(argname) if argname in kw else (a[pos] if len(a) > pos else None)
                s = counter.stats[op]
                s[0] += 1
                s[1] += _nbytes(arg)
            tls.depth = depth + 1
            try:
                return fn(*a, **kw)
            finally:
                tls.depth = depth

        wrapper.__name__ = fn.__name__
        wrapper.__qualname__ = getattr(fn, "__qualname__", fn.__name__)
        wrapper.__doc__ = fn.__doc__
        wrapper.__wrapped__ = fn
        wrapper._bench_wrapped = True
        return wrapper

    def snapshot(self):
        return {k: tuple(v) for k, v in self.stats.items()}


COUNTER = CommCounter()


def _delta(after: dict, before: dict) -> dict:
    out = {}
    for k, (c, b) in after.items():
        c0, b0 = before.get(k, (0, 0))
        if c - c0 or b - b0:
            out[k] = (c - c0, b - b0)
    return out


# --------------------------------------------------------------------------------------
# Memory.

def _proc_status_kib(key: str):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class MemoryMeter:
    def __init__(self, device):
        self.device = device
        self.base = 0
        self.ok = True
        try:
            self._libc = ctypes.CDLL("libc.so.6")
        except OSError:
            self._libc = None

    def start(self):
        import torch
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        if self._libc is not None:
            self._libc.malloc_trim(0)  # give freed heap back so the next peer starts clean
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current RSS
            self.ok = True
        except OSError:
            self.ok = False
        self.base = (_proc_status_kib("VmRSS:") or 0) * 1024

    def peak(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        if not self.ok:
            return None
        hwm = _proc_status_kib("VmHWM:")
        return None if hwm is None else hwm * 1024 - self.base


# --------------------------------------------------------------------------------------
# Peers. Each builder returns a Peer; step(tokens) runs one full training step and
# returns the (local) loss tensor.

class Peer:
    def __init__(self, step, comm_stats=None, close=None, note=""):
        self.step = step
        self.comm_stats = comm_stats  # None: count through COUNTER
        self.close = close or (lambda: None)
        self.note = note


def _adamw(params, ctx):
    import torch
    kw = dict(lr=ctx.args.lr)
    if ctx.fused:
        kw["fused"] = True
    return torch.optim.AdamW(params, **kw)


def ds_config(ctx) -> dict:
    args = ctx.args
    cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3},
        # No "zero_allow_untested_optimizer": DeepSpeed 0.19.8 lists torch.optim.AdamW
        # among its ZeRO-supported optimizers (checked), so its default (false) is kept.
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    if args.config_extra:
        _merge(cfg, json.loads(args.config_extra))
    return cfg


def _merge(dst, src):
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


def build_plain(ctx):
    import torch
    from models import build_model
    model = build_model(ctx.args).to(ctx.device)
    if ctx.args.dtype == "bf16":
        model = model.to(torch.bfloat16)  # pure bf16 params and optimizer state
    if ctx.world > 1:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model, device_ids=[ctx.local_rank] if ctx.device.type == "cuda" else None)
        # The stock all-reduce hook, in Python, so its all_reduce calls can be counted.
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    opt = _adamw(model.parameters(), ctx)

    def step(tokens):
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Peer(step)


def fsdp2_shard(model, ctx) -> None:
    """`fully_shard` on each block, then on the root (bf16: bf16 parameters, fp32 reduction)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    mp = MixedPrecisionPolicy()
    if ctx.args.dtype == "bf16":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks():
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def build_fsdp2(ctx):
    from models import build_model
    model = build_model(ctx.args).to(ctx.device)
    fsdp2_shard(model, ctx)
    opt = _adamw(model.parameters(), ctx)

    def step(tokens):
        loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Peer(step)


def _engine_peer(engine, stats_fn=None):
    def step(tokens):
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        return loss

    def close():
        destroy = getattr(engine, "destroy", None)
        if callable(destroy):
            destroy()

    return Peer(step, comm_stats=stats_fn, close=close)


def build_deepspeed(ctx):
    import deepspeed
    from models import build_model
    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = build_model(ctx.args)
    opt = _adamw(model.parameters(), ctx)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(ctx))
    return _engine_peer(engine)


def build_zero3(ctx):
    try:
        import zero3
    except Exception as e:
        raise RuntimeError(f"import zero3 failed: {type(e).__name__}: {e}") from e
    if not hasattr(zero3, "initialize"):
        raise RuntimeError("zero3.initialize does not exist yet")
    from models import build_model
    model = build_model(ctx.args)
    opt = _adamw(model.parameters(), ctx)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=opt, config=ds_config(ctx))
    stats = getattr(engine, "comm_stats", None)
    if not callable(stats):
        stats = None
    peer = _engine_peer(engine, stats_fn=stats)
    if stats is None:
        peer.note = "no engine.comm_stats(); torch.distributed calls counted"
    return peer


def build_plain_autocast(ctx):
    """Plain PyTorch doing zero3's default arithmetic: an fp32 model (fp32 weights, gradients
    and AdamW state) whose forward runs under bf16 autocast. World size 1 only."""
    import torch
    from models import build_model
    if ctx.world > 1:
        raise RuntimeError("plain_autocast runs at world size 1 only")
    model = build_model(ctx.args).to(ctx.device)
    opt = _adamw(model.parameters(), ctx)

    def step(tokens):
        with torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.args.dtype == "bf16"):
            loss = model(tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return Peer(step)


BUILDERS = {"plain": build_plain, "ddp": build_plain, "plain_autocast": build_plain_autocast,
            "fsdp2": build_fsdp2, "deepspeed": build_deepspeed, "zero3": build_zero3}


# --------------------------------------------------------------------------------------

class Ctx:
    pass


def _git_rev() -> str:
    """The working tree's commit, with '+dirty' when zero3/ has uncommitted changes."""
    import subprocess
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "zero3"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "?") + ("+dirty" if dirty else "") + ", " + _zero3_sources()
    except Exception:
        return "? " + _zero3_sources()


def _zero3_sources() -> str:
    """Where zero3 is imported from and a digest of its sources, so A/B runs name their tree."""
    import hashlib
    import pathlib

    import zero3
    package = pathlib.Path(zero3.__file__).parent
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    return f"zero3 from {package} (sources sha1 {digest.hexdigest()[:10]})"


def _all_gather_obj(ctx, obj):
    import torch.distributed as dist
    out = [None] * ctx.world
    dist.all_gather_object(out, obj)
    return out


def run_peer(ctx, name, record_losses):
    """Build peer `name` and train it warmup + steps steps. Returns this rank's record."""
    import torch
    import torch.distributed as dist
    args = ctx.args
    rec = {"ok": False, "error": None}
    mem = MemoryMeter(ctx.device)
    peer = None
    try:
        mem.start()
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        peer = BUILDERS[name](ctx)
        rec["init_s"] = time.perf_counter() - t0
        times, losses, warmup_times = [], [], []
        seen0, own0 = None, None
        total = args.warmup + args.steps
        for i in range(total):
            measured = i >= args.warmup
            if measured and i == args.warmup:
                seen0 = COUNTER.snapshot()
                own0 = peer.comm_stats() if peer.comm_stats else None
            tokens = ctx.batches[i]
            if ctx.world > 1:
                dist.barrier()
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            COUNTER.enabled = measured
            t = time.perf_counter()
            loss = peer.step(tokens)
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            COUNTER.enabled = False
            (times if measured else warmup_times).append(dt)
            if record_losses:
                losses.append(float(loss.detach().float().item()))
        rec["times"] = times
        rec["warmup_times"] = warmup_times
        rec["losses"] = losses
        rec["seen"] = _delta(COUNTER.snapshot(), seen0)
        rec["own"] = _delta(peer.comm_stats(), own0) if peer.comm_stats else None
        rec["peak"] = mem.peak()
        rec["note"] = peer.note
        rec["ok"] = True
    except Exception as e:
        COUNTER.enabled = False
        msg = f"{type(e).__name__}: {e}".strip().splitlines()
        rec["error"] = msg[0][:300] if msg else type(e).__name__
        rec["traceback"] = traceback.format_exc()
    finally:
        if peer is not None:
            try:
                peer.close()
            except Exception:
                pass
        peer = None
        if "torch._dynamo" in sys.modules:
            # Each peer compiles afresh: no cache entry keeps the last peer's model alive, and
            # no peer spends another's recompilation limit on the shared block code.
            sys.modules["torch._dynamo"].reset()
        gc.collect()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the next peer starts from the same free memory
    return rec


def main(argv=None):
    args = parse_args(argv)
    _prepare_env(args)
    # DeepSpeed calls the deprecated all_gather_into_tensor / reduce_scatter_tensor names.
    warnings.filterwarnings("ignore", message=r".*torch\.distributed\..* is deprecated",
                            category=FutureWarning)

    import torch
    import torch.distributed as dist

    COUNTER.install()  # before DeepSpeed binds torch.distributed functions

    ctx = Ctx()
    ctx.args = args
    ctx.rank = int(os.environ["RANK"])
    ctx.world = int(os.environ["WORLD_SIZE"])
    ctx.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", ctx.world))
    if args.device == "cuda":
        torch.cuda.set_device(ctx.local_rank)
        ctx.device = torch.device("cuda", ctx.local_rank)
        backend = "nccl"
    else:
        ctx.device = torch.device("cpu")
        backend = "gloo"
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        torch.set_num_threads(args.threads or max(1, cores // local_world))
    ctx.fused = {"on": True, "off": False, "auto": args.device == "cuda"}[args.fused]
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    rank0 = ctx.rank == 0

    peers = []
    for p in args.peers.split(","):
        p = p.strip()
        if not p:
            continue
        if p in ("ddp", "plain"):
            p = "ddp" if ctx.world > 1 else "plain"
        if p not in BUILDERS:
            raise SystemExit(f"unknown peer {p!r}; choose from {', '.join(BUILDERS)}")
        if p not in peers:
            peers.append(p)

    # The same random tokens for every peer; rank r trains on rows r*B:(r+1)*B.
    total = args.warmup + args.steps
    g = torch.Generator().manual_seed(args.seed + 1)
    B = args.micro_batch
    data = torch.randint(0, args.vocab, (total, ctx.world * B, args.seq + 1), generator=g)
    ctx.batches = [data[i, ctx.rank * B:(ctx.rank + 1) * B].contiguous().to(ctx.device)
                   for i in range(total)]

    import models
    n_params = models.count_parameters(args)

    versions = {"torch": torch.__version__, "zero3 tree": _git_rev()}
    try:
        import deepspeed
        versions["deepspeed"] = deepspeed.__version__
    except Exception as e:
        versions["deepspeed"] = f"unavailable ({type(e).__name__})"
    if rank0:
        print(f"# bench: {' '.join(sys.argv)}", flush=True)
        print(f"# world {ctx.world} ({backend}), device {args.device}, dtype {args.dtype}, "
              f"threads/rank {torch.get_num_threads() if args.device == 'cpu' else '-'}, "
              f"model {args.model} {n_params / 1e6:.2f}M params, "
              f"tokens/step {B * args.seq * ctx.world}, "
              + ", ".join(f"{k} {v}" for k, v in versions.items()), flush=True)

    rates = measure_device_rates() if args.device == "cuda" else None
    load0 = os.getloadavg()
    results = {p: {"times": [], "round_medians": [], "init": [], "warmup": [], "peak": [], "seen": [], "own": [],
                   "losses": None, "error": None, "note": ""} for p in peers}
    for rnd in range(args.rounds):
        for p in peers:
            res = results[p]
            if res["error"]:
                continue
            if rank0:
                print(f"# round {rnd + 1}/{args.rounds}: {p}", flush=True)
            rec = run_peer(ctx, p, record_losses=(rnd == 0))
            recs = _all_gather_obj(ctx, rec)
            bad = [(r, x) for r, x in enumerate(recs) if not x["ok"]]
            if bad:
                r, x = bad[0]
                res["error"] = f"rank {r}: {x['error']}"
                if rank0:
                    print(f"# {p} FAILED on rank {r}: {x['error']}", flush=True)
                    if os.environ.get("BENCH_TRACEBACK"):
                        print(x.get("traceback", ""), flush=True)
                continue
            # Per step: the slowest rank's time.
            step_times = [max(x["times"][i] for x in recs)
                          for i in range(len(recs[0]["times"]))]
            res["times"].extend(step_times)
            res["round_medians"].append(statistics.median(step_times))
            res["init"].append(max(x["init_s"] for x in recs))
            res["warmup"].append([max(x["warmup_times"][i] for x in recs) for i in range(len(recs[0]["warmup_times"]))])
            peaks = [x["peak"] for x in recs]
            res["peak"].append(None if any(v is None for v in peaks) else max(peaks))
            res["seen"].append(recs[0]["seen"])
            res["own"].append(recs[0]["own"])
            res["note"] = recs[0]["note"]
            if rnd == 0:
                n = len(recs[0]["losses"])
                res["losses"] = [sum(x["losses"][i] for x in recs) / ctx.world
                                 for i in range(n)]

    if rank0:
        report(ctx, peers, results, n_params, backend, versions, (load0, os.getloadavg()))
        if rates is not None:
            report_device_use(ctx, results, n_params, rates)
    dist.barrier()
    dist.destroy_process_group()
    return results, B * args.seq * ctx.world


def measure_device_rates() -> dict[str, float]:
    """The GPU's dense bf16 matmul rate (FLOP/s) and pinned host<->device copy rates
    (bytes/s), measured here in this run: what MFU and transfer times are quoted against."""
    import torch

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    matmul = 20 * 2 * n**3 / (time.perf_counter() - t0)
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    rates = {"matmul_flops": matmul}
    for name, dst, src in (("h2d_bytes", device, host), ("d2h_bytes", host, device)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(4):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = 4 * src.numel() / (time.perf_counter() - t0)
    del a, b, host, device
    torch.cuda.empty_cache()
    return rates


def report_device_use(ctx, results, n_params, rates) -> None:
    """MFU (6 x parameters x tokens per step, attention not counted) against the measured
    matmul rate; with offload_param, zero3's host<->device bytes per step against the
    measured copy rates."""
    args = ctx.args
    tokens = args.micro_batch * args.seq * ctx.world
    print()
    print(f"Measured in this run: bf16 matmul {rates['matmul_flops'] / 1e12:.0f} TFLOP/s (8192^3), pinned "
          f"copies host->device {rates['h2d_bytes'] / 1e9:.1f} GB/s, device->host {rates['d2h_bytes'] / 1e9:.1f} GB/s")
    for p, r in results.items():
        if r["times"]:
            flops = 6 * n_params * tokens / statistics.median(r["times"])
            print(f"  MFU {p:10s} {flops / 1e12:6.1f} TFLOP/s = {100 * flops / rates['matmul_flops']:.1f}% "
                  "of the measured matmul rate")
    extra = json.loads(args.config_extra) if args.config_extra else {}
    zero = extra.get("zero_optimization", {})
    if zero.get("offload_param", {}).get("device") == "cpu" and results.get("zero3", {}).get("times"):
        up = 2 * 2 * n_params  # 16-bit shards to the GPU in forward and again in backward
        down = 4 * n_params if zero.get("offload_optimizer", {}).get("device") == "cpu" else 0  # fp32 gradients
        floor = up / rates["h2d_bytes"] + down / rates["d2h_bytes"]
        step = statistics.median(results["zero3"]["times"])
        print(f"  zero3 host<->device per step: {up / 1e9:.1f} GB up + {down / 1e9:.1f} GB down = "
              f"{1e3 * floor:.0f} ms at the measured copy rates (one direction at a time), "
              f"{100 * floor / step:.0f}% of its {1e3 * step:.0f} ms step")


def _per_step(stats_list, steps):
    """Per-step calls and bytes, from the first round's deltas (they do not change)."""
    if not stats_list or stats_list[0] is None:
        return None
    s = stats_list[0]
    return {k: (c / steps, b / steps) for k, (c, b) in s.items()}


_SHORT = {"all_gather": "ag", "reduce_scatter": "rs", "all_reduce": "ar", "broadcast": "bc",
          "reduce": "red", "all_to_all": "a2a"}


def report(ctx, peers, results, n_params, backend, versions, loads):
    args = ctx.args
    tokens = args.micro_batch * args.seq * ctx.world
    med = {p: statistics.median(r["times"]) for p, r in results.items() if r["times"]}
    z = med.get("zero3")
    comm_of = {}
    rows, out = [], {"command": " ".join(sys.argv), "world": ctx.world, "backend": backend,
                     "device": args.device, "dtype": args.dtype, "params": n_params,
                     "tokens_per_step": tokens, "versions": versions, "peers": {}}
    for p in peers:
        r = results[p]
        if r["error"] and not r["times"]:
            rows.append([p, "failed: " + r["error"]] + [""] * 7)
            out["peers"][p] = {"error": r["error"]}
            continue
        comm = _per_step(r["own"], args.steps)
        comm_of[p] = comm
        source = "engine"
        if comm is None:
            comm = _per_step(r["seen"], args.steps)
            source = "torch.distributed"
        calls = sum(c for c, _ in comm.values()) if comm else 0
        mib = sum(b for _, b in comm.values()) / 2**20 if comm else 0.0
        detail = ", ".join(f"{_SHORT.get(k, k)} {c:g}/{b / 2**20:.2f}"
                           for k, (c, b) in sorted(comm.items())) if comm else "none"
        peaks = [v for v in r["peak"] if v is not None]
        # Median over rounds: the first peer of round 1 also pays one-time lazy inits.
        peak_b = statistics.median(peaks) if peaks else None
        peak = f"{peak_b / 2**20:.0f}" if peaks else "-"
        m = med[p]
        ratio = f"{z / m:.2f}" if z is not None else "-"
        rows.append([p, f"{m * 1e3:.1f}", f"{min(r['times']) * 1e3:.1f}",
                     f"{tokens / m:,.0f}", peak, f"{calls:g}", f"{mib:.2f}", ratio,
                     f"{statistics.median(r['init']):.2f}"])
        out["peers"][p] = {"median_ms": m * 1e3, "min_ms": min(r["times"]) * 1e3,
                           "tokens_per_s": tokens / m, "peak_mib": peak_b / 2**20
                           if peaks else None, "comm_per_step": comm,
                           "comm_source": source, "zero3_over_peer": z / m if z else None,
                           "init_s": statistics.median(r["init"]),
                           "times_ms": [round(t * 1e3, 2) for t in r["times"]],
                           "round_medians_ms": [round(t * 1e3, 2) for t in r["round_medians"]],
                           "losses": r["losses"], "steps_measured": len(r["times"]),
                           "error": r["error"], "comm_detail": detail, "note": r["note"]}
    mem_label = "peak MiB/rank" + (" (RSS)" if args.device == "cpu" else " (alloc)")
    head = ["peer", "step ms (median)", "min ms", "tokens/s", mem_label,
            "coll calls/step", "coll MiB/step", "zero3/peer", "init s"]
    print()
    print(f"Results: {args.rounds} rounds x {args.steps} measured steps "
          f"(+{args.warmup} warmup), world {ctx.world} ({backend}), {args.device} "
          f"{args.dtype}, {n_params / 1e6:.2f}M params, {tokens} tokens/step")
    print()
    _print_md(head, rows)
    print()
    print("Collectives per step (op calls/MiB):")
    for p in peers:
        d = out["peers"][p]
        if "comm_detail" in d:
            src = d["comm_source"]
            line = f"  {p:10s} {d['comm_detail']}   [{src}]"
            if p == "zero3" and src == "engine":
                seen = _per_step(results[p]["seen"], args.steps) or {}
                line += "; torch.distributed saw: " + (", ".join(
                    f"{_SHORT.get(k, k)} {c:g}/{b / 2**20:.2f}"
                    for k, (c, b) in sorted(seen.items())) or "none")
                own = comm_of.get(p) or {}
                if {k: v for k, v in seen.items() if v[0]} != {k: v for k, v in own.items() if v[0]}:
                    line += "  <- differs from the engine's counters"
            if d.get("note"):
                line += f" ({d['note']})"
            print(line)
    print()
    print("Median step ms per round: " + "; ".join(
        f"{p} " + " ".join(f"{t * 1e3:.1f}" for t in results[p]["round_medians"])
        for p in peers if results[p]["round_medians"]))
    print("Load average (1 min) at start / end: "
          f"{loads[0][0]:.2f} / {loads[1][0]:.2f}  (cores: {os.cpu_count()})")
    out["loadavg_start_end"] = [loads[0][0], loads[1][0]]
    print()
    print("Losses of the first steps (mean over ranks, round 1; step 0 is before any update):")
    first, first_name = None, None
    for p in peers:
        d = out["peers"][p]
        ls = d.get("losses")
        if not ls:
            continue
        if first is None:
            first, first_name = ls, p
        diff = abs(ls[0] - first[0])
        print(f"  {p:10s} " + " ".join(f"{v:.6f}" for v in ls[:args.print_losses])
              + f"   |step0 - {first_name}| = {diff:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\n(wrote {args.json})")
    sys.stdout.flush()


def _print_md(head, rows):
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))


if __name__ == "__main__":
    main()
