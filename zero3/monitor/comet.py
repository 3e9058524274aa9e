"""A Comet experiment (`comet_ml.start(...)` with the section's keys), each event logged at
most once every `samples_log_interval` samples, as DeepSpeed's CometMonitor."""

from __future__ import annotations

from zero3.config import CometConfig
from zero3.monitor.base import Event, Monitor


class CometMonitor(Monitor):
    def __init__(self, config: CometConfig) -> None:
        import comet_ml

        self.samples_log_interval = config.samples_log_interval
        self.experiment = comet_ml.start(api_key=config.api_key, project=config.project, workspace=config.workspace,
                                         experiment_key=config.experiment_key, mode=config.mode, online=config.online)
        if config.experiment_name is not None:
            self.experiment.set_name(config.experiment_name)
        self._last_logged: dict[str, int] = {}

    def write_events(self, event_list: list[Event]) -> None:
        for name, value, step in event_list:
            last = self._last_logged.get(name)
            if last is None or step - last >= self.samples_log_interval:
                self._last_logged[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
