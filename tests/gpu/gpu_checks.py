"""CUDA checks for one GPU (run through torchrun on a machine with CUDA; not part of CI).

    torchrun --standalone --nproc_per_node=1 tests/gpu/gpu_checks.py

1. fp32 parity with plain PyTorch on CUDA (NCCL process group, world size 1).
2. bf16 with offload_param and offload_optimizer to pinned host memory: shards and
   masters are pinned, training tracks the fp32 reference.
3. Bit-exact resume on CUDA.
4. Host-to-device bandwidth of gathering offloaded parameters against the machine's
   measured pinned copy bandwidth.
5. With both offloads on, the GPU holds exactly the resident parameters after a step
   (parameters, gradients and optimizer state otherwise in host memory), and training
   gives the same losses as without offload.
6. Prefetch on the side stream (world size 1: the shard-to-device copies) changes no
   result: losses equal those of prefetch off, bit for bit.
7. The CPU optimizer step (fused AdamW over host fp32 shards) against the host memory
   traffic it needs (7 fp32 streams per element) at the measured copy bandwidth.
8. A released CUDA parameter (offload_param) is sealed: user code touching its values
   between steps gets ReleasedParameterError, nothing changes, training goes on, and
   GatheredParameters gives its values.
Prints one line per check and a final CHECKS_PASSED / CHECKS_FAILED.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import config, make_batches, make_model, two_param_groups  # noqa: E402

import zero3  # noqa: E402
from zero3.checkpoint.export import consolidated_state_dict  # noqa: E402

DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
MICRO = 4
failures: list[str] = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def reference(steps: int, lr: float):
    model = make_model().to(DEVICE)
    opt = torch.optim.AdamW(two_param_groups(model, lr))
    losses = []
    for x, y in make_batches(steps, MICRO)[:steps]:
        loss = model(x.to(DEVICE), y.to(DEVICE))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def zero3_run(steps: int, lr: float, extra: dict | None = None, engine_out: list | None = None):
    cfg = config(MICRO, 1, threshold=30)
    for key, value in (extra or {}).items():
        if key == "zero_optimization":
            cfg[key].update(value)
        else:
            cfg[key] = value
    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, lr)), config=cfg)
    losses = []
    for x, y in make_batches(steps, MICRO)[:steps]:
        dtype = engine.compute_dtype
        loss = engine(x.to(DEVICE, dtype), y.to(DEVICE, dtype))
        engine.backward(loss)
        engine.step()
        losses.append(loss.float().item())
    if engine_out is not None:
        engine_out.append(engine)
    return losses, consolidated_state_dict(engine)


def check_parity() -> None:
    ref_losses, ref_state = reference(6, 1e-2)
    losses, state = zero3_run(6, 1e-2)
    worst = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
    params = max((state[k].float() - v.float()).abs().max().item() for k, v in ref_state.items())
    check("fp32 parity on CUDA", worst < 1e-5 and params < 1e-5,
          f"max relative loss difference {worst:.2e}, max param difference {params:.2e}")


def check_bf16_offload() -> None:
    ref_losses, _ = reference(20, 1e-3)
    engines: list = []
    offload = {"bf16": {"enabled": True},
               "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    losses, _ = zero3_run(20, 1e-3, offload, engines)
    engine = engines[0]
    pinned = all(sp.shard.is_pinned() for sp in engine.table.values()) and all(
        m.is_pinned() for m in engine.optimizer.masters)
    worst = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(losses, ref_losses))
    held = engine.sharded_bytes()
    on_gpu = torch.cuda.memory_allocated(DEVICE)
    check("bf16 + pinned offload tracks fp32", pinned and worst < 2e-2,
          f"pinned={pinned}, max deviation {worst:.2e} over 20 steps, host-held {held}, GPU allocated {on_gpu} B")


def check_resume() -> None:
    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(5)
        straight, _ = zero3_run(6, 1e-2)
        torch.manual_seed(5)
        engines: list = []
        first, _ = zero3_run(3, 1e-2, None, engines)
        engines[0].save_checkpoint(folder)
        engines[0].destroy()
        model = make_model(seed=9)
        engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, 1e-2)),
                                           config=config(MICRO, 1, threshold=30))
        engine.load_checkpoint(folder)
        resumed = []
        for x, y in make_batches(6, MICRO)[3:6]:
            loss = engine(x.to(DEVICE), y.to(DEVICE))
            engine.backward(loss)
            engine.step()
            resumed.append(loss.item())
        check("bit-exact resume on CUDA", first + resumed == straight, f"{first + resumed} vs {straight}")


class Wide(torch.nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().square().mean()


def round_up(nbytes: int, block: int = 512) -> int:
    return (nbytes + block - 1) // block * block


def check_offload_device_bytes() -> None:
    offload = {"bf16": {"enabled": True},
               "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}}}
    gc.collect()  # engines of earlier checks (reference cycles) must not be freed inside the measurement
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(DEVICE)
    engines: list = []
    losses, _ = zero3_run(8, 1e-3, offload, engines)
    engine = engines.pop()
    torch.cuda.synchronize()
    on_gpu = torch.cuda.memory_allocated(DEVICE) - baseline
    resident = [sp for sp in engine.table.values() if sp.persistent]
    expected = sum(round_up(sp.numel * 2) for sp in resident)  # bf16, one allocation each
    grads_on_gpu = sum(sp.grad_shard.numel() for sp in engine.table.values()
                       if sp.grad_shard is not None and sp.grad_shard.is_cuda)
    state_on_gpu = sum(t.numel() for st in engine.optimizer.optimizer.state.values() for t in st.values()
                       if isinstance(t, torch.Tensor) and t.is_cuda)
    masters_on_gpu = sum(m.numel() for m in engine.optimizer.masters if m.is_cuda)
    shards_on_gpu = sum(sp.shard.numel() for sp in engine.table.values() if sp.shard.is_cuda)
    del engine
    plain, _ = zero3_run(8, 1e-3, {"bf16": {"enabled": True}})
    worst = max(abs(a - b) / max(abs(b), 1.0) for a, b in zip(losses, plain))
    ok = (on_gpu == expected and grads_on_gpu == 0 and state_on_gpu == 0 and masters_on_gpu == 0
          and shards_on_gpu == 0 and worst < 1e-2)
    check("both offloads: GPU holds only the resident parameters", ok,
          f"GPU bytes after a step {on_gpu} (expected {expected}: {len(resident)} resident bf16 parameters), "
          f"on GPU: shards {shards_on_gpu}, grad shards {grads_on_gpu}, masters {masters_on_gpu}, optimizer "
          f"state {state_on_gpu} elements; losses vs no offload: max relative difference {worst:.2e}")


def check_overlapped_host_step() -> None:
    """Both offloads, clipping on: the CPU update run behind the next forward gives the
    synchronous step's losses and weights bit for bit."""
    def run(overlap: bool):
        extra = {"bf16": {"enabled": True}, "gradient_clipping": 1.0,
                 "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                                       "offload_optimizer": {"device": "cpu", "pin_memory": True,
                                                             "overlap_step": overlap}}}
        engines: list = []
        losses, state = zero3_run(8, 1e-3, extra, engines)
        return losses, state, engines.pop().optimizer.unit_order is not None
    sync_losses, sync_state, sync_overlapped = run(False)
    losses, state, overlapped = run(True)
    same = losses == sync_losses and all(torch.equal(state[k], sync_state[k]) for k in sync_state)
    check("overlapped host step is bit-exact", same and overlapped and not sync_overlapped,
          f"overlap on/off in effect: {overlapped}/{sync_overlapped}; losses equal: {losses == sync_losses}; "
          f"last loss {losses[-1]:.6f} vs {sync_losses[-1]:.6f}")


