"""The host store of checkpointed layer inputs under a host share, in one process (no engine):
the inputs beyond the share go to NVMe swap files, the earliest layers first, and come back
bit for bit (losses and gradients equal to the store without a share); a forward that does not
fit and has no NVMe tier is refused before anything is copied, saying what to set; the files
are removed at close."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from zero3.sequence.hidden_spill import HiddenSpill, SpillSettings
from zero3.sequence.host_checkpoint import HiddenStatesDoNotFitError, HostStore, checkpoint_on_host

LAYERS, TOKENS, WIDTH = 8, 128, 32
ENTRY_BYTES = TOKENS * WIDTH * 4  # 16 KiB: a multiple of the 4 KiB alignment, so staging is 3 inputs


def _stack(seed: int = 0) -> nn.ModuleList:
    torch.manual_seed(seed)
    return nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.1), nn.Tanh()) for _ in range(LAYERS))


def _run(store: HostStore, steps: int = 2) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two steps through the checkpointed stack (dropout on: the recomputation must draw the
    same masks); the losses and the summed gradients."""
    layers = _stack()
    torch.manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randn(1, TOKENS, WIDTH, requires_grad=True)
        h = x
        for layer in layers:
            h = checkpoint_on_host(layer, layer, h, store)
        loss = (h * torch.linspace(-1, 1, WIDTH)).square().mean()
        loss.backward()
        losses.append(loss.item())
    return losses, {name: p.grad.clone() for name, p in layers.named_parameters()}


def test_inputs_beyond_the_host_share_go_to_nvme_earliest_first_and_come_back_exactly(tmp_path):
    expected_losses, expected_grads = _run(HostStore(LAYERS))
    share = HiddenSpill.staging_bytes(ENTRY_BYTES) + 2 * ENTRY_BYTES  # the staging buffers and two inputs
    store = HostStore(LAYERS, host_bytes=share, spill=SpillSettings(str(tmp_path)))
    losses, grads = _run(store)
    assert store.spill_below == LAYERS - 2, "the host keeps two inputs, the earliest layers' go to NVMe"
    assert store.bytes_spilled == 2 * (LAYERS - 2) * ENTRY_BYTES  # two steps
    assert losses == expected_losses
    for name, grad in grads.items():
        assert torch.equal(grad, expected_grads[name]), name
    folder = store._spill.folder.path
    assert sorted(p.name for p in folder.glob("hidden*.swp")) == [f"hidden{i:05d}.swp" for i in range(LAYERS - 2)]
    assert str(folder).startswith(str(tmp_path / "zero3_swap"))
    store.close()
    assert not folder.exists(), "close() removes the swap folder"


def test_all_inputs_on_nvme_when_the_share_holds_none(tmp_path):
    expected_losses, expected_grads = _run(HostStore(LAYERS))
    store = HostStore(LAYERS, host_bytes=0, spill=SpillSettings(str(tmp_path)))
    losses, grads = _run(store)
    assert store.spill_below == LAYERS
    assert losses == expected_losses
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads)
    store.close()


def test_a_forward_that_does_not_fit_without_nvme_is_a_clear_error():
    store = HostStore(LAYERS, host_bytes=3 * ENTRY_BYTES)
    with pytest.raises(HiddenStatesDoNotFitError) as caught:
        _run(store, steps=1)
    text = str(caught.value)
    assert f"the {LAYERS} checkpointed layer inputs of this forward need" in text
    assert "enough for 3" in text and "long_sequence.nvme_path" in text and "long_sequence.host_bytes" in text


def test_a_missing_nvme_folder_is_named(tmp_path):
    store = HostStore(LAYERS, host_bytes=0, spill=SpillSettings(str(tmp_path / "absent")))
    with pytest.raises(RuntimeError, match=r"long_sequence.nvme_path .*absent.* does not exist"):
        _run(store, steps=1)
