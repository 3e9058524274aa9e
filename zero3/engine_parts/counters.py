"""DeepSpeed's progress counters, in one place: owned by the engine, saved by checkpoints.

`micro_steps` counts engine.step() calls; `global_steps` optimizer steps (skipped
overflow steps included, as DeepSpeed 0.19.8); `global_samples` samples by
train_batch_size; `skipped_steps` steps an fp16 overflow skipped. The engine exposes each
under DeepSpeed's attribute name (`engine.global_steps`, ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class StepCounters:
    global_steps: int = 0
    micro_steps: int = 0
    global_samples: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Every counter from `state` (a checkpoint's common state); a missing one is an error."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, int(state[field.name]))