def check_overflow_skipped_in_kernel() -> None:
    """bf16 overflow checking on the GPU decides the skip inside the fused AdamW kernel (no
    host sync before the update): an inf loss leaves masters and moments untouched and
    counts one skipped step; training goes on."""
    cfg = config(MICRO, 1, threshold=30)
    cfg["bf16"] = {"enabled": True}
    model = make_model()
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model, 1e-3)),
                                       config=cfg)
    opt = engine.optimizer
    in_kernel = False
    before = after = None
    losses = []
    for step, (x, y) in enumerate(make_batches(6, MICRO)):
        loss = engine(x.to(DEVICE, torch.bfloat16), y.to(DEVICE, torch.bfloat16))
        if step == 3:
            loss = loss * float("inf")
            before = [m.clone() for m in opt.masters] + [t.clone() for st in opt.optimizer.state.values()
                                                         for t in st.values()]
        engine.backward(loss)
        if step == 3:
            in_kernel = opt._skips_in_kernel(torch.zeros(1, device=DEVICE))
        engine.step()
        if step == 3:
            after = [m.clone() for m in opt.masters] + [t.clone() for st in opt.optimizer.state.values()
                                                        for t in st.values()]
        losses.append(loss.float().item())
    unchanged = all(torch.equal(a, b) for a, b in zip(before, after))
    finite_after = all(math.isfinite(v) for v in losses[4:])
    check("overflow skipped inside the fused kernel", in_kernel and unchanged and engine.skipped_steps == 1
          and finite_after, f"in kernel: {in_kernel}; masters and state unchanged by the inf step: {unchanged}; "
          f"skipped {engine.skipped_steps}; losses after {[round(v, 4) for v in losses[4:]]}")


