"""`Monitor`: one destination of training events, each DeepSpeed's tuple (name, value,
step), the step being the global sample count."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

Event = tuple[str, Any, int]


class Monitor(ABC):
    """One destination of training events; owns its writer until `close()`."""

    @abstractmethod
    def write_events(self, event_list: list[Event]) -> None: ...

    def close(self) -> None:
        """Flush and release the writer (default: nothing to do)."""
