"""`deepspeed.comm`'s module-level functions: torch.distributed under DeepSpeed's names.

A thin adapter: nothing here is used by the engine, which issues its collectives through
`zero3.platform.collectives.Communicator`. DeepSpeed's extra keyword arguments
(log_name, prof, debug) are accepted and unused.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero3.platform.collectives import all_gather_single, reduce_scatter_single

ReduceOp = dist.ReduceOp


def init_distributed(dist_backend: str | None = None, **kwargs) -> None:
    """Join the process group from torchrun's environment (zero3.init_distributed)."""
    from zero3.platform.process_group import init_distributed as _init

    _init(dist_backend, **kwargs)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def is_available() -> bool:
    return dist.is_available()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def get_local_rank() -> int:
    """This process's index on its node (torchrun's LOCAL_RANK)."""
    from zero3.platform.device import local_rank

    return local_rank()


def get_global_rank(group, group_rank: int) -> int:
    return dist.get_global_rank(group, group_rank)


def get_world_group():
    return dist.group.WORLD


def new_group(ranks=None, **kwargs):
    return dist.new_group(ranks=ranks, **kwargs)


def destroy_process_group(group=None) -> None:
    dist.destroy_process_group(group)


def barrier(group=None, async_op: bool = False, device_ids=None, **_):
    return dist.barrier(group=group, async_op=async_op, device_ids=device_ids)


def monitored_barrier(group=None, timeout=None, wait_all_ranks: bool = False):
    return dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=wait_all_ranks)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False, **_):
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None, async_op: bool = False, **_):
    return dist.reduce(tensor, dst, op=op, group=group, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, group=None, async_op: bool = False, **_):
    return dist.broadcast(tensor, src, group=group, async_op=async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False, **_):
    return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, group=None,
                           async_op: bool = False, **_):
    return all_gather_single(output_tensor, tensor, group=group, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False, **_):
    return dist.reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)


def reduce_scatter_tensor(output_tensor: torch.Tensor, tensor: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False, **_):
    return reduce_scatter_single(output_tensor, tensor, op=op, group=group, async_op=async_op)


def all_to_all_single(output: torch.Tensor, tensor: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False, **_):
    return dist.all_to_all_single(output, tensor, output_split_sizes=output_split_sizes,
                                  input_split_sizes=input_split_sizes, group=group, async_op=async_op)


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None, async_op: bool = False, **_):
    return dist.gather(tensor, gather_list=gather_list, dst=dst, group=group, async_op=async_op)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None, async_op: bool = False, **_):
    return dist.scatter(tensor, scatter_list=scatter_list, src=src, group=group, async_op=async_op)


def send(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, **_):
    return dist.send(tensor, dst, group=group, tag=tag)


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, **_):
    return dist.recv(tensor, src, group=group, tag=tag)


def isend(tensor: torch.Tensor, dst: int, group=None, tag: int = 0, **_):
    return dist.isend(tensor, dst, group=group, tag=tag)


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0, **_):
    return dist.irecv(tensor, src, group=group, tag=tag)


def all_gather_object(object_list: list, obj: object, group=None) -> None:
    dist.all_gather_object(object_list, obj, group=group)


def broadcast_object_list(object_list: list, src: int = 0, group=None, device=None) -> None:
    dist.broadcast_object_list(object_list, src=src, group=group, device=device)
