"""Run one call per replica, each in its own thread, with the caller's autograd and device state."""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_mgpu.engine.batchnorm import RendezvousAborted

ContextFactory = Callable[[int, torch.device], AbstractContextManager[Any]]


class ParallelApply:
    """One long-lived thread per replica: replica ``i`` always runs on thread ``i``, and no step pays to start threads.

    Args:
        num_threads: the most replicas that ever run at once (the number of devices).
    """

    def __init__(self, num_threads: int) -> None:
        self._num_threads = num_threads
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()

    def __call__(
        self,
        calls: Sequence[Callable[[], Any]],
        devices: Sequence[torch.device],
        context: ContextFactory | None = None,
    ) -> list[Any]:
        """Run ``calls[i]`` on ``devices[i]`` in thread ``i`` and return the results in order.

        Grad mode, inference mode and the current CUDA stream are thread-local in torch, so they are captured here
        and re-entered in each thread; ``context(i, device)`` adds caller-specific state (autocast, for example).
        If replicas raise, the exception of the lowest-numbered one is re-raised here, with its own traceback and
        a note that names the replica and its device.
        """
        if len(calls) > self._num_threads:
            raise ValueError(f"ParallelApply has {self._num_threads} threads but got {len(calls)} calls")
        state = _CallerState.capture(devices)
        workers = self._ensure_workers()
        futures: list[Future[Any]] = [
            workers[index].submit(functools.partial(_run_replica, call, index, device, state, context))
            for index, (call, device) in enumerate(zip(calls, devices, strict=True))
        ]
        results: list[Any] = []
        failures: list[tuple[int, BaseException]] = []
        for index, future in enumerate(futures):
            try:
                results.append(future.result())
            except BaseException as caught:  # noqa: BLE001 - re-raised below, after every replica has finished
                failures.append((index, caught))
        if failures:
            # A replica stopped only because another failed is not the one to report.
            causes = [failure for failure in failures if not isinstance(failure[1], RendezvousAborted)]
            index, error = (causes or failures)[0]
            others = f" ({len(failures) - 1} other replica(s) failed too)" if len(failures) > 1 else ""
            error.add_note(f"lightning_mgpu: raised in replica {index} of {len(calls)} on {devices[index]}{others}.")
            raise error
        return results

    def close(self) -> None:
        """Stop the replica threads; a later call starts them again."""
        with self._lock:
            workers, self._workers = self._workers, []
        for worker in workers:
            worker.stop()

    def __getstate__(self) -> dict[str, Any]:
        """Threads and locks cannot be copied or pickled: a copy starts its own threads when first called."""
        return {"_num_threads": self._num_threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["_num_threads"])  # type: ignore[misc]

    def _ensure_workers(self) -> list[_Worker]:
        with self._lock:
            if not self._workers:
                self._workers = [_Worker(f"mgpu-replica-{index}") for index in range(self._num_threads)]
            return self._workers


class _Worker:
    """A daemon thread that runs submitted calls one after another."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((call, future))
        return future

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            call, future = job
            try:
                future.set_result(call())
            except BaseException as error:  # noqa: BLE001 - handed to the caller through the future
                future.set_exception(error)
            del job, call, future


class _CallerState:
    """Thread-local torch state of the calling thread, to re-enter in each replica thread.

    Autocast is thread-local too: a caller's ``with torch.autocast(...)`` around the data-parallel call reaches the
    replicas, as torch's own ``parallel_apply`` carries it over.
    """

    def __init__(
        self, grad: bool, inference: bool, streams: list[Any], autocast: list[tuple[str, torch.dtype]]
    ) -> None:
        self.grad = grad
        self.inference = inference
        self.streams = streams
        self.autocast = autocast

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> _CallerState:
        streams = [torch.cuda.current_stream(device) if device.type == "cuda" else None for device in devices]
        kinds = {"cpu", *(device.type for device in devices)}
        autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in sorted(kinds) if torch.is_autocast_enabled(kind)]
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), streams, autocast)

    @contextlib.contextmanager
    def enter(self, index: int, device: torch.device) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self.inference))
            stack.enter_context(torch.set_grad_enabled(self.grad))
            for kind, dtype in self.autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype))
            if device.type == "cuda":
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(self.streams[index]))
            if torch.get_default_device() != device:
                # Tensors created without an explicit device land on the replica's device.
                stack.enter_context(device)
            yield


def _run_replica(
    call: Callable[[], Any],
    index: int,
    device: torch.device,
    state: _CallerState,
    context: ContextFactory | None,
) -> Any:
    with state.enter(index, device), context(index, device) if context else contextlib.nullcontext():
        try:
            return call()
        except StopIteration as stop:
            # Returned to a caller that iterates (Lightning's loops do), it would end the iteration silently.
            raise RuntimeError(
                f"StopIteration was raised inside replica {index} on {device}, for example by next() on an empty"
                " iterator such as next(iter(module.parameters())) of a module without parameters. Check the call"
                " that raised it (see the traceback above)."
            ) from stop
