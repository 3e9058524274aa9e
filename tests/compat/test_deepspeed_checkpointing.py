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
    followed by dropout on the RNG tracker's model-parallel state (Megatron's pattern). Each
    checkpoint also takes the head's (sharded) weight as an input, read outside its module:
    cpu_checkpointing leaves a parameter to zero3's own saved-tensor hooks."""

    def __init__(self, checkpointed: bool) -> None:
        super().__init__(dropout=0.2)
        self.checkpointed = checkpointed

    def _block(self, index: int, h: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
        h = self.blocks[index](h) * scale + shift.mean()
        with zero3.checkpointing.get_cuda_rng_tracker().fork():
            return F.dropout(h, 0.1, self.training)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, scale = self.embed(x), torch.full((1,), 1.5)
        for index in range(len(self.blocks)):
            if self.checkpointed:
                h = zero3.checkpointing.checkpoint(self._block, index, h, scale=scale, shift=self.head.weight)
            else:
                h = self._block(index, h, scale, self.head.weight)
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
    assert offload.COUNTS.deferred == calls, offload.COUNTS  # the head's weight: to zero3's safety net
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


# ------------------------------------------------------------------ one process

@pytest.fixture
def fresh_settings():
    settings.reset_to_defaults()
    yield
    settings.reset_to_defaults()


class FakeMpu:
    def __init__(self, size: int) -> None:
        self.size = size

    def get_model_parallel_world_size(self) -> int:
        return self.size

    def get_model_parallel_rank(self) -> int:
        return 0


def test_configure_and_is_configured(fresh_settings, tmp_path):
    assert not zero3.checkpointing.is_configured() and settings.current() == zero3.config.ActivationCheckpointingConfig()
    section = {"cpu_checkpointing": True, "profile": True, "number_checkpoints": 4}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": section}))
    zero3.checkpointing.configure(None, deepspeed_config=str(path), profile=False)
    now = settings.current()
    assert zero3.checkpointing.is_configured()
    assert now.cpu_checkpointing and not now.profile and now.number_checkpoints == 4  # arguments win
    zero3.checkpointing.configure(FakeMpu(1), partition_activations=True)  # a new configure starts from defaults
    assert settings.current().partition_activations and not settings.current().cpu_checkpointing
    settings.apply_engine_config(zero3.config.ActivationCheckpointingConfig(cpu_checkpointing=True))
    assert not settings.current().cpu_checkpointing  # configure() stays the authority over initialize's section
    from zero3.runtime.activation_checkpointing import checkpointing as ds_path
    assert ds_path.configure is zero3.checkpointing.configure and ds_path.checkpoint is zero3.checkpointing.checkpoint


def test_config_section_applies_until_configure(fresh_settings):
    parsed = zero3.config.from_deepspeed({"train_batch_size": 2, "activation_checkpointing": {"profile": "true"}}, 1)
    settings.apply_engine_config(parsed.activation_checkpointing)
    assert settings.current().profile and not zero3.checkpointing.is_configured()
    zero3.checkpointing.configure(None, deepspeed_config=parsed)  # an engine's config reads the same
    assert settings.current().profile and zero3.checkpointing.is_configured()


@pytest.mark.parametrize("call, words", [
    (lambda: zero3.checkpointing.configure(None, checkpoint_in_cpu="yes"), ["checkpoint_in_cpu", "'yes'"]),
    (lambda: zero3.checkpointing.configure(None, num_checkpoints=0), ["num_checkpoints", "0"]),
    (lambda: zero3.checkpointing.configure(None, contiguous_checkpointing=True),
     ["contiguous_memory_optimization", "partition_activations"]),
    (lambda: zero3.checkpointing.configure(None, contiguous_checkpointing=True, partition_activations=True),
     ["number_checkpoints"]),
    (lambda: zero3.checkpointing.configure(FakeMpu(2), partition_activations=True),
     ["partition_activations", "2 ranks"]),
    (lambda: zero3.checkpointing.configure(None, deepspeed_config={"activation_checkpointing": {"profil": True}}),
     ["activation_checkpointing.profil", "profile"]),
    (lambda: zero3.config.from_deepspeed({"train_batch_size": 2, "activation_checkpointing":
                                          {"contiguous_memory_optimization": True, "partition_activations": True}}, 1),
     ["activation_checkpointing.number_checkpoints"]),
    (lambda: zero3.config.from_deepspeed({"train_batch_size": 2,
                                          "activation_checkpointing": {"cpu_checkpointing": "sometimes"}}, 1),
     ["activation_checkpointing.cpu_checkpointing", "sometimes"]),
])
def test_bad_values_are_refused_by_name(fresh_settings, call, words):
    with pytest.raises(zero3.ConfigError) as error:
        call()
    assert all(word in str(error.value) for word in words), str(error.value)
    assert not zero3.checkpointing.is_configured()


def test_tracker_fork_and_seed(fresh_settings):
    tracker = zero3.checkpointing.get_cuda_rng_tracker()
    zero3.checkpointing.model_parallel_cuda_manual_seed(5)
    default = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(default, torch.rand(3))  # the default RNG gets the seed itself
    outside = torch.get_rng_state()
    with tracker.fork():
        tracked = torch.rand(3)
    assert torch.equal(outside, torch.get_rng_state())
    torch.manual_seed(5 + 2718)
    assert torch.equal(tracked, torch.rand(3))  # the model-parallel state: seed + 2718 (tensor-parallel rank 0)
    with pytest.raises(ValueError, match="already added"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(ValueError, match="is not added"):
        with tracker.fork("other"):
            pass


def test_checkpoint_keyword_tensors_and_no_grad(fresh_settings):
    """Tensors passed by keyword get gradients; under no_grad nothing is saved or offloaded."""
    zero3.checkpointing.configure(None, checkpoint_in_cpu=True)
    a, b = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    zero3.checkpointing.checkpoint(lambda x, y=None: (x * y).sin().sum(), a, y=b).backward()
    assert torch.allclose(a.grad, b * (a * b).cos()) and torch.allclose(b.grad, a * (a * b).cos())
    offload.reset_counts()
    with torch.no_grad():
        zero3.checkpointing.checkpoint(lambda x: x * 2, a)
    assert offload.COUNTS.tensors == 0


def test_checkpoint_passes_non_tensor_and_integer_outputs(fresh_settings):
    x = torch.randn(3, requires_grad=True)
    out, nothing, count, mask = zero3.checkpointing.checkpoint(lambda a: (a * 2, None, 3, (a > 0).long()), x)
    assert nothing is None and count == 3 and mask.dtype == torch.long and not mask.requires_grad
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
