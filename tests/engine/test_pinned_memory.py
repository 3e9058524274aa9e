"""zero3/platform/pinned.py: exact-size page-locked host memory.

The registration itself needs CUDA (tests/gpu covers it on the card); what is checked here
is the lifetime the module relies on: the memory under a tensor from `exact_block` stays
valid while any tensor or view of it lives, and the release hook runs exactly once, after
the last one dies and before the mapping goes. And the fallbacks without CUDA.
"""

from __future__ import annotations

import gc

import torch

from zero3.platform.pinned import exact_block, pinned_copy, pinned_empty, pinned_zeros, registered_bytes


def test_release_runs_once_after_the_last_view_dies_and_not_before():
    released = []
    block = exact_block(1 << 20, lambda *args: released.append(args))
    address = torch.frombuffer(block, dtype=torch.uint8).data_ptr()
    tensor = torch.frombuffer(block, dtype=torch.uint8)
    del block
    assert tensor.data_ptr() == address and address % 4096 == 0  # page-aligned, pages of its own
    view = tensor.view(torch.bfloat16)[10:20]
    view.fill_(1.5)
    holder = torch.zeros(3, dtype=torch.bfloat16)
    holder.data = view  # a tensor swapping its storage in, as masters and shards do
    del tensor, view
    gc.collect()
    assert released == [] and holder.sum().item() == 15.0  # still alive, still holding its values
    del holder
    gc.collect()
    assert len(released) == 1 and released[0][1:] == (address, 1 << 20)


def test_without_cuda_the_helpers_make_plain_host_tensors():
    source = torch.arange(6, dtype=torch.float32).view(2, 3)
    copied = pinned_copy(source)
    assert torch.equal(copied, source) and copied.data_ptr() != source.data_ptr()
    assert pinned_zeros(5, torch.bfloat16).eq(0).all() and pinned_empty(4, torch.float32).numel() == 4
    if not torch.cuda.is_available():
        assert registered_bytes() == 0


def test_a_device_context_does_not_move_the_host_buffers():
    with torch.device("meta"):  # models are built under torch.device("cuda") contexts
        assert pinned_empty(3, torch.bfloat16).device.type == "cpu"
        assert pinned_zeros(3, torch.float32).device.type == "cpu"
        assert pinned_copy(torch.ones(2, device="cpu")).device.type == "cpu"
