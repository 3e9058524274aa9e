"""Crash safety with real SIGKILLs, and a save/load soak.

Fault injection: two training processes (gloo) save a good checkpoint, train on, and
start a second save with ZERO3_CHECKPOINT_PAUSE set, so that one chosen process freezes
at a chosen point of the commit protocol and writes its pid to a marker file. The test
waits for the marker, kills that process with SIGKILL (nothing in it runs after that:
no cleanup, no finally), then kills the other one as a launcher would. The points:
  - "shard-partial@1": rank 1 has written its shard file's header and first tensor only;
  - "shards-written@0": every rank's files are committed, the manifest is not written;
  - "manifest-written@0": the manifest is committed, `latest` is not yet updated.
Then fresh processes load the directory: `latest` still names the good checkpoint and it
loads exactly; the interrupted one is reported incomplete (the first two), or is complete
but not `latest` (the third).

The same kills during a save that overwrites the good tag itself (a rolling checkpoint):
the tag keeps its previous save, which loads exactly, at both points.
"""

from __future__ import annotations

import io
import json
import multiprocessing as mp
import os
import signal
import socket
import time
from contextlib import redirect_stdout
from pathlib import Path

import torch
from common import config, make_batches, make_model, two_param_groups
from harness import join_gloo, run_ranks

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

MICRO = 2
SCENARIOS = {
    "mid-shard": "shard-partial@1",
    "before-manifest": "shards-written@0",
    "before-latest": "manifest-written@0",
}
OVERWRITE_SCENARIOS = {
    "overwrite-mid-shard": "shard-partial@1",
    "overwrite-before-swap": "manifest-written@0",
}


def build_engine(width: int = 24, dropout: float = 0.0):
    import zero3

    model = make_model(seed=0, width=width, dropout=dropout)
    optimizer = torch.optim.AdamW(two_param_groups(model))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    engine, _, _, _ = zero3.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                       config=config(MICRO, 1, threshold=30))
    return engine


