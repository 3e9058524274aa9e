"""Asynchronous saves: training goes on while the files are written, with the same guarantees.

`AsyncCheckpointer.save` (a collective, on the main thread) does, in order:
  1. waits for the previous save of this engine, and raises its error if it failed: at
     most one save is in flight;
  2. step 1 of save_load's commit protocol (`begin_save`): arguments checked, tag agreed
     on, the folder chosen and emptied by rank 0;
  3. takes a consistent snapshot of everything the save writes: the rank's shards,
     masters, optimizer state, saved gradients, buffers (checkpoint/snapshot.py: one host
     buffer, pinned and filled on a side stream from a GPU, complete before the call
     returns), the RNG states and common.pt (counters, scheduler, client_state) as bytes,
     and the manifest's layout (its `files` still empty). With the config's
     gather_16bit_weights_on_model_save the consolidated 16-bit file is written here,
     synchronously: gathering it needs collectives;
  4. starts the rank's writer thread and returns.
The writer thread runs the unchanged steps 2-4: it writes and fsyncs the rank's files from
the snapshot, hashing them on the way; the ranks report to rank 0 through the c10d store
(write_board.py, never a gloo / NCCL collective, which would interleave with training's);
once every rank's files are durable, rank 0 writes the manifest, puts a staging folder in
place and writes `latest` (`commit_manifest`); after a failure it removes the staging
folder (the tag keeps its previous save) and the save is never committed.

The outcome (rank 0's, the same on every rank) is kept. A failure is raised as a
`CheckpointError` naming the rank and the file, on every rank, at the first of: the next
save_checkpoint or load_checkpoint, `wait()` (engine.wait_for_checkpoint), `close()`
(engine.destroy), or, if none of them comes, logged and printed on stderr at process exit
(an exit hook waits for the writer there). A crash or SIGKILL during the write leaves a
folder without a manifest (or the tag's previous save), which no load picks: `latest`
still names the previous checkpoint.

Ahead of the first save, `prepare` (the engine calls it at initialize when
checkpoint.async_save is on, and `engine.prepare_async_checkpoint()` does on demand)
allocates the snapshot buffer and starts the writer thread, so that the first save blocks
no longer than the later ones; it is not a collective.

Memory: the snapshot buffer (the rank's checkpoint bytes, about 14 bytes per parameter
/ world size for bf16 with AdamW, 12 for fp32; pinned when a shard or master is on a GPU,
pageable and written once with zeros otherwise) is held from `prepare`, or else from the
first asynchronous save, until `close()`; nothing else of size. Threads: one writer thread
per engine, started by `prepare` or the first asynchronous save and ended by `close()`; it
owns the snapshot's views while a job runs.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import sys
import threading
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from zero3.checkpoint.arrival import default_store, process_group_timeout
from zero3.checkpoint.errors import CheckpointError
from zero3.checkpoint.export import gather_on_every_rank
from zero3.checkpoint.save_load import (
    RankFiles,
    SaveTarget,
    TrainingState,
    abandon_save,
    begin_save,
    checkpoint_manifest,
    commit_manifest,
    foreseen_rank_tensors,
    merge_kinds,
    rank_files,
    warm_up_rank_files,
    write_16bit_file,
    write_rank_files,
)
from zero3.checkpoint.snapshot import HostSnapshot
from zero3.checkpoint.write_board import WriteBoard

logger = logging.getLogger("zero3")

# How long a writer waits for the other ranks' reports: what a collective waits by default,
# or the process group's own timeout where that is shorter (a synchronous save's collective
# after the writes waits no longer either).
REPORT_TIMEOUT = timedelta(minutes=30).total_seconds()


def report_timeout() -> float:
    """Seconds a writer waits for the other ranks' reports (see REPORT_TIMEOUT)."""
    group = process_group_timeout()
    return min(REPORT_TIMEOUT, group) if group is not None else REPORT_TIMEOUT


@dataclass(eq=False)
class _Job:
    """One save in flight: what its writer thread writes, and its outcome once it ends."""

    target: SaveTarget
    files: RankFiles
    manifest: dict[str, Any] | None  # rank 0's, `files` still empty
    extra_written: dict[str, Any]  # digests of files written on the main thread (16-bit model)
    save_latest: bool
    rank: int
    world_size: int
    board: WriteBoard | None  # None at world size 1
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def describe(self) -> str:
        return f"the asynchronous save of checkpoint {self.target.folder}"


