"""Ranks tell rank 0 that their background writes are durable, through the c10d store.

An asynchronous save's commit (the manifest, then `latest`) may only happen once every
rank's files are written and fsynced. The writes run in a background thread of each
rank (async_save.py), while the main thread trains and issues the training
collectives. A gloo or NCCL collective from the background thread would interleave with
those, in a different order on different ranks, so the ranks report through the store of
the default process group instead (the TCPStore that torchrun or init_process_group set
up, the one arrival.py checks in with), which is independent of the collectives:

- every rank posts `<base>/files/<rank>`: JSON {"written": {file: {size, sha256}}} or
  {"error": "<what failed, naming the file>"};
- rank 0 polls until every rank has posted (at most `timeout` seconds), commits or
  abandons the save, and posts `<base>/result`: JSON {"error": null or text};
- every other rank polls for the result, then adds 1 to `<base>/read`; rank 0 waits for
  those acknowledgements (so a rank never loses the result because rank 0, which serves
  the store, has exited) and deletes the keys.

Keys are `zero3/async_save/<n>/...`, `n` counting the asynchronous saves of this
process, which are collectives and so numbered alike on every rank. Polling uses short
`check` calls (a blocking `wait` could hold the store client's lock for its whole
duration, stalling the main thread's own use of the store). Nothing is held but the
keys: a few hundred bytes per rank and file, for the duration of one save.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

_PREFIX = "zero3/async_save"
_numbers = itertools.count()  # asynchronous saves started in this process


class BoardTimeout(RuntimeError):
    """The ranks named did not post within the timeout."""


class WriteBoard:
    """One save's exchange of write reports and the commit's result (see the module docstring)."""

    def __init__(self, store: Any, rank: int, world_size: int, timeout: float) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.base = f"{_PREFIX}/{next(_numbers)}"

    def post_files(self, written: dict[str, Any] | None, error: str | None) -> None:
        """This rank's report: the digests of its durable files, or what failed."""
        self._set(f"{self.base}/files/{self.rank}", {"written": written, "error": error})

    def collect_files(self) -> list[dict[str, Any]]:
        """Rank 0: every rank's report, in rank order; BoardTimeout naming the silent ranks."""
        keys = [f"{self.base}/files/{r}" for r in range(self.world_size)]
        self._poll(keys, "report its files")
        return [self._get(key) for key in keys]

    def post_result(self, error: str | None) -> None:
        """Rank 0: the outcome every rank raises (None: committed)."""
        self._set(f"{self.base}/result", {"error": error})

    def await_result(self) -> str | None:
        """Ranks but 0: rank 0's outcome, acknowledged; BoardTimeout if rank 0 is silent."""
        key = f"{self.base}/result"
        self._poll([key], "report the commit")
        error = self._get(key)["error"]
        self.store.add(f"{self.base}/read", 1)
        return error

    def finish(self) -> None:
        """Rank 0: wait until every rank has read the result (bounded), then delete the keys."""
        deadline = time.monotonic() + self.timeout
        while (self.world_size > 1 and self.store.add(f"{self.base}/read", 0) < self.world_size - 1
               and time.monotonic() < deadline):
            time.sleep(0.01)
        keys = [f"{self.base}/files/{r}" for r in range(self.world_size)]
        for key in keys + [f"{self.base}/result", f"{self.base}/read"]:
            self.store.delete_key(key)

    def _poll(self, keys: list[str], what: str) -> None:
        deadline = time.monotonic() + self.timeout
        pause = 0.002
        while not all(self.store.check([key]) for key in keys):
            if time.monotonic() > deadline:
                missing = [key.rsplit("/", 1)[-1] if "/files/" in key else "0" for key in keys
                           if not self.store.check([key])]
                raise BoardTimeout(f"rank(s) {missing} did not {what} within {self.timeout:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _set(self, key: str, value: dict[str, Any]) -> None:
        self.store.set(key, json.dumps(value).encode())

    def _get(self, key: str) -> dict[str, Any]:
        return json.loads(self.store.get(key))
