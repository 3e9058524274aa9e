"""`zero3.Init()`: parameters partitioned while the model is built.

On 2 real ranks: every parameter built inside the context has an empty storage and this
rank's flat shard once the module that made it is done; code in a parent's `__init__`
that writes a child's (already partitioned) weight still works; the engine adopts the
model and trains it exactly as it trains the same model built normally; and the peak
host memory while building is the shards plus about one parameter, not the model.
"""

from __future__ import annotations

import ctypes
import math

import pytest
import torch
from harness import run_ranks
from torch import nn

WIDTH = 1024  # one Linear weight: 4 MiB in fp32
DEPTH = 24    # the stack: 96 MiB in fp32
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


class Stack(nn.Module):
    """Square bias-free layers, a parent-side re-init of a child weight, a root parameter."""

    def __init__(self, width: int = 16, depth: int = 3, vocab: int = 50) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width, bias=False))
            for _ in range(depth)
        )
        with torch.no_grad():
            self.layers[0][2].weight.mul_(0.5)  # reads and writes a partitioned child weight
        nn.init.zeros_(self.layers[-1][0].bias)
        self.head = nn.Linear(width, vocab)
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        logits = self.head(h * self.scale)
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def zero3_config(threshold: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2,
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": threshold}}


def train(engine, steps: int, rank: int) -> list[float]:
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        loss = engine(torch.randint(0, 50, (2, 9), generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def build_train_compare(rank: int, world: int, threshold: int):
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict
    from zero3.params.init import init_shard_of

    torch.manual_seed(rank)  # different seeds per rank: rank 0's values must win, as without Init
    with zero3.Init():
        model = Stack()
    storage_bytes = sum(p.untyped_storage().nbytes() for p in model.parameters())
    shard_sizes = {n: init_shard_of(p).shard_numel for n, p in model.named_parameters()}
    numels = {n: p.numel() for n, p in model.named_parameters()}
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                  config=zero3_config(threshold))
    initial = consolidated_state_dict(engine)
    losses = train(engine, 3, rank)
    engine.destroy()

    torch.manual_seed(0)  # rank 0's seed: the same initial values, built the ordinary way
    plain = Stack()
    expected = {k: v.clone() for k, v in plain.state_dict().items()}
    engine, *_ = zero3.initialize(model=plain, optimizer=torch.optim.AdamW(plain.parameters(), lr=1e-2),
                                  config=zero3_config(threshold))
    plain_losses = train(engine, 3, rank)
    engine.destroy()
    return {"storage_bytes": storage_bytes, "shard_sizes": shard_sizes, "numels": numels,
            "initial": initial, "expected": expected, "losses": losses, "plain_losses": plain_losses}


@pytest.mark.parametrize("threshold", [0, 100], ids=["all-sharded", "small-resident"])
def test_init_partitions_each_parameter_and_trains_like_a_normal_build(threshold):
    results = run_ranks(build_train_compare, 2, threshold)
    for rank, r in enumerate(results):
        assert r["storage_bytes"] == 0  # nothing full is left after the context
        assert r["shard_sizes"] == {n: math.ceil(numel / 2) for n, numel in r["numels"].items()}
        # rank 0's values (its seed 0) everywhere, including the parent's edits of child weights
        assert bool(r["initial"]) == (rank == 0)  # consolidated on rank 0 only
        assert r["losses"] == r["plain_losses"], (r["losses"], r["plain_losses"])
    initial, expected = results[0]["initial"], results[0]["expected"]
    assert set(initial) == set(expected)
    for name in expected:
        assert torch.equal(initial[name], expected[name]), name
    assert torch.equal(expected["layers.2.0.bias"], torch.zeros(16))


# ------------------------------------------------------------------ peak memory
def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def peak_rss_while(build) -> tuple[object, int]:
    """(build(), the rise of this process's peak RSS during it, in bytes)."""
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    before = _rss_kib("VmRSS:")
    value = build()
    return value, (_rss_kib("VmHWM:") - before) * 1024


def peak_anon_while(build, interval: float = 0.0005) -> tuple[object, int]:
    """(build(), the rise of this process's anonymous resident memory during it, in bytes,
    sampled every `interval` seconds). Unlike VmHWM it leaves out file pages mapped from
    disk (safetensors weights), which the kernel can drop at any time."""
    import threading

    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss_kib("RssAnon:")
    peak = [before]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib("RssAnon:"))
            done.wait(interval)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        value = build()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], _rss_kib("RssAnon:"))
    return value, (peak[0] - before) * 1024


def build_big(rank: int, world: int, with_init: bool):
    import zero3

    # Blocks of 64 KiB and more are mmap'ed and unmapped when freed, so RSS follows the
    # bytes the process holds rather than what the allocator keeps cached.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 64 * 1024)
    torch.manual_seed(0)
    torch.ones(1)  # torch's lazy initialisation outside the measurement

    def build():
        if not with_init:
            return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)))
        with zero3.Init():
            return nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(DEPTH)))

    model, peak = peak_rss_while(build)
    storage = sum(p.untyped_storage().nbytes() for p in model.parameters())
    return {"peak": peak, "storage": storage}


def test_init_peak_memory_is_the_shards_plus_about_one_parameter():
    param_bytes = WIDTH * WIDTH * 4
    model_bytes = DEPTH * param_bytes
    shard_bytes = model_bytes // 2
    built_whole = run_ranks(build_big, 2, False)
    partitioned = run_ranks(build_big, 2, True)
    for r in built_whole:  # the measurement sees a whole model when there is one
        assert r["storage"] == model_bytes and r["peak"] >= 0.95 * model_bytes, r
    for r in partitioned:
        assert r["storage"] == 0
        # this rank's shards, one full parameter being built, a little allocator slack
        assert r["peak"] <= shard_bytes + 2 * param_bytes + 16 * 2**20, (r, shard_bytes)
        assert r["peak"] < 0.7 * model_bytes


def refuse(rank: int, world: int, kwargs: dict) -> str:
    import zero3

    try:
        zero3.Init(**kwargs)
    except Exception as error:  # noqa: BLE001
        return f"{type(error).__name__}: {error}"
    return "accepted"


@pytest.mark.parametrize("kwargs,words", [
    ({"remote_device": "nvme"}, "remote_device='nvme'"),
    ({"mpu": object()}, "mpu"),
    ({"zero_quantized_weights": True}, "quantized"),
])
def test_init_refuses_what_it_cannot_do_on_every_rank(kwargs, words):
    for message in run_ranks(refuse, 2, kwargs):
        assert message.startswith("InitError") and words in message, message


def build_disabled(rank: int, world: int):
    import zero3

    with zero3.Init(enabled=False):
        model = nn.Linear(4, 4)
    return model.weight.untyped_storage().nbytes()


def test_init_disabled_builds_normally():
    assert run_ranks(build_disabled, 2) == [64, 64]
