"""DeepSpeed ALST's `UlyssesSPDataLoaderAdapter`: batches cut along the sequence for the
ranks of a sequence-parallel group.

Each rank of the group draws one batch from its own loader; the group shares them (one
all-gather per tensor, padded to the longest sequence and cut back); then, for each of the
`sp` batches in rank order, every rank keeps its own slice of the sequence. So `sp`
consecutive iterations give rank r slice r of batch 0, 1, ..., sp-1, and the group has
processed every rank's batch once: `len(adapter) == len(loader) * sp`.

Labels become `shift_labels` before the cut (`labels[..., 1:]` with -100 appended: each
token's target is the next token, which may live on the next rank) and `labels` is removed,
so the model computes no loss over the slice boundary. Every batch must carry `position_ids`
(each slice's tokens keep their positions in the whole sequence) and have a sequence length
divisible by `sp`; a batch that breaks either is a ValueError naming the fix.

Ownership: the gathered batches are built on `device` and their slices are moved to the
host until handed out (at very long sequences the `sp` queued slices would otherwise take GPU
memory); each batch is moved to `device` as it is handed out, and the caller owns it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


class UlyssesSPDataLoaderAdapter:
    """Wraps `dl`; iterating yields this rank's sequence slice of the group's batches."""

    def __init__(self, dl: Any, sp_rank: int, sp_group: dist.ProcessGroup, sp_world_size: int,
                 device: torch.device | str) -> None:
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = torch.device(device)
        self.iter = iter(dl)
        self.micro_batches: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> "UlyssesSPDataLoaderAdapter":
        return self

    def __next__(self) -> dict:
        if not self.micro_batches:
            self.refill()
        batch = self.micro_batches.popleft()
        return {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def refill(self) -> None:
        """Draw one batch, share it with the group, queue this rank's slices of all of them.
        At the end of the loader the iterator restarts (the next epoch) and StopIteration is
        raised, as DeepSpeed's does."""
        try:
            batch = next(self.iter)
        except StopIteration:
            self.iter = iter(self.dl)
            raise
        _check_batch(batch)
        shared = self._share(batch)
        for one in shared:
            self.micro_batches.append(self._slice(_with_shift_labels(one)))

    def _share(self, batch: dict) -> list[dict]:
        """Every rank's batch of the group, in rank order (tensors padded to the longest
        sequence for the all-gather, then cut back to their own length)."""
        length = torch.tensor([batch["input_ids"].shape[1]], dtype=torch.int64, device=self.device)
        lengths = [torch.zeros_like(length) for _ in range(self.sp_world_size)]
        dist.all_gather(lengths, length, group=self.sp_group)
        lengths = [int(x.item()) for x in lengths]
        longest = max(lengths)
        shared: list[dict] = [{} for _ in range(self.sp_world_size)]
        for key, value in batch.items():
            if torch.is_tensor(value):
                pieces = self._gather_tensor(key, value, longest)
                for rank, piece in enumerate(pieces):
                    shared[rank][key] = piece[:, :lengths[rank]]
            else:
                objects: list[Any] = [None] * self.sp_world_size
                dist.all_gather_object(objects, value, group=self.sp_group)
                for rank, obj in enumerate(objects):
                    shared[rank][key] = obj
        return shared

    def _gather_tensor(self, key: str, value: torch.Tensor, longest: int) -> list[torch.Tensor]:
        value = value.to(self.device)
        padded = torch.zeros((value.shape[0], longest, *value.shape[2:]), dtype=value.dtype, device=self.device)
        padded[:, :value.shape[1]] = value
        pieces = [torch.empty_like(padded) for _ in range(self.sp_world_size)]
        dist.all_gather(pieces, padded, group=self.sp_group)
        return pieces

    def _slice(self, batch: dict) -> dict:
        length = batch["input_ids"].shape[1]
        if length % self.sp_world_size:
            raise ValueError(f"UlyssesSPDataLoaderAdapter: a batch of sequence length {length} does not split over "
                             f"sequence_parallel_size {self.sp_world_size}. Pad every sequence to a multiple of "
                             f"{self.sp_world_size} (the collator's pad_to_multiple_of).")
        chunk = length // self.sp_world_size
        start = chunk * self.sp_rank
        return {k: v[:, start:start + chunk].cpu() if torch.is_tensor(v) else v for k, v in batch.items()}


def _check_batch(batch: Any) -> None:
    if not isinstance(batch, dict) or "input_ids" not in batch:
        raise ValueError("UlyssesSPDataLoaderAdapter: each batch must be a dict with input_ids (got "
                         f"{type(batch).__name__}{'' if not isinstance(batch, dict) else ' with ' + str(sorted(batch))}).")
    if "position_ids" not in batch:
        raise ValueError("UlyssesSPDataLoaderAdapter: each batch needs position_ids, so that every slice keeps "
                         "its tokens' positions in the whole sequence. Add position_ids to the collator's output "
                         "(torch.arange(seq_len) per sample; for packed sequences, restarting at each document).")
    length = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
            raise ValueError(f"UlyssesSPDataLoaderAdapter: {key} has shape {tuple(value.shape)}, and every tensor "
                             f"of a batch must be [batch, seq={length}, ...] like input_ids.")


def _with_shift_labels(batch: dict) -> dict:
    if "labels" not in batch:
        return batch
    batch = dict(batch)
    labels = batch.pop("labels")
    batch["shift_labels"] = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    return batch
