"""Seconds per phase of one ``MGPUDataParallel``, timed from outside the engine, which reads no clock itself."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lightning_mgpu.engine import data_parallel
from lightning_mgpu.engine.data_parallel import MGPUDataParallel

PHASES = ("scatter", "replicate", "parallel_apply", "gather")


class _Timed:
    """Calls ``inner``, adding the seconds to ``seconds[phase]``; other attributes are ``inner``'s."""

    def __init__(self, inner: Any, seconds: dict[str, float], phase: str) -> None:
        self._inner, self._seconds, self._phase = inner, seconds, phase

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return self._inner(*args, **kwargs)
        finally:
            self._seconds[self._phase] += time.perf_counter() - started

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class PhaseTimer:
    """Sums into ``seconds`` the time of each phase of ``wrapper``'s calls while started (or inside ``with``).

    ``replicate`` is the replica cache's call alone, ``parallel_apply`` the hand-off to the replica threads and
    their work; preparing replicas and keeping their buffers fall outside the four phases. ``scatter`` is patched
    on the engine's module, so it counts every wrapper's scatter while the timer runs.
    """

    def __init__(self, wrapper: MGPUDataParallel) -> None:
        self.wrapper = wrapper
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._saved: tuple[Any, Any, Callable[..., Any]] | None = None

    def start(self) -> PhaseTimer:
        """Put the timed parts in place."""
        # The benchmarks may reach into the engine's private parts; nothing in lightning_mgpu needs to.
        wrapper = self.wrapper
        self._saved = (wrapper._replicate, wrapper._apply_in_threads, data_parallel.scatter_to_devices)
        wrapper._replicate = _Timed(wrapper._replicate, self.seconds, "replicate")  # type: ignore[assignment]
        wrapper._apply_in_threads = _Timed(wrapper._apply_in_threads, self.seconds, "parallel_apply")  # type: ignore[assignment]
        wrapper.gather = _Timed(wrapper.gather, self.seconds, "gather")  # type: ignore[method-assign]
        data_parallel.scatter_to_devices = _Timed(self._saved[2], self.seconds, "scatter")  # type: ignore[assignment]
        return self

    def stop(self) -> None:
        """Restore the engine's own parts; stopping twice does nothing."""
        if self._saved is None:
            return
        wrapper = self.wrapper
        wrapper._replicate, wrapper._apply_in_threads, data_parallel.scatter_to_devices = self._saved
        del wrapper.gather
        self._saved = None

    def __enter__(self) -> PhaseTimer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
