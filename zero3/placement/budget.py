"""The GPU memory budget the planner places state under.

Where the budget comes from (`placement.gpu_budget`, `placement.activation_reserve`):
- a number of bytes: that, on any device (on a CPU run the "device" and the host are one
  memory, but the plan still says which pieces step where);
- "auto" with a stated reserve, on a GPU: the device's capacity at initialize less the
  reserve and a margin, the working set then charged by the planner;
- "auto" with "auto" reserve, on a GPU: measured. The first accumulation window runs under
  a *provisional* budget, half the capacity less the margin with the working set charged
  (what does not fit it is on the host), while the allocator's peak is recorded; at its
  boundary the budget is the capacity less (peak - what was allocated at the window's start)
  - the margin, which leaves the window's activations and working set free, and the plan is
  made (engine_parts/placement.py moves what now fits, and back to the host what the
  provisional plan put on the device beyond it). The second window, under that plan, is
  measured the same way, and where it leaves more room more pieces move to the device,
  none back. The provisional half keeps the first window from holding the whole state in
  host memory (a 6.7B full fine-tune's state all on the host overruns 128 GiB) while
  leaving the other half of the card to its activations; where one micro-batch needs more
  than that, state the reserve (`placement.activation_reserve`) or the budget. A
  provisional budget that cannot hold the working set falls back to the config's placement
  for the first window;
- "auto" on a CPU run, or with nothing offloaded: no budget; the config's placement.

Capacity: the device's free memory plus what this process's caching allocator already
holds, capped by `torch.cuda.set_per_process_memory_fraction` where one is set (as on a
smaller card). Margin: 5% of the capacity, at least 1 GiB (allocator fragmentation, CUDA
workspaces, the optimizer's temporaries).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zero3.config import Zero3Config

GIB = 1 << 30
MARGIN_SHARE = 0.05
MIN_MARGIN = 1 * GIB
PROVISIONAL_SHARE = 0.5


@dataclass(frozen=True)
class BudgetChoice:
    """How the budget is decided: `budget` now (None: none yet or none at all);
    `measure_first`: decided at the end of the first accumulation window instead;
    `charges_working_set`: the planner adds the working set (False when the
    measurement already holds it); `source`: what the budget came from, for the log;
    `reserve`: the device bytes outside the plan the budget leaves for activations (and,
    when measured, the working set): a stated or measured reserve, 0 when unknown. With
    `measure_first`, `budget` is the provisional budget of the first window."""

    budget: int | None
    measure_first: bool
    charges_working_set: bool
    source: str
    reserve: int = 0


def offloads_anything(config: Zero3Config) -> bool:
    zero = config.zero
    return zero.offload_param.enabled or zero.offload_optimizer.enabled


def choose_budget(config: Zero3Config, device: torch.device) -> BudgetChoice:
    """The budget at initialize (module docstring)."""
    placement = config.placement
    if placement.gpu_budget is not None:
        return BudgetChoice(placement.gpu_budget, False, True, "placement.gpu_budget")
    if device.type != "cuda" or not offloads_anything(config):
        why = "compute device is the host" if device.type != "cuda" else "nothing is offloaded"
        return BudgetChoice(None, False, True, why)
    capacity = device_capacity(device)
    if placement.activation_reserve is not None:
        budget = max(capacity - placement.activation_reserve - margin(capacity), 0)
        return BudgetChoice(budget, False, True,
                            f"auto: capacity {capacity / GIB:.2f} GiB less activation_reserve "
                            f"{placement.activation_reserve / GIB:.2f} GiB and margin", placement.activation_reserve)
    return BudgetChoice(provisional_budget(capacity), True, True,
                        f"auto, provisional until the first window is measured: half the capacity "
                        f"{capacity / GIB:.2f} GiB less margin")


def provisional_budget(capacity: int) -> int:
    """The first window's budget under a measured "auto" budget (module docstring)."""
    return max(int(capacity * PROVISIONAL_SHARE) - margin(capacity), 0)


def measured_budget(device: torch.device, peak_allocated: int, allocated_at_start: int) -> BudgetChoice:
    """The budget after a measured window: capacity less that window's activations and
    working set (its peak less what was allocated when it started, the `reserve`) less the
    margin. The working set is in the reserve, so the planner does not charge it.

    Why the start, not the plan's state bytes: state the plan puts on the device is not all
    there through the first window (torch optimizers make their moments at the first step,
    gradient buffers appear during backward), so peak less the plan's bytes would take those
    for room the activations do not use, and the next window, with them allocated, would run
    out of memory (measured: an 8B model at 128K tokens, 10.7 GiB "transient" against 21 GiB
    real). What appears during the window is counted twice instead (in the reserve and in the
    plan): the first plan errs on the safe side, and the second window, measured with all of
    it allocated from its start, widens it."""
    capacity = device_capacity(device)
    transient = max(peak_allocated - allocated_at_start, 0)
    budget = max(capacity - transient - margin(capacity), 0)
    source = (f"auto: capacity {capacity / GIB:.2f} GiB less measured activations and working set "
              f"{transient / GIB:.2f} GiB and margin")
    return BudgetChoice(budget, False, False, source, transient)


def margin(capacity: int) -> int:
    return max(int(capacity * MARGIN_SHARE), MIN_MARGIN)


def device_capacity(device: torch.device) -> int:
    """Bytes this process may allocate on `device` in all: free plus its allocator's
    cached memory, under the per-process memory fraction if one is set."""
    free, total = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)
    fraction = _memory_fraction(device)
    if fraction is not None:
        capacity = min(capacity, int(fraction * total))
    return capacity


def _memory_fraction(device: torch.device) -> float | None:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is None:
        return None
    fraction = float(getter(device))
    return fraction if fraction < 1.0 else None
