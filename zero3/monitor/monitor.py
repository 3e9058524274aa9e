"""`MonitorMaster`: every enabled destination of training events (base.py's `Monitor`).

An event is DeepSpeed's tuple (name, value, step), the step being the global sample count.
Only rank 0 writes (DeepSpeed's rule); every rank checks at construction that each enabled
monitor's package is importable, so a missing one is a `MonitorUnavailableError` naming the
package and the install command on every rank, before training starts.

Memory and files: each destination owns its writer (a TensorBoard event file, open CSV
paths, a W&B run, a Comet experiment) from construction to `close()`.
"""

from __future__ import annotations

import importlib.util
import torch.distributed as dist

from zero3.config import MonitorConfig
from zero3.monitor.base import Event, Monitor


class MonitorUnavailableError(ImportError):
    """An enabled monitor's package is not installed (the message says which and how)."""


_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard"),
             "wandb": ("wandb", "pip install wandb"),
             "comet": ("comet_ml", 'pip install "comet_ml>=3.41.0"')}


def check_packages(config: MonitorConfig) -> None:
    """Raise MonitorUnavailableError for the first enabled monitor whose package is missing."""
    for section, (package, install) in _PACKAGES.items():
        if getattr(config, section).enabled and importlib.util.find_spec(package) is None:
            raise MonitorUnavailableError(
                f"the config's {section} section is enabled, but the {package} package is not installed: "
                f"{install} (or pip install zero3[monitor]), or set {section}.enabled to false")


class MonitorMaster(Monitor):
    """Every enabled destination of `config` (DeepSpeed's `engine.monitor`); only the
    process of global rank 0 makes writers and writes."""

    def __init__(self, config: MonitorConfig) -> None:
        self.enabled = config.enabled
        check_packages(config)
        self.monitors: list[Monitor] = []
        rank = dist.get_rank() if dist.is_initialized() else 0
        if rank != 0 or not self.enabled:
            return
        if config.tensorboard.enabled:
            from zero3.monitor.tensorboard import TensorBoardMonitor

            self.monitors.append(TensorBoardMonitor(config.tensorboard))
        if config.csv_monitor.enabled:
            from zero3.monitor.csv_monitor import csvMonitor

            self.monitors.append(csvMonitor(config.csv_monitor))
        if config.wandb.enabled:
            from zero3.monitor.wandb import WandbMonitor

            self.monitors.append(WandbMonitor(config.wandb))
        if config.comet.enabled:
            from zero3.monitor.comet import CometMonitor

            self.monitors.append(CometMonitor(config.comet))

    def write_events(self, event_list: list[Event]) -> None:
        for monitor in self.monitors:
            monitor.write_events(event_list)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close()
        self.monitors = []