def train(engine, rank: int, world: int, first: int, count: int) -> list[float]:
    batches = make_batches((first + count) * world, MICRO)
    losses = []
    for step in range(first, first + count):
        x, y = batches[step * world + rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def fault_child(rank: int, world: int, port: int, root: str, pause: str, marker: str, second_tag: str) -> None:
    """Runs in its own process until the test kills it; exit code 3 means no pause happened."""

    from zero3.checkpoint.export import consolidated_state_dict

    join_gloo(rank, world, port)
    engine = build_engine()
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(root, tag="good")
    state = consolidated_state_dict(engine)
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        (Path(root).parent / "good_state.pt").write_bytes(buffer.getvalue())
    train(engine, rank, world, 2, 1)
    os.environ["ZERO3_CHECKPOINT_PAUSE"] = pause
    os.environ["ZERO3_CHECKPOINT_PAUSE_MARKER"] = marker
    engine.save_checkpoint(root, tag=second_tag)
    os._exit(3)


def distinct_ports(count: int) -> list[int]:
    """Free ports, all different (each socket is held until every port is chosen)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def crash_all(tmp_path: Path, scenarios: dict[str, str], second_tag: str = "bad", child=None,
              ready=None, before_kill=None) -> dict[str, dict]:
    """Start every scenario at once, 2 ranks each running child(rank, 2, port, ckpt, pause,
    marker, second_tag) (default fault_child); SIGKILL each at its pause point, once
    `ready(base)` holds too; what was seen, with `before_kill(base)`'s entries."""
    ctx = mp.get_context("spawn")
    running = {}
    ports = distinct_ports(len(scenarios))
    for (name, pause), port in zip(scenarios.items(), ports):
        base = tmp_path / name
        base.mkdir()
        marker = base / "paused.pid"
        procs = [ctx.Process(target=child or fault_child,
                             args=(r, 2, port, str(base / "ckpt"), pause, str(marker), second_tag))
                 for r in range(2)]
        for p in procs:
            p.start()
        running[name] = (procs, marker)
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + 240
    try:
        while len(seen) < len(running):
            for name, (procs, marker) in running.items():
                base = tmp_path / name
                if name in seen:
                    continue
                if marker.exists() and (ready is None or ready(base)):
                    extra = before_kill(base) if before_kill else {}
                    seen[name] = {**kill_at_pause(procs, marker, base / "ckpt"), **extra}
                elif any(p.exitcode is not None for p in procs):
                    raise AssertionError(f"{name}: a process ended before pausing: {[p.exitcode for p in procs]}")
            assert time.monotonic() < deadline, f"no pause reached in time: {sorted(set(running) - set(seen))}"
            time.sleep(0.05)
    finally:
        for procs, _ in running.values():
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
    return seen


def kill_at_pause(procs, marker: Path, root: Path) -> dict:
    pid = int(marker.read_text())
    victim = next(p for p in procs if p.pid == pid)
    bad = root / "bad"
    os.kill(pid, signal.SIGKILL)
    victim.join()
    for p in procs:  # the launcher takes the rest of the job down
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        p.join()
    return {"victim": procs.index(victim), "exitcodes": [p.exitcode for p in procs],
            "files": sorted(p.name for p in bad.iterdir()) if bad.is_dir() else []}


def load_after_crash(rank: int, world: int, base: str, names: list[str]) -> dict:
    import zero3
    from zero3.checkpoint.export import consolidated_state_dict

    out = {}
    for name in names:
        root = Path(base) / name / "ckpt"
        engine = build_engine()
        path, _ = engine.load_checkpoint(str(root))
        good = {"path": path, "steps": engine.global_steps, "state": consolidated_state_dict(engine)}
        try:
            build_engine().load_checkpoint(str(root), tag="bad")
            bad = "loaded"
        except zero3.CheckpointError as exc:
            bad = str(exc)
        out[name] = {"good": good, "bad": bad}
    return out


def cli(*args: str) -> tuple[int, str]:
    from zero3.cli import main

    buffer = io.StringIO()
    with redirect_stdout(buffer):
        code = main(list(args))
    return code, buffer.getvalue()


def test_sigkill_during_save_never_costs_the_last_good_checkpoint(tmp_path):
    seen = crash_all(tmp_path, SCENARIOS)
    assert seen["mid-shard"]["victim"] == 1 and seen["before-manifest"]["victim"] == 0
    for name, s in seen.items():
        assert s["exitcodes"] == [-signal.SIGKILL] * 2, (name, s)
        assert (tmp_path / name / "ckpt" / "latest").read_text() == "good", name
    # the kills landed where intended
    mid = tmp_path / "mid-shard" / "ckpt" / "bad"
    partial = mid / "rank00001-of-00002.safetensors.tmp"
    assert "rank00001-of-00002.safetensors" not in seen["mid-shard"]["files"] and partial.exists()
    header = json.loads(partial.read_bytes()[8:8 + int.from_bytes(partial.read_bytes()[:8], "little")])
    declared = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    assert 8 < partial.stat().st_size < declared  # half written: header, first tensor, no more
    assert "manifest.json" not in seen["before-manifest"]["files"]
    assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors",
            "common.pt"} <= set(seen["before-manifest"]["files"])
    assert "manifest.json" in seen["before-latest"]["files"]

    results = run_ranks(load_after_crash, 2, str(tmp_path), list(SCENARIOS))
    for rank, per in enumerate(results):
        for name, r in per.items():
            good_state = torch.load(tmp_path / name / "good_state.pt", weights_only=True)
            assert r["good"]["path"] == str(tmp_path / name / "ckpt" / "good"), (rank, name)
            assert r["good"]["steps"] == 2
            if rank == 0:  # consolidated weights are gathered to rank 0
                assert r["good"]["state"].keys() == good_state.keys()
                for key, value in good_state.items():
                    assert torch.equal(r["good"]["state"][key], value), (rank, name, key)
            if name == "before-latest":
                assert r["bad"] == "loaded"  # committed, just not `latest` yet
            else:
                assert "is incomplete: it has no manifest.json" in r["bad"], (name, r["bad"])

    for name in SCENARIOS:
        root = tmp_path / name / "ckpt"
        code, text = cli("checkpoint", "inspect", str(root))
        assert code == 0 and "latest: good\n" in text
        good_line = next(line for line in text.splitlines() if line.startswith("good "))
        bad_line = next(line for line in text.splitlines() if line.startswith("bad "))
        assert " yes " in good_line and " 2 " in good_line
        code, text = cli("checkpoint", "verify", str(root), "--tag", "bad")
        if name == "before-latest":
            assert " yes " in bad_line and code == 0 and text.startswith("OK ")
        else:
            assert " NO " in bad_line and "no manifest.json: the save did not finish" in bad_line
            assert code == 1 and "is incomplete" in text
        assert cli("checkpoint", "verify", str(root))[0] == 0  # `latest` and its checkpoint are fine
    assert "half-written: rank00001-of-00002.safetensors.tmp" in cli(
        "checkpoint", "inspect", str(tmp_path / "mid-shard" / "ckpt"))[1]


