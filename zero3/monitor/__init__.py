"""DeepSpeed's monitors (`deepspeed.monitor`): the training events of each optimizer step
written by rank 0 to TensorBoard, CSV files, Weights & Biases or Comet, as the config's
`tensorboard`, `csv_monitor`, `wandb` and `comet` sections say.

- `base.py`: `Monitor` (one destination); `monitor.py`: `MonitorMaster` (all the enabled ones; what
  `engine.monitor` is), with the check that each one's package is installed;
- `events.py`: the events of one optimizer step, with DeepSpeed 0.19.8's names;
- `tensorboard.py`, `csv_monitor.py`, `wandb.py`, `comet.py`: the destinations.
"""

from zero3.monitor.base import Monitor
from zero3.monitor.monitor import MonitorMaster, MonitorUnavailableError

__all__ = ["Monitor", "MonitorMaster", "MonitorUnavailableError"]
