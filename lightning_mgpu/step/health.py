"""Warnings, once per run, for what silently spoils data-parallel training without raising anywhere."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from tqdm import tqdm

from lightning_mgpu._compat import BatchNorm
from lightning_mgpu.step.hooks import find_loss
from lightning_mgpu.sync_batchnorm import SYNCED_BATCHNORM

ACCELERATOR_CHECK_EVERY = 50


class StepHealth:
    """Checks each step's outcome; every kind of problem is reported once, the first time it happens.

    Args:
        strategy_name: named in each message.
    """

    def __init__(self, strategy_name: str) -> None:
        self.strategy_name = strategy_name
        self._reported: set[str] = set()
        self._checks: dict[str, int] = {}
        self._finite: torch.Tensor | None = None
        self._unread = 0

    def check_rows(self, rows: int, devices: int) -> None:
        """A batch with fewer rows than devices leaves devices idle (and changes nothing else).

        It is found in the middle of an epoch, while a progress bar is drawn (see ``_report``).
        """
        if rows < devices:
            self._report(
                "rows",
                f"{self.strategy_name}: a batch of {rows} row(s) was split across {rows} of {devices} devices,"
                " so the others sat idle for that step. Use a batch size of at least the device count (ideally"
                " a multiple of it); a smaller last batch is harmless (drop_last=True skips it).",
            )

    def check_loss(self, output: Any, where: Callable[[], str], replica_losses: Sequence[Any] = ()) -> None:
        """A NaN or infinite loss spoils every parameter at the next optimizer step.

        On accelerators the check reads the loss only every ``ACCELERATOR_CHECK_EVERY`` steps (a read waits for the
        device), keeping a device-side flag in between, so a bad loss is reported at most that many steps late.
        """
        _, loss = find_loss(output)
        if not isinstance(loss, torch.Tensor) or "loss" in self._reported:
            return
        finite = torch.isfinite(loss.detach()).all()
        if loss.device.type != "cpu":
            self._finite = finite if self._finite is None else self._finite & finite
            self._unread += 1
            if self._unread < ACCELERATOR_CHECK_EVERY:
                return
            finite, self._finite, self._unread = self._finite, None, 0
        if bool(finite):
            return
        culprits = [
            str(index)
            for index, value in enumerate(replica_losses)
            if isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all())
        ]
        source = f"; replica(s) {', '.join(culprits)} produced it" if culprits else ""
        self._report(
            "loss",
            f"{self.strategy_name}: the training loss is {loss.detach().flatten()[0].item()} {where()}{source}. The"
            " optimizer will spread it into every parameter. Check the inputs of that batch, lower the learning"
            " rate, clip gradients (Trainer(gradient_clip_val=1.0)), or find the operation with"
            " Trainer(detect_anomaly=True).",
        )

    def check_batchnorm(self, module: torch.nn.Module, share: str, fix: str) -> None:
        """BatchNorm layers in training mode that normalise each ``share`` of the batch by its own statistics.

        Called at a training step, so layers a model keeps frozen (in eval mode) are not reported.
        """
        layers = [
            name
            for name, layer in module.named_modules()
            if isinstance(layer, BatchNorm) and not isinstance(layer, SYNCED_BATCHNORM) and layer.training
        ]
        if layers:
            self._report(
                "batchnorm",
                f"{self.strategy_name}: the BatchNorm layers ({', '.join(layers[:5])}) normalise {share} by its own"
                " statistics, so outputs, gradients and running statistics differ from one device that sees the"
                f" whole batch. {fix}",
            )

    def wants(self, kind: str, checks: int = 3) -> bool:
        """Whether to run a costly check of ``kind`` now: for its first ``checks`` calls, until it finds something.

        What these checks look at (BatchNorm layers in training mode) is the same in
        every step of a run, so the first steps show it and later steps need not pay for it.
        """
        done = self._checks.get(kind, 0)
        if kind in self._reported or done >= checks:
            return False
        self._checks[kind] = done + 1
        return True

    def _report(self, kind: str, message: str) -> None:
        """Warn once per kind; these checks run mid-epoch, so a progress bar on screen steps aside for the line."""
        if kind not in self._reported:
            self._reported.add(kind)
            with _progress_bars_aside():
                warnings.warn(message, UserWarning, stacklevel=4)


@contextmanager
def _progress_bars_aside() -> Iterator[None]:
    """Clear the progress bars (tqdm's, as Lightning's TQDMProgressBar draws) and redraw them after the block.

    A warning printed while a bar is drawn would continue the bar's unfinished line; cleared first, it starts a line
    of its own and the bar is redrawn below it. Without bars on the screen this does nothing.
    """
    with tqdm.external_write_mode(file=sys.stderr):
        yield


class stop_iteration_is_an_error:  # noqa: N801 - used as a context manager, named like contextlib's
    """Turn a ``StopIteration`` escaping ``step`` into an error; Lightning's loops would take it for the end of data.

    A class rather than ``@contextmanager``: contextlib re-raises the original ``StopIteration`` when a generator turns
    it into a ``RuntimeError`` (PEP 479 bookkeeping), which is exactly what must not reach Lightning.
    """

    def __init__(self, step: str) -> None:
        self.step = step

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if isinstance(error, StopIteration):
            raise RuntimeError(
                f"StopIteration was raised inside {self.step}, for example by next() on an empty iterator such as"
                " next(iter(module.parameters())) of a module without parameters. Training would have ended"
                " silently; check the call that raised it (see the traceback above)."
            ) from error