def test_sigkill_while_overwriting_a_tag_keeps_its_previous_save(tmp_path):
    seen = crash_all(tmp_path, OVERWRITE_SCENARIOS, second_tag="good")
    for name, s in seen.items():
        assert s["exitcodes"] == [-signal.SIGKILL] * 2, (name, s)
        root = tmp_path / name / "ckpt"
        assert (root / "latest").read_text() == "good", name
        staged = sorted(p.name for p in (root / ".good.incoming").iterdir())
        assert (root / "good" / "manifest.json").is_file(), name  # the previous save, still committed
        if name == "overwrite-before-swap":  # the new save is complete, but not yet in the tag's place
            assert "manifest.json" in staged, staged
        else:
            assert "rank00001-of-00002.safetensors.tmp" in staged and "manifest.json" not in staged, staged
    for rank, per in enumerate(run_ranks(load_after_crash, 2, str(tmp_path), list(OVERWRITE_SCENARIOS))):
        for name, r in per.items():
            assert r["good"]["path"] == str(tmp_path / name / "ckpt" / "good"), (rank, name)
            assert r["good"]["steps"] == 2, (rank, name)  # the previous save, not the interrupted one
            if rank == 0:
                good_state = torch.load(tmp_path / name / "good_state.pt", weights_only=True)
                for key, value in good_state.items():
                    assert torch.equal(r["good"]["state"][key], value), (name, key)
    code, text = cli("checkpoint", "inspect", str(tmp_path / "overwrite-before-swap" / "ckpt"))
    assert code == 0 and ".good.incoming" not in text and "latest: good\n" in text


# ------------------------------------------------------------------------ soak
def resources() -> tuple[int, int, int]:
    """(open file descriptors, memory mappings, resident bytes) of this process."""
    fds = len(os.listdir("/proc/self/fd"))
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return fds, maps, rss


def soak(rank: int, world: int, root: str, cycles: int) -> dict:
    import gc

    torch.manual_seed(rank)
    straight = build_engine(width=192, dropout=0.1)
    expected = train(straight, rank, world, 0, cycles)
    straight.destroy()
    del straight
    torch.manual_seed(rank)
    engine = build_engine(width=192, dropout=0.1)
    losses, marks = [], {}
    for cycle in range(cycles):
        losses += train(engine, rank, world, cycle, 1)
        engine.save_checkpoint(root, tag=f"c{cycle % 3}", client_state={"cycle": cycle})
        path, client = engine.load_checkpoint(root)
        assert path.endswith(f"c{cycle % 3}") and client == {"cycle": cycle}
        if cycle in (4, cycles - 1):
            gc.collect()
            marks[cycle] = resources()
    return {"expected": expected, "losses": losses, "marks": marks}


def test_soak_thirty_save_load_cycles_change_nothing_and_leak_nothing(tmp_path):
    cycles = 30
    for rank, r in enumerate(run_ranks(soak, 2, str(tmp_path), cycles, timeout=400)):
        assert r["losses"] == r["expected"], f"rank {rank}: save/load changed the training"
        (fds0, maps0, rss0), (fds1, maps1, rss1) = r["marks"][4], r["marks"][cycles - 1]
        assert fds1 == fds0, f"rank {rank}: open files {fds0} -> {fds1}"
        assert maps1 <= maps0 + 4, f"rank {rank}: memory mappings {maps0} -> {maps1}"
        # one cycle's state is ~0.7 MB per rank: 25 leaked cycles would be ~17 MB
        assert rss1 - rss0 < 6 * 2**20, f"rank {rank}: resident memory grew by {(rss1 - rss0) / 2**20:.1f} MiB"
