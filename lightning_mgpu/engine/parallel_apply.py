"""Run one call per replica, each in its own thread, with the caller's autograd and device state and its context."""

from __future__ import annotations

import contextlib
import contextvars
import queue
import threading
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch

from lightning_mgpu._compat import default_device, function_mode_depth
from lightning_mgpu.replica_state.batchnorm import RendezvousAborted

ContextFactory = Callable[[], AbstractContextManager[Any]]

_LIVENESS_CHECK_S = 1.0
"""While waiting for the replicas, how often the caller checks that their threads are still alive."""


class ReplicaThreadDied(RuntimeError):
    """A replica's thread stopped before its call returned, so the call has no result."""


class ParallelApply:
    """One long-lived thread per replica: replica ``i`` always runs on thread ``i``, and no step pays to start threads.

    A single call runs in the calling thread instead, as in ``torch.nn.parallel.parallel_apply``: with nothing to
    run beside it, a hand-off would only add a round trip.

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
        and re-entered in each thread; ``context()`` adds caller-specific state (autocast, for example). Each call
        runs in a copy of the caller's ``contextvars`` context, so context variables read as they do in the caller.
        If replicas raise, the exception of the lowest-numbered one is re-raised here, with its own traceback and
        a note that names the replica and its device. A replica whose thread dies (an exception escaping the
        thread's own loop, from a profiler hook say) raises ``ReplicaThreadDied`` here instead of leaving the
        caller waiting; its thread is replaced on the next call.
        """
        count = len(calls)
        if count > self._num_threads:
            raise ValueError(f"ParallelApply has {self._num_threads} threads but got {count} calls")
        if count == 0:
            return []
        if count == 1:
            try:
                return [_run_replica(calls[0], 0, devices[0], None, context)]
            except BaseException as error:
                error.add_note(f"lightning_mgpu: raised in replica 0 of 1 on {devices[0]}.")
                raise
        state = _CallerState.capture(devices)
        workers = self._ensure_workers()
        step = _Step(count)
        for index in range(count):
            job = _Job(step, index, calls[index], devices[index], state, context, contextvars.copy_context())
            if not workers[index].submit(job):
                step.settle(index, None, workers[index].died_error(index))
        step.wait(workers)
        failures = [(index, error) for index, error in enumerate(step.errors) if error is not None]
        if failures:
            # A replica stopped only because another failed is not the one to report.
            causes = [failure for failure in failures if not isinstance(failure[1], RendezvousAborted)]
            index, reported = (causes or failures)[0]
            others = f" ({len(failures) - 1} other replica(s) failed too)" if len(failures) > 1 else ""
            reported.add_note(f"lightning_mgpu: raised in replica {index} of {count} on {devices[index]}{others}.")
            raise reported
        return step.results

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
            workers = self._workers
            if not workers:
                workers = self._workers = [_Worker(f"mgpu-replica-{index}") for index in range(self._num_threads)]
            elif not all(worker.running for worker in workers):
                workers = self._workers = [
                    worker if worker.running else _Worker(f"mgpu-replica-{index}")
                    for index, worker in enumerate(workers)
                ]
            return workers


class _Step:
    """The results of one call of ``ParallelApply``; the last replica to finish wakes the caller."""

    __slots__ = ("_done", "_lock", "_remaining", "_settled", "errors", "results")

    def __init__(self, count: int) -> None:
        self.results: list[Any] = [None] * count
        self.errors: list[BaseException | None] = [None] * count
        self._settled = [False] * count
        self._remaining = count
        self._lock = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()

    def settle(self, index: int, result: Any, error: BaseException | None) -> None:
        """Record replica ``index``'s result or error; only the first record of a replica counts."""
        with self._lock:
            if self._settled[index]:
                return
            self._settled[index] = True
            self.results[index] = result
            self.errors[index] = error
            self._remaining -= 1
            last = self._remaining == 0
        if last:
            self._done.release()

    def wait(self, workers: list[_Worker]) -> None:
        """Block until every replica has settled; a replica whose thread died is settled with the reason."""
        while not self._done.acquire(timeout=_LIVENESS_CHECK_S):
            for index, settled in enumerate(self._settled):
                if not settled and not workers[index].thread_alive():
                    workers[index].mark_dead()
                    self.settle(index, None, workers[index].died_error(index))


