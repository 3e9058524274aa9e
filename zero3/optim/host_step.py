"""A host optimizer step that runs behind the next forward, one sub-group at a time.

With both offloads on the CPU and a CUDA device, the optimizer step is host work (the
update of the fp32 masters and the cast into the 16-bit parameter shards) that takes as
long as the forward and backward together, and the GPU idles through it. `BackgroundStep`
runs that work on one worker thread, sub-group by sub-group in the order the next
forward needs them, while `engine.step()` returns at once: the next forward starts on
the first unit as soon as its sub-group is done, and its host-to-device copies overlap
the update of the units after it.

Who may touch what while a step is in flight (`busy`):
- the worker owns the masters, their `.grad`, the optimizer state and the parameter shards
  of every sub-group not yet published; the host gradient buffer (read by the update);
- everyone else waits first: `wait_for(params)` blocks until the sub-groups holding
  `params` are published (the fetch path, before it copies shards), `wait()` until the
  whole step is (checkpoints, the next backward or step, exports, anything else).

Early tasks (`submit_early`, optim/early_update.py) run on the same worker, in the order
submitted, before a later `start()`'s sub-groups: updates of masters and optimizer state
started in the window's last backward, which write no parameter shard. `wait_step()` waits
for the last `start()`'s step only (the gradient sink's fence: early tasks read gradient
shards that are final and are not overwritten in that backward); `wait()` for both.

Invariants:
- sub-groups run in the order given and each is published (its event set) only after its
  shards hold the new values, so a published sub-group is final for this step;
- the result is the synchronous step's, bit for bit: the same kernels over the same
  tensors, with the hyper-parameters captured before `start()` returned;
- a failure on the worker is re-raised by every later wait, on the caller's thread
  (the step is then partly applied: the engine must be rebuilt from a checkpoint).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from zero3.params.partition import ShardedParam


class HostStepError(RuntimeError):
    """The optimizer step running on the CPU behind the forward failed."""


class BackgroundStep:
    """One worker thread; at most one step in flight."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._events: list[threading.Event] = []
        self._group_of: dict[int, int] = {}  # id(sp) -> index of its sub-group in this step
        self._error: BaseException | None = None
        self._early: list[Future] = []

    @property
    def busy(self) -> bool:
        return self._future is not None

    def start(self, groups: Sequence[Sequence[ShardedParam]], run: Callable[[int], None]) -> None:
        """Run `run(i)` for each sub-group i in order on the worker; returns at once."""
        self.wait()
        self._events = [threading.Event() for _ in groups]
        self._group_of = {id(sp): i for i, group in enumerate(groups) for sp in group}
        self._future = self._worker().submit(self._run_all, run, self._events)

    def submit_early(self, task: Callable[[], None]) -> Future:
        """Run `task` on the worker after what is queued; returns at once. Its failure is
        re-raised by the next `wait()`."""
        future = self._worker().submit(self._run_early, task)
        self._early.append(future)
        return future

    def _worker(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zero3-host-step")
        return self._executor

    def _run_early(self, task: Callable[[], None]) -> None:
        try:
            task()
        except BaseException as exc:  # re-raised on the caller's thread by the next wait
            self._error = exc
            raise

    def _run_all(self, run: Callable[[int], None], events: list[threading.Event]) -> None:
        try:
            for index, event in enumerate(events):
                run(index)
                event.set()
        except BaseException as exc:  # re-raised on the caller's thread by the next wait
            self._error = exc
            raise
        finally:
            for event in events:  # nobody may block forever on a failed step
                event.set()

    def wait_for(self, params: Iterable[ShardedParam]) -> None:
        """Block until every sub-group holding one of `params` is published."""
        if self._future is None:
            self._raise_if_failed()  # an early task's failure, with no step in flight
            return
        last = max((self._group_of.get(id(sp), -1) for sp in params), default=-1)
        if last >= 0:
            self._events[last].wait()  # sub-groups are published in order
        self._raise_if_failed()

    def wait(self) -> None:
        """Block until the step in flight (if any) and every early task are complete."""
        early, self._early = self._early, []
        for future in early:
            try:
                future.result()
            except BaseException:
                pass  # kept in self._error, raised below
        self.wait_step()

    def wait_step(self) -> None:
        """Block until the last `start()`'s step (if any) is complete."""
        if self._future is not None:
            future, self._future = self._future, None
            try:
                future.result()
            except BaseException:
                pass  # kept in self._error, raised below
            self._events = []
            self._group_of = {}
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise HostStepError(
                f"the optimizer step running on the CPU behind the forward failed "
                f"({type(self._error).__name__}: {self._error}); the parameters and optimizer "
                "state are partly updated: rebuild the engine and load the last checkpoint"
            ) from self._error

    def close(self) -> None:
        """Finish the step in flight and stop the worker thread."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None
