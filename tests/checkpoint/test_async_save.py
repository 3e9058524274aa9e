"""Asynchronous saves: training goes on during the write, and every guarantee of a save holds.

Launches (each shared by the checks below it):
- `inflight_and_resume` on 2 and on 4 ranks: `engine.prepare_async_checkpoint()` before the
  first step holds the snapshot buffer the saves then use (no save allocates another);
  after 2 steps an asynchronous save of `s2` whose
  commit rank 0 holds back for 3 s (ZERO3_CHECKPOINT_PAUSE=shards-written@0 with
  ZERO3_CHECKPOINT_PAUSE_SECONDS); 2 steps are trained while it is uncommitted; a second
  asynchronous save `s4` is called while `s2` is in flight (it must wait for `s2`'s
  commit); 2 more steps. Fresh engines then load `s2` (exactly the state at step 2,
  although training changed it during the write) and `s4`, and train the same 2 steps:
  losses and parameters bit-identical to the uninterrupted run.
- `write_errors` (2 ranks, checkpoint.async_save in the config): the snapshot buffer is
  held from initialize, as many bytes as the first save's shard file holds (64-byte
  aligned) and what `zero3 estimate` counts, and the first save copies into that buffer
  (the same storage). Then rank 1's file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes
  its background write fail with EFBIG. The error is raised on both ranks, naming rank 1's
  file, at the next save_checkpoint, at wait_for_checkpoint, at destroy, and printed at
  process exit; `latest` still names the good checkpoint, which loads.
- SIGKILL of a rank while its writer thread is paused mid-file, or while rank 0's holds the
  commit, with the main thread training meanwhile: fresh processes load the previous
  checkpoint exactly; the interrupted one is incomplete.
- a full disk (1 MiB tmpfs, root only) during the background write: the error names the
  file at wait_for_checkpoint, no temporary file is left, the previous checkpoint loads.
"""

from __future__ import annotations

import io
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from common import config, make_model, two_param_groups
from harness import join_gloo, run_ranks
from test_checkpoint_faults import MICRO, build_engine, crash_all, load_after_crash, train

os.environ.setdefault("ZERO3_ACCELERATOR", "cpu")

HOLD_SECONDS = 3.0


