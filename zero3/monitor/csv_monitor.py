"""One CSV file per event under `<output_path>/<job_name>/`, as DeepSpeed's csvMonitor: the
file is the event's name with "/" and " " made "_" (`Train_Samples_lr.csv`), its header
`step,<the name's last part>`, one row per step appended."""

from __future__ import annotations

import csv
import os

from zero3.config import FileMonitorConfig
from zero3.monitor.base import Event, Monitor


class csvMonitor(Monitor):  # noqa: N801 - DeepSpeed's name
    def __init__(self, config: FileMonitorConfig) -> None:
        self.log_dir = os.path.join(config.output_path, config.job_name)
        os.makedirs(self.log_dir, exist_ok=True)
        self.filenames: set[str] = set()

    def write_events(self, event_list: list[Event]) -> None:
        for name, value, step in event_list:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.log_dir, filename + ".csv"), "a+", newline="") as handle:
                writer = csv.writer(handle)
                if filename not in self.filenames:
                    self.filenames.add(filename)
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])