class AsyncCheckpointer:
    """An engine's asynchronous saves: at most one in flight (see the module docstring)."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.snapshot = HostSnapshot()
        self._job: _Job | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None  # the writer, started by the first save
        self._logged_bytes = 0  # the buffer size last logged
        _open.add(self)

    @property
    def in_flight(self) -> str | None:
        """The folder of the save being written now, or None."""
        job = self._job
        return None if job is None or job.done.is_set() else str(job.target.folder)

    def prepare(self, state: TrainingState) -> int:
        """Allocate now the snapshot buffer a save of `state` needs once the optimizer has
        stepped, and start the writer thread, so that the first save blocks no longer than
        the later ones; the buffer's bytes (engine.prepare_async_checkpoint).

        The buffer holds a copy of this rank's shard file: parameter shards, fp32 masters,
        optimizer state (foreseen before the first step: optim/state_probe.py), rank 0's
        buffers; about 14 bytes per parameter / world size in bf16 with AdamW, 12 in fp32,
        what `zero3 estimate --async-checkpoint` counts. It is pinned when a shard or master
        is on a GPU, else pageable with every page written once here (checkpoint/snapshot.py
        `reserve`), and kept until `close()`; a save inside an accumulation window grows it
        by the gradient shards. The first RNG read and pickling of the process are done here
        too. Not a collective; a buffer already big enough is kept. Raises CheckpointError
        when the host cannot hold the buffer (then none is held)."""
        self.wait()
        specs, sources = foreseen_rank_tensors(state)
        held = self.snapshot.reserve(specs, sources, self.rank)
        warm_up_rank_files()
        self._log_buffer()
        self._start_writer()
        return held

    def save(self, state: TrainingState, save_dir, tag, client_state: dict, save_latest: bool,
             exclude_frozen: bool, tag_validation: str, write_16bit_model: bool) -> bool:
        """Snapshot now, write in the background (a collective); True once the snapshot is taken."""
        self.wait()
        comm = state.model.comm
        target = begin_save(state, save_dir, tag, client_state, tag_validation)
        try:
            job = self._prepare(state, target, client_state, save_latest, exclude_frozen, write_16bit_model)
        except CheckpointError:  # raised on every rank alike
            if comm.rank == 0:
                abandon_save(target)
            comm.gather_objects(None)
            raise
        self._start(job)
        return True

    def wait(self) -> None:
        """Return once the save in flight (if any) has ended; raise its error, once, on every rank."""
        job = self._job
        if job is None:
            return
        job.done.wait()
        self._job = None
        if job.error is not None:
            raise CheckpointError(f"{job.describe()} failed and was not committed (a load still picks the "
                                  f"previous checkpoint): {job.error}")

    def close(self) -> None:
        """Wait for the save in flight, free the snapshot buffer; raise the save's error, if any."""
        try:
            self.wait()
        finally:
            if self._thread is not None:
                self._jobs.put(None)
                self._thread.join()
                self._thread = None
            self.snapshot.release()
            _open.discard(self)

    def _prepare(self, state: TrainingState, target: SaveTarget, client_state: dict, save_latest: bool,
                 exclude_frozen: bool, write_16bit_model: bool) -> _Job:
        """Step 3 of the module docstring, on the main thread (collectives allowed here)."""
        comm = state.model.comm
        taken: dict[str, Any] = {}

        def snapshot() -> dict:
            """The snapshot, and on rank 0 the manifest from its own kinds (checked against
            every rank's below); this rank's kinds, to be exchanged."""
            files = rank_files(state, client_state, exclude_frozen)
            views = self.snapshot.take(files.specs, files.tensors, comm.rank)
            taken["files"] = RankFiles(files.specs, [lambda view=view: view for view in views], files.kinds,
                                       files.rng_data, files.common_data)
            if comm.rank == 0:
                taken["manifest"] = checkpoint_manifest(state, target.tag, {}, files.kinds, exclude_frozen)
            return files.kinds

        merge_kinds(gather_on_every_rank(comm, snapshot, CheckpointError))  # raises on every rank alike
        self._log_buffer()
        extra = (write_16bit_file(state, target, exclude_frozen) or {}) if write_16bit_model else {}
        files, manifest = taken["files"], taken.get("manifest")
        board = None
        if comm.world_size > 1:
            board = WriteBoard(default_store(), comm.rank, comm.world_size, report_timeout())
        return _Job(target, files, manifest, extra, save_latest, comm.rank, comm.world_size, board)

    def _start(self, job: _Job) -> None:
        """Hand `job` to the writer thread (started once: starting a thread per save costs
        a scheduling round trip, tens of ms on a busy host, inside the blocking time)."""
        self._job = job
        self._start_writer()
        self._jobs.put(job)

    def _start_writer(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=_writer, args=(self._jobs,), daemon=True,
                                            name=f"zero3-checkpoint-writer-{self.rank}")
            self._thread.start()

    def _log_buffer(self) -> None:
        """Log the buffer's size when it is new (allocated or grown)."""
        if self._logged_bytes != self.snapshot.held_bytes:
            self._logged_bytes = self.snapshot.held_bytes
            logger.info("zero3: rank %d holds a %.2f GiB %s host buffer for asynchronous saves",
                        self.rank, self.snapshot.held_bytes / 2**30,
                        "pinned" if self.snapshot.pinned else "pageable")


