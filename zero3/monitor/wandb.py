"""A Weights & Biases run (`wandb.init(project, group, entity=team)`), one `wandb.log` per
event at the event's step, as DeepSpeed's WandbMonitor."""

from __future__ import annotations

from zero3.config import WandbConfig
from zero3.monitor.base import Event, Monitor


class WandbMonitor(Monitor):
    def __init__(self, config: WandbConfig) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(project=config.project, group=config.group, entity=config.team)

    def write_events(self, event_list: list[Event]) -> None:
        for name, value, step in event_list:
            self._wandb.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
