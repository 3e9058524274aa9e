"""Check in before a checkpoint collective: every rank must arrive, or a named error.

`save_checkpoint` and `load_checkpoint` are collectives. Called on some ranks only, they
used to wait in their first collective until the process-group timeout (30 minutes by
default). Before any collective, each rank now checks in through the c10d store of the
default process group (the TCPStore torchrun or init_process_group set up): it sets its
own key and waits, at most `timeout` seconds, for the keys of every other rank. A rank
that does not arrive in time is named in `CheckpointArrivalError` on every rank that did.
The wait never outlasts the default process group's own timeout (`init_process_group(...,
timeout=)`): no rank waits here longer than the user let any collective wait.

Keys are `zero3/arrival/<call>/<n>/<rank>`: `n` counts the calls of that name in this
process, so every rank gives the same call the same key, whatever engine makes it. After
a successful check-in, the last rank to leave deletes the call's keys (a `done` counter
says which rank is last), so the store does not grow. After a timeout a rank deletes its
own key and does not advance its count, so the ranks that were not there still use the
same `n` for their next call. (A rank that arrives in the instant between another rank's
timeout and its key's deletion is let through and meets the usual collective timeout.)

Nothing is held but the store keys: a few bytes per rank for the duration of a check-in.
"""

from __future__ import annotations

import datetime
from collections import Counter

import torch
import torch.distributed as dist

from zero3.checkpoint.errors import CheckpointArrivalError

_PREFIX = "zero3/arrival"
_calls: Counter = Counter()  # call name -> check-ins completed in this process


def default_store():
    """The default process group's c10d store, or None outside torch.distributed."""
    if not dist.is_initialized():
        return None
    return dist.distributed_c10d._get_default_store()


def process_group_timeout() -> float | None:
    """The default process group's collective timeout in seconds (the shortest of its
    backends'), or None when there is none or torch does not say."""
    if not dist.is_initialized():
        return None
    try:
        group = dist.distributed_c10d._get_default_group()
        timeouts = [group._get_backend(torch.device(kind)).options._timeout
                    for kind in group._device_types]
    except (AttributeError, RuntimeError):
        return None
    return min(t.total_seconds() for t in timeouts) if timeouts else None


def check_in(call: str, rank: int, world_size: int, timeout: float, store=None) -> None:
    """Return once every rank has checked in for `call`; CheckpointArrivalError after `timeout`
    seconds, or the process group's timeout where that is shorter."""
    store = store if store is not None else default_store()
    if store is None or world_size == 1:
        return
    group_timeout = process_group_timeout()
    limit = "checkpoint.arrival_timeout"
    if group_timeout is not None and group_timeout < timeout:
        timeout, limit = group_timeout, "the process group's timeout, shorter than checkpoint.arrival_timeout"
    base = f"{_PREFIX}/{call}/{_calls[call]}"
    keys = [f"{base}/{r}" for r in range(world_size)]
    store.set(keys[rank], b"1")
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout))
    except Exception as exc:  # noqa: BLE001 - a timeout (DistStoreError, RuntimeError by version)
        missing = [r for r, key in enumerate(keys) if r != rank and not store.check([key])]
        if missing:  # (if none is missing, they all arrived as the wait ended: go on)
            store.delete_key(keys[rank])
            raise CheckpointArrivalError(
                f"{call} was called on rank {rank}, but rank(s) {missing} of {world_size} did not call it "
                f"within {timeout:g} s ({limit}); it is a collective: call it on every rank, "
                "at the same point of the program (e.g. not under `if rank == 0:`). Nothing was written or loaded"
            ) from exc
    _calls[call] += 1
    if store.add(f"{base}/done", 1) == world_size:
        for key in keys + [f"{base}/done"]:
            store.delete_key(key)
