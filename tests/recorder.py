"""A logger that keeps every value the loop logs, on every rank, for the scripts that train under ``mgpu_ddp``."""

from __future__ import annotations

from typing import Any


def recorder_class(base: type[Any]) -> type[Any]:
    """A ``Recorder`` on ``base``, the ``Logger`` of the Lightning namespace the script runs.

    Lightning's own loggers write from rank 0 only; this one keeps ``logged``, a dict per call, on every rank.
    """

    class Recorder(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.logged: list[dict[str, float]] = []

        @property
        def name(self) -> str:
            return "recorder"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.logged.append({key: float(value) for key, value in metrics.items()})

        def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
            pass

    return Recorder