class _Job:
    """One replica's share of a call, as handed to its thread."""

    __slots__ = ("call", "context", "device", "index", "state", "step", "variables")

    def __init__(
        self,
        step: _Step,
        index: int,
        call: Callable[[], Any],
        device: torch.device,
        state: _CallerState,
        context: ContextFactory | None,
        variables: contextvars.Context,
    ) -> None:
        self.step = step
        self.index = index
        self.call = call
        self.device = device
        self.state = state
        self.context = context
        self.variables = variables

    def run(self) -> None:
        try:
            result = self.variables.run(_run_replica, self.call, self.index, self.device, self.state, self.context)
        except BaseException as error:  # noqa: BLE001 - handed to the caller, which re-raises it
            self.step.settle(self.index, None, error)
        else:
            self.step.settle(self.index, result, None)


class _Worker:
    """A daemon thread that runs submitted jobs one after another."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._death: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the thread takes jobs: it has not died, as far as anyone has seen."""
        return self._death is None

    def thread_alive(self) -> bool:
        """Whether the thread is still there (slower than ``running``, which the thread sets as it dies)."""
        return self._thread.is_alive()

    def mark_dead(self) -> None:
        """The thread ended without saying why (its own handler could not run): take no more jobs."""
        with self._lock:
            if self._death is None:
                self._death = ReplicaThreadDied(f"{self._thread.name} ended without reporting why")

    def submit(self, job: _Job) -> bool:
        """Queue ``job``; ``False`` when the thread has died and never will run it."""
        with self._lock:
            if self._death is not None:
                return False
            self._jobs.put(job)
            return True

    def died_error(self, index: int) -> ReplicaThreadDied:
        """The error that replica ``index``'s call gets when this thread died before running it to the end."""
        cause = self._death
        reason = f" of {type(cause).__name__}: {cause}" if cause is not None else ""
        error = ReplicaThreadDied(
            f"The thread of replica {index} ({self._thread.name}) died{reason} before its call returned, so the"
            " call has no result. Something outside the replica's own code ended the thread: a profiler or trace"
            " hook installed for every thread (threading.setprofile, threading.settrace) that raised, for example."
            " The next call starts a new thread."
        )
        error.__cause__ = cause
        return error

    def stop(self) -> None:
        with self._lock:
            if self._death is None:
                self._jobs.put(None)
        self._thread.join()

    def _loop(self) -> None:
        job: _Job | None = None
        try:
            while (job := self._jobs.get()) is not None:
                job.run()
                job = None
        except BaseException as error:  # noqa: BLE001 - the thread ends; the jobs it held fail with the reason
            self._die(error, job)

    def _die(self, error: BaseException, job: _Job | None) -> None:
        with self._lock:
            self._death = error
            orphans = [job]
            with contextlib.suppress(queue.Empty):
                while True:
                    orphans.append(self._jobs.get_nowait())
        for orphan in orphans:
            if orphan is not None:
                orphan.step.settle(orphan.index, None, self.died_error(orphan.index))


