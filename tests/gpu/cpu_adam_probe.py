"""Host-side optimizer costs on the GPU machine (diagnostics, not CI).

    python3 tests/gpu/cpu_adam_probe.py [--numel 500e6]

Times torch's fused CPU AdamW over fp32 tensors the size of a 3B model's largest ones,
the fp32 -> bf16 write-back into pinned memory, both interleaved per tensor, the same
with fewer intra-op threads, and AdamW while host<->device copies run at the same time
(the contention an optimizer step overlapped with transfers would meet).
"""

from __future__ import annotations

import argparse
import threading
import time

import torch


def timed(fn, repeat: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=float, default=500e6)
    args = parser.parse_args()
    per = 25_165_824  # 3072 x 8192
    count = max(1, int(args.numel) // per)
    numel = count * per
    params = [torch.randn(per, pin_memory=True) for _ in range(count)]
    grads = [torch.randn(per, pin_memory=True) for _ in range(count)]
    shards = [torch.empty(per, dtype=torch.bfloat16, pin_memory=True) for _ in range(count)]
    for p, g in zip(params, grads):
        p.grad = g
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    opt.step()
    threads = torch.get_num_threads()
    scale = 100e6 / numel

    adam = timed(opt.step)
    write = timed(lambda: torch._foreach_copy_(shards, params))

    def interleaved():
        for i, p in enumerate(params):
            for q in params:
                q.grad = None
            p.grad = grads[i]
            opt.step()
            shards[i].copy_(p)
        for p, g in zip(params, grads):
            p.grad = g
    inter = timed(interleaved)
    print(f"{numel / 1e6:.0f}M fp32 elements, {threads} threads: fused AdamW {1e3 * adam * scale:.1f} ms/100M "
          f"({28 * numel / adam / 1e9:.0f} GB/s at 28 B/elem), write-back {1e3 * write * scale:.1f} ms/100M "
          f"({6 * numel / write / 1e9:.0f} GB/s at 6 B/elem), per tensor AdamW+write-back "
          f"{1e3 * inter * scale:.1f} ms/100M (separate: {1e3 * (adam + write) * scale:.1f})", flush=True)
    for n in (threads // 2, max(1, threads - 2)):
        torch.set_num_threads(n)
        print(f"  {n} threads: fused AdamW {1e3 * timed(opt.step) * scale:.1f} ms/100M, write-back "
              f"{1e3 * timed(lambda: torch._foreach_copy_(shards, params)) * scale:.1f} ms/100M", flush=True)
    torch.set_num_threads(threads)

    if torch.cuda.is_available():
        device_buf = torch.empty(numel, dtype=torch.bfloat16, device="cuda")
        host_src = torch.empty(numel, dtype=torch.bfloat16, pin_memory=True)
        device_grad = torch.empty(numel // 2, dtype=torch.float32, device="cuda")
        host_dst = torch.empty(numel // 2, dtype=torch.float32, pin_memory=True)
        up, down = torch.cuda.Stream(), torch.cuda.Stream()

        def copies(rounds: int) -> None:
            for _ in range(rounds):
                with torch.cuda.stream(up):
                    device_buf.copy_(host_src, non_blocking=True)
                with torch.cuda.stream(down):
                    host_dst.copy_(device_grad, non_blocking=True)
            torch.cuda.synchronize()
        copy_alone = timed(lambda: copies(4), repeat=2)
        moved = 4 * (2 * numel + 4 * numel // 2)
        print(f"  H2D+D2H alone: {moved / copy_alone / 1e9:.1f} GB/s both directions together", flush=True)
        stop = threading.Event()
        done_rounds = [0]

        def background() -> None:
            while not stop.is_set():
                copies(1)
                done_rounds[0] += 1
        worker = threading.Thread(target=background)
        t0 = time.perf_counter()
        worker.start()
        during = timed(opt.step, repeat=2)
        stop.set()
        worker.join()
        elapsed = time.perf_counter() - t0
        print(f"  fused AdamW during copies: {1e3 * during * scale:.1f} ms/100M; copies meanwhile "
              f"{done_rounds[0] * moved / 4 / elapsed / 1e9:.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