def _state(engine) -> dict:
    from zero3.checkpoint.export import consolidated_state_dict

    return consolidated_state_dict(engine)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def inflight_and_resume(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    root_path = Path(root)
    marker = root_path.parent / "held.pid"
    engine = build_engine()
    out = {"prepared": engine.prepare_async_checkpoint(), "buffer_at_prepare": _buffer_identity(engine)}
    train(engine, rank, world, 0, 2)
    state_2 = _state(engine)
    os.environ.update({"ZERO3_CHECKPOINT_PAUSE": "shards-written@0", "ZERO3_CHECKPOINT_PAUSE_SECONDS": str(HOLD_SECONDS),
                       "ZERO3_CHECKPOINT_PAUSE_MARKER": str(marker)})
    start = time.perf_counter()
    engine.save_checkpoint(root, tag="s2", async_save=True)
    out["s2_blocked"] = time.perf_counter() - start
    while not marker.exists():  # rank 0's writer holds the commit from here on
        time.sleep(0.01)
    os.environ.pop("ZERO3_CHECKPOINT_PAUSE")
    out["in_flight"] = engine.checkpointer.in_flight
    train(engine, rank, world, 2, 2)
    out["trained_while_uncommitted"] = not (root_path / "s2" / "manifest.json").exists()
    start = time.perf_counter()
    engine.save_checkpoint(root, tag="s4", async_save=True)
    out["s4_waited"] = time.perf_counter() - start
    out["s2_committed_when_s4_returned"] = (root_path / "s2" / "manifest.json").is_file()
    state_4 = _state(engine)
    losses = train(engine, rank, world, 4, 2)
    engine.wait_for_checkpoint()
    out["latest"] = (root_path / "latest").read_text()
    final = _state(engine)
    dist.barrier()
    loaded = build_engine()
    out["load_s2"] = loaded.load_checkpoint(root, tag="s2")[0]
    out["exact_s2"] = _equal(_state(loaded), state_2)
    resumed = build_engine()
    out["load_latest"] = resumed.load_checkpoint(root)[0]
    out["exact_s4"] = _equal(_state(resumed), state_4)
    out["same_losses"] = train(resumed, rank, world, 4, 2) == losses
    out["exact_after"] = _equal(_state(resumed), final)
    out["rank0_holds_state"] = bool(final)
    out["snapshot"] = (engine.checkpointer.snapshot.held_bytes, len(engine.table))
    out["buffer_after_saves"] = _buffer_identity(engine)
    return out


def _buffer_identity(engine) -> tuple[int, int | None]:
    """(bytes held, address of the storage) of the engine's snapshot buffer."""
    buffer = engine.checkpointer.snapshot.buffer
    return engine.checkpointer.snapshot.held_bytes, None if buffer is None else buffer.data_ptr()


def _snapshot_bytes_of(shard_file: Path) -> int:
    """The bytes a snapshot of a shard file's tensors takes: each one's, 64-byte aligned."""
    import json

    from zero3.checkpoint.snapshot import ALIGN

    with open(shard_file, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    spans = [entry["data_offsets"] for key, entry in header.items() if key != "__metadata__"]
    return sum(-(-(end - start) // ALIGN) * ALIGN for start, end in spans)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def inflight(request, tmp_path_factory):
    base = tmp_path_factory.mktemp(f"inflight{request.param}")
    return base, run_ranks(inflight_and_resume, request.param, str(base / "ckpt"), timeout=240)


def test_a_save_returns_before_its_commit_and_training_goes_on(inflight):
    base, results = inflight
    for out in results:
        assert out["in_flight"] == str(base / "ckpt" / "s2")
        assert out["trained_while_uncommitted"], "s2 was committed before 2 steps ran: the save was not asynchronous"
        assert out["s2_blocked"] < HOLD_SECONDS / 2, out


def test_a_second_save_waits_for_the_one_in_flight(inflight):
    _, results = inflight
    for out in results:
        assert out["s2_committed_when_s4_returned"], out
        assert out["latest"] == "s4"


def test_resume_from_an_async_save_is_bit_exact(inflight):
    base, results = inflight
    assert results[0]["rank0_holds_state"]
    for out in results:
        assert out["load_s2"] == str(base / "ckpt" / "s2") and out["exact_s2"]
        assert out["load_latest"] == str(base / "ckpt" / "s4") and out["exact_s4"]
        assert out["same_losses"] and out["exact_after"], out


def test_prepare_async_checkpoint_holds_the_buffer_every_save_uses(inflight):
    _, results = inflight
    for out in results:
        held, address = out["buffer_at_prepare"]
        assert held == out["prepared"] > 0 and address is not None, out["buffer_at_prepare"]
        assert out["buffer_after_saves"] == (held, address), (out["buffer_at_prepare"], out["buffer_after_saves"])


def test_the_estimate_counts_the_snapshot_buffer(inflight):
    from zero3.estimate import estimate_memory

    _, results = inflight
    world = len(results)
    estimate = estimate_memory(make_model(), world, {**config(MICRO, 1), "checkpoint": {"async_save": True}},
                               device_type="cpu")
    assert estimate_memory(make_model(), world, config(MICRO, 1), device_type="cpu").checkpoint_snapshot == 0
    for out in results:
        held, params = out["snapshot"]
        # per tensor: the estimate rounds a shard up to ceil(numel / world) elements, the
        # buffer aligns each of a parameter's (at most 4) tensors to 64 bytes
        assert abs(held - estimate.checkpoint_snapshot) <= params * 4 * 64, (held, estimate.checkpoint_snapshot)
        assert estimate.host_total >= estimate.checkpoint_snapshot > 0


# ------------------------------------------------------------- background write errors
def _failing_writes(rank: int, limit: int | None) -> None:
    """On rank 1, files larger than `limit` bytes fail with EFBIG (None: no limit again)."""
    import resource

    if rank != 1:
        return
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    value = resource.RLIM_INFINITY if limit is None else limit
    resource.setrlimit(resource.RLIMIT_FSIZE, (value, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


def _raised(call) -> str:
    from zero3.checkpoint.errors import CheckpointError

    try:
        call()
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def write_errors(rank: int, world: int, root: str, logs: str) -> dict:
    import zero3
    from zero3.checkpoint.format import shard_file

    stderr = open(Path(logs) / f"stderr{rank}.txt", "w")  # noqa: SIM115 - open until the process exits
    os.dup2(stderr.fileno(), 2)
    model = make_model()
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                  config={**config(MICRO, 1), "checkpoint": {"async_save": True}})
    out = {"buffer_at_initialize": _buffer_identity(engine), "pinned": engine.checkpointer.snapshot.pinned}
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(root, tag="good")
    out["buffer_after_first_save"] = _buffer_identity(engine)
    engine.wait_for_checkpoint()
    out["first_save_bytes"] = _snapshot_bytes_of(Path(root) / "good" / shard_file(rank, world))
    good = _state(engine)
    _failing_writes(rank, 1024)
    out["returned"] = engine.save_checkpoint(root, tag="bad1")  # the config's default: asynchronous
    train(engine, rank, world, 1, 1)
    out["at_next_save"] = _raised(lambda: engine.save_checkpoint(root, tag="next"))
    out["after_next_save"] = sorted(p.name for p in Path(root).iterdir())
    engine.save_checkpoint(root, tag="bad2")
    out["at_wait"] = _raised(engine.wait_for_checkpoint)
    out["raised_once"] = _raised(engine.wait_for_checkpoint)
    out["tmp_left"] = sorted(str(p) for p in Path(root).rglob("*.tmp"))
    _failing_writes(rank, None)
    loaded = build_engine_async()
    out["load"] = loaded.load_checkpoint(root)[0]
    out["exact_good"] = _equal(_state(loaded), good)
    _failing_writes(rank, 1024)
    loaded.save_checkpoint(root, tag="bad3")
    out["at_destroy"] = _raised(loaded.destroy)
    engine.save_checkpoint(root, tag="bad4")  # never waited for: reported at exit
    out["latest"] = (Path(root) / "latest").read_text()
    return out


def build_engine_async():
    import zero3

    model = make_model()
    engine, *_ = zero3.initialize(model=model, optimizer=torch.optim.AdamW(two_param_groups(model)),
                                  config={**config(MICRO, 1), "checkpoint": {"async_save": True}})
    return engine


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    base = tmp_path_factory.mktemp("errors")
    (base / "logs").mkdir()
    results = run_ranks(write_errors, 2, str(base / "ckpt"), str(base / "logs"), timeout=180)
    return base, results


def test_the_buffer_is_held_from_initialize_and_the_first_save_allocates_none(errors):
    from zero3.estimate import estimate_memory

    _, results = errors
    model = make_model()
    estimate = estimate_memory(model, 2, {**config(MICRO, 1), "checkpoint": {"async_save": True}}, device_type="cpu")
    for out in results:
        held, address = out["buffer_at_initialize"]
        assert address is not None and not out["pinned"]
        assert held == out["first_save_bytes"] > 0, (held, out["first_save_bytes"])
        # the estimate rounds each shard up to ceil(numel / world) elements and aligns nothing
        assert abs(held - estimate.checkpoint_snapshot) <= len(list(model.parameters())) * 4 * 64
        assert out["buffer_after_first_save"] == (held, address), out


def test_a_failed_background_write_is_raised_at_the_next_save_on_every_rank(errors):
    base, results = errors
    failed = str(base / "ckpt" / "bad1" / "rank00001-of-00002.safetensors.tmp")
    for out in results:
        assert out["returned"] is True
        message = out["at_next_save"]
        assert "bad1" in message and "was not committed" in message, message
        assert "on rank 1" in message and failed in message and "File too large" in message, message
        assert "next" not in out["after_next_save"], out["after_next_save"]  # the failed call saved nothing


def test_a_failed_background_write_is_raised_at_wait_destroy_and_exit(errors):
    base, results = errors
    for rank, out in enumerate(results):
        assert "bad2" in out["at_wait"] and "File too large" in out["at_wait"], out["at_wait"]
        assert out["raised_once"] == "no error"
        assert "bad3" in out["at_destroy"] and "File too large" in out["at_destroy"], out["at_destroy"]
    # (rank 1's own stderr file is under the same size limit, so rank 0's is the one read)
    printed = (base / "logs" / "stderr0.txt").read_text()
    assert "at exit" in printed and "bad4" in printed and "File too large" in printed, printed[-2000:]


def test_a_failed_background_write_keeps_the_previous_checkpoint(errors):
    base, results = errors
    root = base / "ckpt"
    for out in results:
        assert out["tmp_left"] == []
        assert out["latest"] == "good" and out["load"] == str(root / "good") and out["exact_good"]
    for tag in ("bad1", "bad2", "bad3", "bad4"):
        assert not (root / tag / "manifest.json").exists(), tag


# ------------------------------------------------------------------------ SIGKILL
KILL_SCENARIOS = {"mid-shard": "shard-partial@1", "before-manifest": "shards-written@0"}


def kill_child(rank: int, world: int, port: int, root: str, pause: str, marker: str, _second_tag: str) -> None:
    """Trains on after an asynchronous save whose writer pauses; runs until killed."""

    join_gloo(rank, world, port)
    engine = build_engine()
    train(engine, rank, world, 0, 2)
    engine.save_checkpoint(root, tag="good")
    if rank == 0:
        buffer = io.BytesIO()
        torch.save(_state(engine), buffer)
        (Path(root).parent / "good_state.pt").write_bytes(buffer.getvalue())
    else:
        _state(engine)
    train(engine, rank, world, 2, 1)
    os.environ.update({"ZERO3_CHECKPOINT_PAUSE": pause, "ZERO3_CHECKPOINT_PAUSE_MARKER": marker})
    engine.save_checkpoint(root, tag="bad", async_save=True)
    steps = Path(root).parent / f"steps{rank}"
    for step in range(3, 10_000):  # training goes on while the writer is paused
        train(engine, rank, world, step, 1)
        steps.with_suffix(".tmp").write_text(str(step - 2))
        os.replace(steps.with_suffix(".tmp"), steps)  # whole: the test reads it while this runs
    os._exit(3)


def _steps_written(base: Path) -> bool:
    return all((base / f"steps{r}").exists() for r in range(2))


def _trained_while_writing(base: Path) -> dict:
    return {"trained_while_writing": min(int((base / f"steps{r}").read_text()) for r in range(2))}


def test_sigkill_during_the_background_write_keeps_the_previous_checkpoint(tmp_path):
    seen = crash_all(tmp_path, KILL_SCENARIOS, child=kill_child, ready=_steps_written,
                     before_kill=_trained_while_writing)
    assert seen["mid-shard"]["victim"] == 1 and seen["before-manifest"]["victim"] == 0
    for name, s in seen.items():
        assert s["trained_while_writing"] >= 1, (name, s)  # steps ran after save_checkpoint returned
        assert s["exitcodes"] == [-signal.SIGKILL] * 2, (name, s)
        assert (tmp_path / name / "ckpt" / "latest").read_text() == "good", name
        assert "manifest.json" not in s["files"], (name, s["files"])
    assert "rank00001-of-00002.safetensors.tmp" in seen["mid-shard"]["files"]
    assert {"rank00000-of-00002.safetensors", "rank00001-of-00002.safetensors"} <= set(seen["before-manifest"]["files"])
    for rank, per in enumerate(run_ranks(load_after_crash, 2, str(tmp_path), list(KILL_SCENARIOS))):
        for name, r in per.items():
            assert r["good"]["path"] == str(tmp_path / name / "ckpt" / "good") and r["good"]["steps"] == 2
            assert "is incomplete: it has no manifest.json" in r["bad"], (name, r["bad"])
            if rank == 0:
                good_state = torch.load(tmp_path / name / "good_state.pt", weights_only=True)
                assert _equal(r["good"]["state"], good_state), name


# ---------------------------------------------------------------------- full disk
def full_disk(rank: int, world: int, root: str) -> dict:
    import torch.distributed as dist

    engine = build_engine_async()
    train(engine, rank, world, 0, 1)
    engine.save_checkpoint(root, tag="good")
    engine.wait_for_checkpoint()
    good = _state(engine)
    dist.barrier()
    blob = torch.zeros(512 * 1024)  # 2 MiB of client_state on a 1 MiB disk
    engine.save_checkpoint(root, tag="big", client_state={"blob": blob})
    train(engine, rank, world, 1, 1)
    out = {"at_wait": _raised(engine.wait_for_checkpoint)}
    out["tmp_left"] = sorted(str(p) for p in Path(root).rglob("*.tmp"))
    out["latest"] = (Path(root) / "latest").read_text()
    loaded = build_engine_async()
    out["load"] = loaded.load_checkpoint(root)[0]
    out["exact_good"] = _equal(_state(loaded), good)
    return out


def test_full_disk_during_the_background_write(tmpfs):
    for out in run_ranks(full_disk, 2, str(tmpfs), timeout=120):
        message = out["at_wait"]
        assert "big" in message and "No space left" in message and "common.pt.tmp" in message, message
        assert out["tmp_left"] == [] and out["latest"] == "good"
        assert out["load"] == str(tmpfs / "good") and out["exact_good"]


# ------------------------------------------------------------ how long writers wait
def _report_timeouts(rank: int, world: int) -> float:
    from zero3.checkpoint.async_save import report_timeout

    return report_timeout()


def test_writers_wait_no_longer_than_the_process_group():
    """A writer waiting for a rank that died gives up when a collective would: after the
    process group's timeout (here 8 s), not the 30 minutes of a default collective."""
    assert run_ranks(_report_timeouts, 2, collective_timeout=8.0) == [8.0, 8.0]
