"""Consolidated export: fp32 and 16-bit safetensors with the model's own names.

A model with a tied embedding / head, a BatchNorm under fp32 (persistent buffers, one of
them int64), a persistent buffer of its own and a non-persistent one (which a plain
state_dict leaves out) is trained on 2 ranks; its exports load into a plain model with
`load_state_dict(strict=True)` and give the very same outputs as the engine.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from harness import run_ranks
from safetensors.torch import load_file
from torch import nn

VOCAB, WIDTH, MICRO = 11, 8, 6


class ExportNet(nn.Module):
    """BatchNorm under fp32; LayerNorm under bf16 (CPU BatchNorm refuses bf16 weights with
    the fp32 running statistics that DeepSpeed's parameters-only conversion leaves)."""

    def __init__(self, batch_norm: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mix = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH) if batch_norm else nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.embed.weight  # tied: two names, one parameter
        self.register_buffer("scale", torch.tensor(0.5))
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.mix(self.embed(tokens)))
        return self.head(torch.tanh(h) * self.scale.to(h.dtype))


def tokens(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (MICRO,), generator=g), torch.randint(0, VOCAB, (MICRO,), generator=g)


def plain_model(dtype: torch.dtype, batch_norm: bool) -> ExportNet:
    """A fresh plain model laid out as the engine keeps it: parameters in `dtype`,
    buffers in theirs (DeepSpeed converts parameters only)."""
    torch.manual_seed(123)
    model = ExportNet(batch_norm)
    for p in model.parameters():
        p.data = p.data.to(dtype)
    return model


def export_run(rank: int, world: int, root: str, bf16: bool) -> dict:
    import zero3
    from zero3.checkpoint.export import full_fp32_param, save_fp32_model

    torch.manual_seed(0)
    model = ExportNet(batch_norm=not bf16)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                 "stage3_gather_16bit_weights_on_model_save": True}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05),
                                       config=cfg)
    for step in range(3):
        x, y = tokens(10 * step + rank)
        loss = F.cross_entropy(engine(x).float(), y)
        engine.backward(loss)
        engine.step()
    engine.eval()
    probe, _ = tokens(99)
    with torch.no_grad():
        out = engine(probe)
    root = Path(root)
    assert engine.save_16bit_model(root, "model16.safetensors")
    assert save_fp32_model(engine, root, "model32.safetensors")
    engine.save_checkpoint(root / "ckpt", tag="t")
    masters = {n: full_fp32_param(engine, p) for n, p in engine.module.named_parameters()}
    return {"out": out, "masters": masters, "probe": probe,
            "buffers": {n: b.clone() for n, b in engine.module.named_buffers()}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_exports_load_into_a_plain_model_and_give_the_same_outputs(tmp_path, bf16):
    from zero3.checkpoint.format import MODEL_16BIT, read_manifest, verify_checkpoint

    results = run_ranks(export_run, 2, str(tmp_path), bf16)
    r = results[0]  # BatchNorm statistics are per rank (as with DDP); exports hold rank 0's, as DeepSpeed
    dtype = torch.bfloat16 if bf16 else torch.float32
    names = list(ExportNet(batch_norm=not bf16).state_dict())  # embed, mix, norm, head (tied), scale
    sixteen = load_file(tmp_path / "model16.safetensors")
    assert sorted(sixteen) == sorted(names) and "cache" not in sixteen
    assert sixteen["embed.weight"].dtype == dtype and sixteen["scale"].dtype == torch.float32
    if not bf16:
        assert sixteen["norm.running_mean"].dtype == torch.float32
        assert sixteen["norm.num_batches_tracked"].dtype == torch.int64 and sixteen["norm.num_batches_tracked"] == 3
    assert torch.equal(sixteen["head.weight"], sixteen["embed.weight"])
    plain = plain_model(dtype, not bf16)
    plain.load_state_dict(sixteen, strict=True)
    plain.eval()
    with torch.no_grad():
        assert torch.equal(plain(r["probe"]), r["out"])  # the very same outputs
    for name, buffer in r["buffers"].items():
        if name != "cache":
            assert torch.equal(sixteen[name], buffer), name
    # fp32: the fp32 masters, exactly (under bf16 more precise than the 16-bit weights)
    fp32 = load_file(tmp_path / "model32.safetensors")
    assert sorted(fp32) == sorted(names)
    for name, master in r["masters"].items():
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], master), name
    if bf16:
        assert not torch.equal(fp32["mix.weight"].bfloat16().float(), fp32["mix.weight"])
    reference = plain_model(torch.float32, not bf16)
    reference.load_state_dict(fp32, strict=True)
    # gather_16bit_weights_on_model_save: save_checkpoint wrote the same 16-bit file,
    # listed (size, sha256) in the manifest
    folder = tmp_path / "ckpt" / "t"
    assert (folder / MODEL_16BIT).read_bytes() == (tmp_path / "model16.safetensors").read_bytes()
    assert MODEL_16BIT in read_manifest(folder)["files"] and verify_checkpoint(folder) == []


def test_export_streams_one_parameter_at_a_time(tmp_path, monkeypatch):
    """When a parameter is gathered, no earlier gathered value is alive any more."""
    import zero3
    import zero3.checkpoint.export as export

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    engine, _, _, _ = zero3.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                       config={"train_micro_batch_size_per_gpu": 1, "zero_optimization": {
                                           "stage": 3, "stage3_param_persistence_threshold": 0}},
                                       dist_init_required=False)
    original = export.gather_full
    alive: list[weakref.ref] = []
    overlaps = []

    def tracking(model, sp, local):
        overlaps.append(sum(ref() is not None for ref in alive))
        full = original(model, sp, local)
        alive.append(weakref.ref(full))
        return full

    monkeypatch.setattr(export, "gather_full", tracking)
    export.save_consolidated(engine, tmp_path / "m.safetensors")
    assert len(overlaps) == 8 and overlaps == [0] * 8
    state = load_file(tmp_path / "m.safetensors")
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    plain.load_state_dict(state, strict=True)
    with zero3.GatheredParameters(list(engine.module.parameters())):
        for (name, p), q in zip(engine.module.named_parameters(), plain.parameters()):
            assert torch.equal(p.detach().cpu(), q.detach()), name


def test_safetensors_writer_holds_one_tensor_and_matches_the_library(tmp_path):
    from safetensors.torch import save_file

    from zero3.checkpoint.files import TensorSpec, write_safetensors

    values = {"a": torch.arange(6, dtype=torch.float32).view(2, 3), "b": torch.zeros(0),
              "c": torch.tensor(True), "d": torch.arange(5, dtype=torch.bfloat16), "e": torch.tensor([7], dtype=torch.int64)}
    refs: list[weakref.ref] = []

    def produce():
        for value in values.values():
            assert all(ref() is None for ref in refs), "an earlier tensor is still held"
            copy = value.clone()
            refs.append(weakref.ref(copy))
            yield copy
            del copy

    specs = [TensorSpec(k, v.dtype, tuple(v.shape)) for k, v in values.items()]
    digest = write_safetensors(tmp_path / "x.safetensors", specs, produce(), metadata={"format": "pt"})
    loaded = load_file(tmp_path / "x.safetensors")
    assert loaded.keys() == values.keys()
    for key, value in values.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    assert digest["size"] == (tmp_path / "x.safetensors").stat().st_size
    save_file(values, tmp_path / "ref.safetensors")
    assert load_file(tmp_path / "ref.safetensors").keys() == loaded.keys()
    assert not (tmp_path / "x.safetensors.tmp").exists()