class _CallerState:
    """Thread-local torch state of the calling thread, to re-enter in each replica thread.

    Autocast is thread-local too: a caller's ``with torch.autocast(...)`` around the data-parallel call reaches the
    replicas, as torch's own ``parallel_apply`` carries it over. Only what differs from the replica thread's own
    state is entered, so a replica thread already in the caller's state pays for no context.
    """

    __slots__ = ("autocast", "grad", "inference", "streams")

    def __init__(
        self, grad: bool, inference: bool, streams: list[Any] | None, autocast: list[tuple[str, torch.dtype]]
    ) -> None:
        self.grad = grad
        self.inference = inference
        self.streams = streams
        self.autocast = autocast

    @classmethod
    def capture(cls, devices: Sequence[torch.device]) -> _CallerState:
        streams = None
        kinds = ["cpu"]
        for device in devices:
            if device.type not in kinds:
                kinds.append(device.type)
        if "cuda" in kinds:
            streams = [torch.cuda.current_stream(device) if device.type == "cuda" else None for device in devices]
        autocast = [(kind, torch.get_autocast_dtype(kind)) for kind in sorted(kinds) if torch.is_autocast_enabled(kind)]
        return cls(torch.is_grad_enabled(), torch.is_inference_mode_enabled(), streams, autocast)

    def differs(self) -> bool:
        """Whether this thread's grad, inference or autocast state is not the caller's."""
        return (
            torch.is_inference_mode_enabled() != self.inference
            or torch.is_grad_enabled() != self.grad
            or any(not _autocast_is(kind, dtype) for kind, dtype in self.autocast)
        )

    def enter(self, stack: contextlib.ExitStack, index: int, device: torch.device) -> None:
        """Enter in this thread what differs from the caller's state, in the order the states depend on."""
        if torch.is_inference_mode_enabled() != self.inference:
            stack.enter_context(torch.inference_mode(self.inference))
        if torch.is_grad_enabled() != self.grad:
            stack.enter_context(torch.set_grad_enabled(self.grad))
        for kind, dtype in self.autocast:
            if not _autocast_is(kind, dtype):
                stack.enter_context(torch.autocast(kind, dtype=dtype))
        if self.streams is not None and device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(self.streams[index]))


_CPU = torch.device("cpu")


def _default_device() -> torch.device:
    """``torch.get_default_device()``, without its cost in a thread where no torch function mode is active.

    A default device other than the CPU is always a ``DeviceContext`` torch function mode on this thread's mode
    stack (``torch.set_default_device`` and ``with torch.device(...)`` both push one), so with an empty stack it is
    the CPU; the public function finds that out by walking the stack in Python, a few microseconds per replica per
    step. The stack's length is private torch API (``lightning_mgpu._compat``), covered by tests/test_parallel_apply.py;
    without it, ``_compat.default_device`` answers, as torch 2.8 and later answer it on every supported torch.
    """
    if function_mode_depth() == 0:
        return _CPU
    return default_device()


def _autocast_is(kind: str, dtype: torch.dtype) -> bool:
    return torch.is_autocast_enabled(kind) and torch.get_autocast_dtype(kind) == dtype


def _run_replica(
    call: Callable[[], Any],
    index: int,
    device: torch.device,
    state: _CallerState | None,
    context: ContextFactory | None,
) -> Any:
    """Run ``call`` as replica ``index`` on ``device`` in this thread (``state=None``: the caller's own thread)."""
    inline = state is None
    cuda = device.type == "cuda" and (not inline or torch.cuda.current_device() != device.index)
    # Tensors created without an explicit device land on the replica's device.
    default = _default_device() != device
    if context is None and not cuda and not default and (inline or not state.differs()):  # type: ignore[union-attr]
        return _call(call, index, device)
    with contextlib.ExitStack() as stack:
        if state is not None:
            state.enter(stack, index, device)
        elif cuda:
            stack.enter_context(torch.cuda.device(device))
        if default:
            stack.enter_context(device)
        if context is not None:
            stack.enter_context(context())
        return _call(call, index, device)


def _call(call: Callable[[], Any], index: int, device: torch.device) -> Any:
    try:
        return call()
    except StopIteration as stop:
        # Returned to a caller that iterates (Lightning's loops do), it would end the iteration silently.
        raise RuntimeError(
            f"StopIteration was raised inside replica {index} on {device}, for example by next() on an empty"
            " iterator such as next(iter(module.parameters())) of a module without parameters. Check the call"
            " that raised it (see the traceback above)."
        ) from stop