def engine_checkpointer(state: TrainingState, prepare: bool) -> AsyncCheckpointer:
    """An engine's asynchronous saves, at initialize; with `prepare` (checkpoint.async_save)
    their buffer allocated and writer started now. A buffer the host cannot hold is left to
    the first save, which then fails on every rank alike before writing anything."""
    comm = state.model.comm
    checkpointer = AsyncCheckpointer(comm.rank, comm.world_size)
    if prepare:
        try:
            checkpointer.prepare(state)
        except CheckpointError as exc:
            logger.warning("zero3: rank %d: no asynchronous-save buffer at initialize: %s", comm.rank, exc)
    return checkpointer


WRITER_NICENESS = 10  # below training's threads (and an overlapped host optimizer step) for the CPU


def _writer(jobs: "queue.SimpleQueue[_Job | None]") -> None:
    """The writer thread's loop: one job at a time, until None. Where the OS allows it, the
    thread runs at a lower CPU priority than training (Linux keeps a niceness per thread),
    so the hashing and copying in the background yield the cores to the step."""
    _lower_own_priority(WRITER_NICENESS)
    while (job := jobs.get()) is not None:
        _write_and_commit(job)


def _write_and_commit(job: _Job) -> None:
    """The writer thread: this rank's files, the reports, and on rank 0 the commit."""
    try:
        written, error = None, None
        try:
            written = write_rank_files(job.files, job.target.write_to, job.rank, job.world_size)
            written.update(job.extra_written)
        except Exception as exc:  # noqa: BLE001 - reported to every rank
            error = _describe(exc)
        if job.board is None:
            job.error = _commit(job, [written]) if error is None else f"on rank 0: {error}"
            if error is not None:
                abandon_save(job.target)
        else:
            job.board.post_files(written, error)
            job.error = _commit_for_all(job) if job.rank == 0 else job.board.await_result()
    except Exception as exc:  # noqa: BLE001 - a store failure, a lost rank 0: still an outcome
        job.error = f"on rank {job.rank}: {_describe(exc)}"
    finally:
        job.done.set()


def _commit_for_all(job: _Job) -> str | None:
    """Rank 0: every rank's report, then the commit or its abandonment; the outcome, posted."""
    board = job.board
    try:
        reports = board.collect_files()
        failed = [(r, report["error"]) for r, report in enumerate(reports) if report["error"] is not None]
        outcome = ("\n".join(f"on rank {r}: {text}" for r, text in failed) if failed
                   else _commit(job, [report["written"] for report in reports]))
    except Exception as exc:  # noqa: BLE001 - a silent rank, a store failure
        outcome = f"on rank 0: {_describe(exc)}"
    if outcome is not None:
        abandon_save(job.target)
    board.post_result(outcome)
    board.finish()
    return outcome


def _commit(job: _Job, all_written: list[dict]) -> str | None:
    """Rank 0: the manifest with every rank's digests, the folder in place, `latest`."""
    files: dict[str, Any] = {}
    for part in all_written:
        files.update(part)
    job.manifest["files"] = dict(sorted(files.items()))
    try:
        commit_manifest(job.target, job.manifest, job.save_latest)
    except Exception as exc:  # noqa: BLE001 - reported to every rank
        abandon_save(job.target)
        return f"on rank 0: {_describe(exc)}"
    return None


def _describe(exc: BaseException) -> str:
    return str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------- at process exit
_open: weakref.WeakSet[AsyncCheckpointer] = weakref.WeakSet()


@atexit.register
def _wait_at_exit() -> None:
    """Finish every save still in flight; an error nobody has seen yet is logged and printed."""
    for checkpointer in list(_open):
        try:
            checkpointer.wait()
        except CheckpointError as exc:
            message = f"zero3: at exit, rank {checkpointer.rank}: {exc}"
            logger.error(message)
            print(message, file=sys.stderr, flush=True)


def _lower_own_priority(increment: int) -> None:
    """Raise the calling thread's niceness by `increment` (Linux: per thread); elsewhere, or
    when refused, leave it: the save is correct either way, only less polite."""
    try:
        thread_id = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, thread_id, os.getpriority(os.PRIO_PROCESS, thread_id) + increment)
    except (AttributeError, OSError):
        pass
