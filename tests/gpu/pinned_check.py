"""zero3/platform/pinned.py on the card: exact-size registered host memory against torch's
pinned allocator. Prints PASS/FAIL lines and CHECKS PASS/FAIL; run with plain python."""

from __future__ import annotations

import gc

import torch

from zero3.platform.pinned import pinned_copy, pinned_zeros, registered_block_of, registered_bytes

failures = []


def check(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


source = torch.randn(4096, 11008)  # a Llama-7B MLP master, 172 MiB of fp32
exact = pinned_copy(source)
nbytes = source.numel() * 4
check("exact_size", registered_bytes() == nbytes and registered_block_of(exact) and exact.is_pinned(),
      f"registered {registered_bytes()} B for {nbytes} B, pinned {exact.is_pinned()}")
torch_pinned = source.pin_memory()
stats = torch.cuda.memory.host_memory_stats() if hasattr(torch.cuda.memory, "host_memory_stats") else {}
held = stats.get("reserved_bytes.current", stats.get("allocated_bytes.current"))
check("torch_rounds_up", held is None or held >= nbytes, f"torch's host allocator holds {held} B for the same tensor")
device = exact.to("cuda", non_blocking=True)
back = pinned_zeros(source.numel(), torch.float32).view(source.shape)
back.copy_(device, non_blocking=True)
torch.cuda.synchronize()
check("round_trip", torch.equal(back, source), "host -> device -> host, non-blocking, equal")
view = exact[:8]
del exact, back, device
gc.collect()
check("view_keeps_it", registered_bytes() == nbytes and float(view.sum()) == float(source[:8].sum()),
      f"a view alive: {registered_bytes()} B still registered")
del view
gc.collect()
check("released", registered_bytes() == 0, f"after the last view: {registered_bytes()} B registered")
print("CHECKS " + ("PASS" if not failures else "FAIL " + ", ".join(failures)))