def check_prefetch_exact() -> None:
    offload = {"bf16": {"enabled": True},
               "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}}
    off = {"bf16": {"enabled": True},
           "zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True},
                                 "stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0}}
    engines: list = []
    with_prefetch, _ = zero3_run(8, 1e-3, offload, engines)
    prefetched = engines[0].fetcher.prefetched_units
    without, _ = zero3_run(8, 1e-3, off)
    check("prefetch on the side stream is exact", with_prefetch == without and prefetched > 0,
          f"{prefetched} units prefetched; losses equal: {with_prefetch == without}")


def measure_cpu_optimizer() -> None:
    n = 100_000_000
    threads = torch.get_num_threads()
    params = [torch.zeros(n, dtype=torch.float32, requires_grad=True)]
    params[0].grad = torch.randn(n)
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True)
    optimizer.step()
    start = time.perf_counter()
    for _ in range(3):
        optimizer.step()
    step = (time.perf_counter() - start) / 3
    a, b = torch.empty(n * 2), torch.empty(n * 2)
    b.copy_(a)
    start = time.perf_counter()
    for _ in range(3):
        b.copy_(a)
    copy_rate = 3 * 2 * a.numel() * 4 / (time.perf_counter() - start)  # read + write
    traffic = 7 * 4 * n
    check("CPU fused AdamW step vs host memory traffic", True,
          f"{n / 1e6:.0f}M fp32 elements, {threads} threads: {step * 1e3:.0f} ms per step; needs {traffic / 1e9:.1f} GB "
          f"of memory traffic = {traffic / step / 1e9:.1f} GB/s against a measured copy rate of "
          f"{copy_rate / 1e9:.1f} GB/s ({traffic / step / copy_rate:.2f} of it)")


def check_offload_bandwidth() -> None:
    size = 1 << 30
    host = torch.empty(size, dtype=torch.uint8).pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device=DEVICE)
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    copy_rate = 10 * size / (time.perf_counter() - start)
    del host, dev
    width, depth = 8192, 8
    torch.manual_seed(0)
    model = Wide(width, depth).to(torch.bfloat16)
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}
    engine, _, _, _ = zero3.initialize(model=model, config=cfg)
    x = torch.randn(1, width, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(2):
            engine(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(5):
            engine(x)
        torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / 5
    moved = sum(sp.shard.numel() * sp.shard.element_size() for sp in engine.table.values())
    rate = moved / elapsed
    check("offloaded gather bandwidth", rate > 0.3 * copy_rate,
          f"{moved / 1e9:.2f} GB of shards per forward in {elapsed * 1e3:.1f} ms = {rate / 1e9:.1f} GB/s; "
          f"pinned copy {copy_rate / 1e9:.1f} GB/s; ratio {rate / copy_rate:.2f}")


def check_sealed_on_cuda() -> None:
    from zero3.params.released import ReleasedParameterError

    engines: list = []
    offload = {"zero_optimization": {"offload_param": {"device": "cpu", "pin_memory": True}}}
    losses, before = zero3_run(2, 1e-2, offload, engines)
    engine = engines[0]
    weight = engine.module.embed.weight
    refused = []
    for name, call in (("sum", lambda: weight.sum()), ("add_", lambda: weight.data.add_(1.0)),
                       ("half", lambda: engine.module.half()), ("cpu", lambda: weight.cpu())):
        try:
            call()
        except ReleasedParameterError:
            refused.append(name)
    moves = []
    for name, call in (("module.cuda()", lambda: engine.module.cuda()), ("module.to(device)", lambda: engine.module.to(DEVICE)),
                       ("weight.cuda()", lambda: weight.cuda())):
        try:
            call()
            moves.append(name)
        except ReleasedParameterError:
            pass
    with zero3.GatheredParameters([weight]):
        same = torch.equal(weight.detach().cpu(), before["embed.weight"])
    x, y = make_batches(3, MICRO)[2]
    loss = engine(x.to(DEVICE), y.to(DEVICE))
    engine.backward(loss)
    engine.step()
    ok = refused == ["sum", "add_", "half", "cpu"] and len(moves) == 3 and same and math.isfinite(loss.item())
    check("sealed CUDA parameter", ok, f"refused {refused}, no-op moves allowed {moves}, values unchanged {same}, "
          f"next loss {loss.item():.4f}, device {weight.device}")


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.cuda.set_device(DEVICE)
    zero3.init_distributed(dist_backend="nccl")
    for fn in (check_parity, check_bf16_offload, check_resume, check_offload_bandwidth,
               check_offload_device_bytes, check_overlapped_host_step, check_overflow_skipped_in_kernel,
               check_prefetch_exact, measure_cpu_optimizer, check_sealed_on_cuda):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - report and go on with the other checks
            import traceback

            traceback.print_exc()
            check(fn.__name__, False, f"raised {type(exc).__name__}: {exc}")
    print("CHECKS_FAILED: " + ", ".join(failures) if failures else "CHECKS_PASSED", flush=True)


if __name__ == "__main__":
    main()
