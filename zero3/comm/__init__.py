"""`deepspeed.comm`'s module-level functions: torch.distributed under DeepSpeed's names.

A thin adapter: nothing here is used by the engine, which issues its collectives through
`zero3.platform.collectives.Communicator`. DeepSpeed's extra keyword arguments
(log_name, prof, debug) are accepted and unused; `configure` and `log_summary` are the
comms logger's (zero3/platform/comms_log.py), which times the engine's own collectives.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from zero3.platform.collectives import all_gather_single, reduce_scatter_single
from zero3.platform.comms_log import COMMS_LOGGER
from zero3.platform.comms_log import log_summary as log_summary_table

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


def configure(deepspeed_config=None, enabled: bool | None = None, prof_all: bool | None = None,
              prof_ops: list[str] | None = None, verbose: bool | None = None, debug: bool | None = None) -> None:
    """DeepSpeed's `comm.configure`: the comms logger's settings (platform/comms_log.py), from
    a config's `comms_logger` section (a dict, a path or a parsed Zero3Config) and/or by keyword."""
    if deepspeed_config is not None:
        from zero3.config import Zero3Config, from_deepspeed

        parsed = deepspeed_config if isinstance(deepspeed_config, Zero3Config) else from_deepspeed(
            deepspeed_config, get_world_size())
        section = parsed.comms_logger
        COMMS_LOGGER.configure(section.enabled, section.verbose, section.prof_all, section.debug, list(section.prof_ops))
    COMMS_LOGGER.configure(enabled, verbose, prof_all, debug, prof_ops)


def log_summary(show_straggler: bool = False) -> None:
    """DeepSpeed's `comm.log_summary()`: rank 0 prints the timed collectives by operation and
    message size (count, latency, algbw and busbw). `show_straggler` is accepted; zero3 times
    each rank's collectives on that rank only."""
    log_summary_table()
