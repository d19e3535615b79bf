"""``lightning-mgpu fit|validate|test|predict``: LightningCLI with the strategies registered and a run folder.

On top of LightningCLI: the ``mgpu_*`` names are registered before any Trainer exists; a strategy name that nothing
is registered under ends the command with one line naming the closest registered names; a strategy given on the
command line as a class path (``--trainer.strategy lightning_mgpu.DDPStrategy``) is instantiated, where plain
LightningCLI passes the string on and the Trainer rejects it (Lightning issue #19682); each run writes CSV logs
(and TensorBoard logs when tensorboard is installed), checkpoints and its config under one folder
(``<default_root_dir>/version_<n>``); and each command ends with a short summary of metrics and files.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.pytorch.strategies import Strategy, StrategyRegistry

import lightning_mgpu  # noqa: F401 - registers mgpu_dp and mgpu_ddp before the Trainer is built
from lightning_mgpu.doctor.command import EXIT_USAGE, PROG
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.registry import close_names

SUBCOMMANDS = ("fit", "validate", "test", "predict")


class StrategyNameError(ConfigurationError):
    """``trainer.strategy`` is a name no strategy is registered under; the command ends with the message alone."""


class MGPULightningCLI(LightningCLI):
    """LightningCLI whose model and data are given by class path (``--model``/``--data`` or a config file)."""

    def __init__(self, args: list[str] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        self._started = time.monotonic()
        super().__init__(args=args, **kwargs)

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Build the Trainer, with class-path strategies instantiated and the run folder's loggers as default."""
        trainer_config = self._get(self.config_init, "trainer", default={})
        strategy = trainer_config.get("strategy")
        if isinstance(strategy, str) and "." in strategy:
            kwargs["strategy"] = _strategy_from_class_path(strategy)
        elif isinstance(strategy, str):
            _check_strategy_name(strategy)
        if trainer_config.get("logger") in (None, True):
            kwargs["logger"] = _run_loggers(trainer_config.get("default_root_dir") or os.getcwd())
        return super().instantiate_trainer(**kwargs)

    def after_fit(self) -> None:
        """Say what the run reached and where its files are."""
        self._summarise("fit")

    def after_validate(self) -> None:
        """Say what the validation reached."""
        self._summarise("validate")

    def after_test(self) -> None:
        """Say what the test reached."""
        self._summarise("test")

    def after_predict(self) -> None:
        """Say where the predictions went."""
        self._summarise("predict")

    def _summarise(self, subcommand: str) -> None:
        log_dir = self.trainer.log_dir  # a collective under DDP: every rank must ask
        if self.trainer.is_global_zero:
            print(summary(self.trainer, subcommand, time.monotonic() - self._started, log_dir), flush=True)


def summary(trainer: pl.Trainer, subcommand: str, seconds: float, log_dir: str | None) -> str:
    """A few lines: the final metrics, the run folder and its files, the checkpoint to use next."""
    lines = [f"lightning-mgpu {subcommand}: done in {seconds:.1f} s ({trainer.global_step} training steps)"]
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
    if metrics:
        lines.append("  final metrics: " + ", ".join(f"{key}={value:.4g}" for key, value in sorted(metrics.items())))
    if log_dir:
        lines.append(f"  run folder:    {log_dir}")
        config = os.path.join(log_dir, "config.yaml")
        if os.path.exists(config):
            lines.append(f"  config.yaml:   {config}")
    for logger in trainer.loggers:
        if isinstance(logger, CSVLogger):
            lines.append(f"  metrics.csv:   {os.path.join(logger.log_dir, 'metrics.csv')}")
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    if subcommand == "fit" and best:
        lines.append(f"  checkpoint:    {best}")
    return "\n".join(lines)


def run(subcommand: str, args: list[str], prog: str = PROG) -> int:
    """Run one LightningCLI subcommand; the current directory is importable, as with ``python -m``.

    Returns 0, or ``EXIT_USAGE`` after one line on stderr when the strategy name is unknown.
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # so config class paths like examples.density.DensityModel resolve
    with warnings.catch_warnings():
        # LightningCLI warns when ``args`` is given while sys.argv holds arguments: here they are the same ones.
        warnings.filterwarnings("ignore", message=".*args.* parameter is intended to run from within Python.*")
        try:
            MGPULightningCLI(args=[subcommand, *args])
        except StrategyNameError as error:
            print(f"{prog} {subcommand}: {error}", file=sys.stderr)
            return EXIT_USAGE
    return 0


def run_with_classes(model: str, data: str, args: Sequence[str], default_args: Sequence[str], prog: str) -> int:
    """``prog [fit|validate|test|predict] [options]`` with the model and data preset by class path.

    For scripts such as ``examples/density.py``: the presets come before ``args``, so a config's own ``class_path``
    still wins; no arguments at all run ``default_args``.
    """
    args = list(args) or list(default_args)
    if args[0] not in SUBCOMMANDS:
        asked_for_help = args[0] in ("-h", "--help")
        print(f"usage: {prog} [{'|'.join(SUBCOMMANDS)}] [options]", file=sys.stdout if asked_for_help else sys.stderr)
        return 0 if asked_for_help else 2
    return run(args[0], ["--model", model, "--data", data, *args[1:]], prog)


def _check_strategy_name(name: str) -> None:
    """Raise ``StrategyNameError`` for a name the Trainer would reject (it accepts any letter case)."""
    if name.lower() == "auto" or name.lower() in StrategyRegistry:
        return
    matches = close_names(name)
    hint = f"Did you mean {' or '.join(repr(match) for match in matches)}? " if matches else ""
    raise StrategyNameError(
        f"trainer.strategy {name!r} is not a registered strategy name. {hint}lightning_mgpu registers mgpu_dp,"
        " mgpu_ddp and dp (Lightning 1.x's name for mgpu_dp); Lightning's own include ddp, ddp_spawn, fsdp and"
        " deepspeed. A class path such as lightning_mgpu.DataParallelStrategy works too."
    )


def _strategy_from_class_path(class_path: str) -> Strategy:
    module_name, _, class_name = class_path.rpartition(".")
    try:
        strategy_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"--trainer.strategy {class_path!r} is neither a registered strategy name nor an importable class"
            f" ({error}). Use a name such as mgpu_ddp, or a class path such as lightning_mgpu.DDPStrategy."
        ) from None
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, Strategy)):
        raise ValueError(f"--trainer.strategy {class_path!r} is not a Strategy subclass.")
    return strategy_class()


def _run_loggers(root: str) -> list[Logger]:
    csv = CSVLogger(save_dir=root, name="")
    loggers: list[Logger] = [csv]
    try:
        importlib.import_module("tensorboard")
    except ImportError:
        return loggers
    loggers.append(TensorBoardLogger(save_dir=root, name="", version=csv.version, default_hp_metric=False))
    return loggers
