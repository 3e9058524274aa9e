"""`deepspeed.checkpointing` as zero3.checkpointing: Megatron-style activation checkpointing.

On 2 gloo ranks (one launch): a model whose blocks go through `zero3.checkpointing.checkpoint`
trains under zero3 with the losses and gradients of the same model without checkpointing
(1e-6), with dropout on the default RNG and on the RNG tracker's state, with
cpu_checkpointing, synchronize and profile set by `configure()`, with the config's
`activation_checkpointing` section, and resumes exactly. In one process: configure /
is_configured, the config section read by `configure(deepspeed_config=...)`, DeepSpeed's
module path, and bad values refused with errors naming them.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from common import Net, config, make_batches, two_param_groups
from harness import run_ranks

import zero3
from zero3.checkpointing import function as ckpt_function
from zero3.checkpointing import offload, settings

WORLD, GA, MICRO, STEPS = 2, 2, 4, 3


class CheckpointedNet(Net):
    """common.Net whose blocks run through zero3.checkpointing.checkpoint (or directly), each
    followed by dropout on the RNG tracker's model-parallel state (Megatron's pattern)."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__(dropout=0.2)
        self.checkpointed = checkpointed

    def _block(self, index: int, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        h = self.blocks[index](h) * scale
        with zero3.checkpointing.get_cuda_rng_tracker().fork():
            return F.dropout(h, 0.1, self.training)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, scale = self.embed(x), torch.full((1,), 1.5)
        for index in range(len(self.blocks)):
            if self.checkpointed:
                h = zero3.checkpointing.checkpoint(self._block, index, h, scale=scale)
            else:
                h = self._block(index, h, scale)
        return F.mse_loss(self.head(h), y)


def _engine(rank: int, checkpointed: bool, section: dict | None = None, rng_restore: bool = False):
    torch.manual_seed(0)
    model = CheckpointedNet(checkpointed)
    cfg = config(MICRO, GA)
    if section is not None:
        cfg["activation_checkpointing"] = section
    if rng_restore:
        cfg["checkpoint"] = {"load_rng_state": True}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)), config=cfg)
    return engine


def _seed(rank: int) -> None:
    torch.manual_seed(100 + rank)
    zero3.checkpointing.model_parallel_cuda_manual_seed(7 + rank)


def _train(engine, rank: int, first: int, last: int) -> tuple[list[float], list[torch.Tensor]]:
    """Steps first..last on this rank's batches: every micro-step's loss, and every trainable
    parameter's full gradient at each accumulation boundary (before the step)."""
    batches = make_batches(STEPS * 2 * GA * WORLD, MICRO)
    losses, grads = [], []
    for step in range(first, last):
        for micro in range(GA):
            x, y = batches[(step * GA + micro) * WORLD + rank]
            loss = engine(x, y)
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                grads += [zero3.utils.safe_get_full_grad(p) for p in engine.module.parameters() if p.requires_grad]
            engine.step()
            losses.append(loss.item())
    return losses, grads


def _run(rank: int, checkpointed: bool, section: dict | None = None) -> tuple[list[float], list[torch.Tensor]]:
    engine = _engine(rank, checkpointed, section)
    _seed(rank)
    result = _train(engine, rank, 0, STEPS)
    engine.destroy()
    return result


def _same(a: tuple, b: tuple, what: str) -> None:
    assert torch.allclose(torch.tensor(a[0]), torch.tensor(b[0]), rtol=0, atol=1e-6), (what, a[0], b[0])
    assert len(a[1]) == len(b[1]) > 0
    for x, y in zip(a[1], b[1]):
        assert torch.allclose(x, y, rtol=0, atol=1e-6), (what, (x - y).abs().max())


def _resume(rank: int, folder: str) -> None:
    """Train, save (every rank's tracker states in client_state: the script's to save, as
    Megatron saves them, and zero3 keeps rank 0's client_state), train on; a fresh engine
    loaded from the save gives the same losses bit for bit."""
    section = {"cpu_checkpointing": True}
    engine = _engine(rank, True, section, rng_restore=True)
    _seed(rank)
    _train(engine, rank, 0, 1)
    trackers = [None] * WORLD
    torch.distributed.all_gather_object(trackers, zero3.checkpointing.get_cuda_rng_tracker().get_states())
    engine.save_checkpoint(folder, tag="s1", client_state={"trackers": trackers})
    straight, _ = _train(engine, rank, 1, STEPS)
    engine.destroy()
    engine = _engine(rank, True, section, rng_restore=True)
    _seed(rank + 50)  # other RNG states: the load must restore them
    _, client = engine.load_checkpoint(folder, tag="s1")
    zero3.checkpointing.get_cuda_rng_tracker().set_states(client["trackers"][rank])
    resumed, _ = _train(engine, rank, 1, STEPS)
    engine.destroy()
    assert resumed == straight, (resumed, straight)


def checkpointing_on_ranks(rank: int, world: int, folder: str) -> bool:
    plain = _run(rank, checkpointed=False)
    assert not zero3.checkpointing.is_configured()
    _same(_run(rank, checkpointed=True), plain, "defaults, not configured")
    zero3.checkpointing.configure(None, checkpoint_in_cpu=True, synchronize=True, profile=True)
    offload.reset_counts()
    ckpt_function.PROFILE.clear()
    _same(_run(rank, checkpointed=True), plain, "cpu_checkpointing by configure")
    calls = STEPS * GA * 3  # 3 checkpointed blocks a micro-step
    assert offload.COUNTS.tensors == 2 * calls, offload.COUNTS  # the hidden state and the scale
    phases = [phase for phase, _ in ckpt_function.PROFILE]
    assert phases.count("forward") == calls and phases.count("recomputation") == calls
    settings.reset_to_defaults()
    offload.reset_counts()
    section = {"cpu_checkpointing": True, "partition_activations": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 3, "synchronize_checkpoint_boundary": True}
    _same(_run(rank, checkpointed=True, section=section), plain, "config section")
    assert settings.current().cpu_checkpointing and not zero3.checkpointing.is_configured()
    assert offload.COUNTS.tensors == 2 * calls
    _resume(rank, folder)
    settings.reset_to_defaults()
    return True


def test_checkpointed_blocks_train_as_the_plain_model_and_resume_exactly(tmp_path):
    assert run_ranks(checkpointing_on_ranks, WORLD, str(tmp_path)) == [True] * WORLD
