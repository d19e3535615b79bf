"""Seconds per phase of one ``MGPUDataParallel``, timed from outside the engine, which reads no clock itself."""

from __future__ import annotations

import time
from typing import Any

from lightning_mgpu.engine import data_parallel
from lightning_mgpu.engine.data_parallel import MGPUDataParallel

PHASES = ("scatter", "replicate", "parallel_apply", "settle", "gather")
_SCATTERS = ("scatter_to_devices", "scatter_inputs")
"""The scatter functions ``data_parallel`` calls (``run``'s batches, ``forward``'s inputs), where it has them."""


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

    ``replicate`` is the replica cache's call alone, ``parallel_apply`` the replica threads' run and ``settle`` putting
    back what the replicas changed (metrics, containers, reassigned buffers); preparing the replicas falls outside
    the phases. Scatter is patched on the engine's module, so while
    the timer runs it also counts other wrappers' scatters.
    """

    def __init__(self, wrapper: MGPUDataParallel) -> None:
        self.wrapper = wrapper
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self._saved: tuple[Any, Any, dict[str, Any]] | None = None

    def start(self) -> PhaseTimer:
        """Put the timed parts in place."""
        # Benchmarks may wrap the engine's private parts; nothing in lightning_mgpu needs to.
        wrapper, seconds = self.wrapper, self.seconds
        scatters = {name: getattr(data_parallel, name) for name in _SCATTERS if hasattr(data_parallel, name)}
        self._saved = (wrapper._replicate, wrapper._apply_in_threads, scatters)
        for name, function in scatters.items():
            setattr(data_parallel, name, _Timed(function, seconds, "scatter"))
        wrapper._replicate = _Timed(wrapper._replicate, seconds, "replicate")  # type: ignore[assignment]
        wrapper._apply_in_threads = _Timed(wrapper._apply_in_threads, seconds, "parallel_apply")  # type: ignore[assignment]
        wrapper.settle = _Timed(wrapper.settle, seconds, "settle")  # type: ignore[method-assign]
        wrapper.gather = _Timed(wrapper.gather, seconds, "gather")  # type: ignore[method-assign]
        return self

    def stop(self) -> None:
        """Restore the engine's own parts; stopping twice does nothing."""
        if self._saved is None:
            return
        self.wrapper._replicate, self.wrapper._apply_in_threads, scatters = self._saved
        for name, function in scatters.items():
            setattr(data_parallel, name, function)
        del self.wrapper.settle
        del self.wrapper.gather
        self._saved = None

    def __enter__(self) -> PhaseTimer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
