"""TensorBoard events under `<output_path>/<job_name>/` (torch.utils.tensorboard's writer),
flushed after each step's events, as DeepSpeed's TensorBoardMonitor."""

from __future__ import annotations

import os

from zero3.config import FileMonitorConfig
from zero3.monitor.base import Event, Monitor


class TensorBoardMonitor(Monitor):
    def __init__(self, config: FileMonitorConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.summary_writer = SummaryWriter(log_dir=self.log_dir)

    def write_events(self, event_list: list[Event]) -> None:
        for name, value, step in event_list:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()

    def close(self) -> None:
        self.summary_writer.close()
