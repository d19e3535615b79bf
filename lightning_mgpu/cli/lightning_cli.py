"""``lightning-mgpu fit|validate|test|predict``: LightningCLI with the strategies registered and a run folder.

On top of LightningCLI: the ``mgpu_*`` names are registered before any Trainer exists; a configuration that cannot
start (a misspelt key, a value of the wrong type or out of range, a strategy name that nothing is registered under,
GPUs or an accelerator this machine does not have, a class path that does not import, a strategy class that refuses
its init arguments, any setting the Trainer's constructor refuses) raises ``CommandError``, which ``cli/run.py``
prints as one line naming the full key, the value, what the key takes and the fix (``cli/settings.py``), where
LightningCLI prints its usage or a traceback, while an exception of the project's own code keeps its traceback; a
strategy given on the command line as a class path (``--trainer.strategy lightning_mgpu.MGPUDDPStrategy``) is
instantiated with the command line's own checks; each run writes CSV logs (and TensorBoard logs when tensorboard is
installed), checkpoints and its config under one folder (``<default_root_dir>/version_<n>``), which a command that
fails before writing anything else leaves behind no longer; and each command ends with a short summary of metrics and
files.

The classes here are written once and bound to each Lightning namespace; ``lightning.pytorch``'s bindings are here,
``pytorch_lightning``'s in ``cli/pytorch_lightning.py``, and ``cli/run.py`` picks the namespace of a run.
"""

from __future__ import annotations

import difflib
import glob
import importlib
import os
import re
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import lightning.pytorch as pl
from jsonargparse import ArgumentParser
from jsonargparse import Namespace as JsonNamespace
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.strategies import Strategy

import lightning_mgpu  # noqa: F401 - registers mgpu_dp and mgpu_ddp before the Trainer is built
from lightning_mgpu._compat import (
    given_init_args,
    not_a_class_path,
    parser_error_facts,
    rejected_init_value,
    rejected_option,
    rejected_value,
)
from lightning_mgpu.checks import check_gpus_exist
from lightning_mgpu.cli.settings import (
    check_trainer_values,
    describe_types,
    imported,
    init_argument_takes,
    refused_by_the_trainer,
    settings_named,
    shown,
    trainer_takes,
)
from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import (
    LIGHTNING,
    Bindings,
    Namespace,
    namespace_of,
)
from lightning_mgpu.program import PROG
from lightning_mgpu.strategies.registry import close_names

if TYPE_CHECKING:
    _Parser = LightningArgumentParser
    _SaveConfig = SaveConfigCallback
    _CLI = LightningCLI
else:
    _Parser = _SaveConfig = _CLI = object

SUBCOMMANDS = ("fit", "validate", "test", "predict")
DEFAULT_RUNS = "runs"
"""Where runs go, under the current directory, when the config sets no ``trainer.default_root_dir``."""
PREDICTIONS_FILE = "predictions.csv"
"""What the examples' prediction writers call their file in the run folder; the summary lists it after ``predict``."""

_HELP_EPILOG = (
    "The model's and the datamodule's own arguments are not listed above: --model.help CLASS and --data.help CLASS"
    " list them (for example --model.help examples.density.DensityModel), and --model.init_args.NAME VALUE sets one"
    " (--model.init_args.lr 0.01)."
)


class CommandError(ConfigurationError):
    """A configuration the command refuses before training starts; ``run`` prints the message alone and returns 2."""


class StrategyNameError(CommandError):
    """``trainer.strategy`` is a name no strategy is registered under."""


class ClassPathError(CommandError):
    """A class path of the config or the command line does not import.

    Args:
        message: what failed and how to fix it.
        missing_package: the top-level package that is not importable from here, when that is the cause; ``run``
            then looks for the folder that holds it next to the config files.
    """

    def __init__(self, message: str, missing_package: str | None = None) -> None:
        super().__init__(message)
        self.missing_package = missing_package


class MGPUArgumentParserLogic(_Parser):
    """What ``MGPUArgumentParser`` adds to LightningCLI's parser, bound to each Lightning namespace."""

    bindings: ClassVar[Bindings[type[MGPUArgumentParserLogic]]] = Bindings()
    working_directory: str | None = None
    command_parsers: Sequence[LightningArgumentParser] = ()

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        """Raise a ``CommandError`` with one line where jsonargparse would print its usage and the message.

        A class path that does not import is imported again here to tell a missing package from a misspelt class
        and from an error inside the module; a key or init argument that is not accepted gets the closest accepted
        ones. Parsers that do not exit on errors (jsonargparse's own, inside a union) raise as jsonargparse does.
        """
        if not self.exit_on_error:
            super().error(message, ex)
        raise (
            _class_path_problem(message, self.working_directory or os.getcwd())
            or _rejected_option_problem(message, self.command_parsers)
            or _rejected_value_problem(message, namespace_of(type(self)) or LIGHTNING)
            or CommandError(f"{_one_line(message)} (--help lists the settings).")
        )


@MGPUArgumentParserLogic.bindings
class MGPUArgumentParser(MGPUArgumentParserLogic, LightningArgumentParser):
    """LightningCLI's parser, which ends with one line naming the cause and the fix, never the usage.

    Attributes:
        working_directory: where the command was started; jsonargparse changes into a config file's folder while
            it reads the file.
        command_parsers: the parsers of the whole command (its own and its subcommands'), whose keys a misspelt
            key is compared with.
    """


class RunFolderConfigLogic(_SaveConfig):
    """What ``RunFolderConfig`` adds to LightningCLI's ``SaveConfigCallback``, bound to each Lightning namespace."""

    bindings: ClassVar[Bindings[type[RunFolderConfigLogic]]] = Bindings()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Save the config (every rank takes part), then annotate it on global rank 0."""
        first = not self.already_saved
        super().setup(trainer, pl_module, stage)
        if not (first and self.save_to_log_dir and trainer.loggers):
            return
        log_dir = trainer.log_dir  # a collective under DDP: every rank asks
        if trainer.is_global_zero and log_dir and self.config.get("trainer.logger") in (None, True):
            _note_loggers(os.path.join(log_dir, self.config_filename), trainer.loggers)


@RunFolderConfigLogic.bindings
class RunFolderConfig(RunFolderConfigLogic, SaveConfigCallback):
    """Saves the config as LightningCLI does, and says next to ``logger: null`` which loggers the run had.

    The value stays ``null``: rerunning the saved file then gives a new run folder under whatever
    ``--trainer.default_root_dir`` says, where the loggers spelt out would pin the old folder.
    """


class MGPULightningCLILogic(_CLI):
    """What ``MGPULightningCLI`` adds to LightningCLI, bound to each Lightning namespace (``cli_for``)."""

    bindings: ClassVar[Bindings[type[MGPULightningCLILogic]]] = Bindings()

    def __init__(self, args: list[str] | None = None, prog: str = PROG, **kwargs: Any) -> None:
        namespace = self._namespace
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        kwargs.setdefault("save_config_callback", RunFolderConfigLogic.bindings[namespace])
        kwargs.setdefault("parser_class", MGPUArgumentParserLogic.bindings[namespace])
        kwargs.setdefault("parser_kwargs", {"prog": prog, **{name: {"epilog": _HELP_EPILOG} for name in SUBCOMMANDS}})
        self._started = time.monotonic()
        self._started_at = time.time()
        self._new_run_folder: str | None = None
        self._working_directory = os.getcwd()
        self._parsers: list[LightningArgumentParser] = []
        try:
            super().__init__(args=args, **kwargs)
        except BaseException:
            self._remove_stub_run_folder()
            raise

    @property
    def _namespace(self) -> Namespace:
        return namespace_of(type(self)) or LIGHTNING

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        """LightningCLI's parser, told where the command started (see ``MGPUArgumentParser``)."""
        parser = super().init_parser(**kwargs)
        if isinstance(parser, MGPUArgumentParserLogic):
            parser.working_directory = self._working_directory
            parser.command_parsers = self._parsers
        self._parsers.append(parser)
        return parser

    def instantiate_classes(self) -> None:
        """Build the classes as LightningCLI does; a strategy class that refuses its init arguments ends in one line.

        The Trainer's ``strategy`` is a name or a ``Strategy``, so jsonargparse reports a ``ConfigurationError`` of
        the strategy's ``__init__`` (``MGPUDDPStrategy(output_device=0)``) as a value that fits neither, over many
        lines; the strategy is built once more from its parsed arguments to learn the error.

        Raises:
            CommandError: the class of ``trainer.strategy`` raised ``ConfigurationError`` for its init arguments.
        """
        try:
            super().instantiate_classes()
        except ValueError:
            refusal = self._strategy_refusal()
            if refusal is None:
                raise
            raise CommandError(f"trainer.strategy: {refusal}", setting=refusal.setting) from None

    def _strategy_refusal(self) -> ConfigurationError | None:
        """The ``ConfigurationError`` the class of ``trainer.strategy`` raises for its parsed init arguments, if any.

        Classes nested in those arguments stay configs: only the strategy's own checks of its arguments are wanted.
        """
        config = self.config.get(str(self.subcommand), self.config)
        strategy = config.get("trainer.strategy")
        if not (isinstance(strategy, JsonNamespace) and isinstance(strategy.get("class_path"), str)):
            return None
        init_args = strategy.get("init_args") or JsonNamespace()
        try:
            imported(strategy.class_path)(**vars(init_args), **(strategy.get("dict_kwargs") or {}))
        except ConfigurationError as error:
            return error
        except Exception:  # anything else: jsonargparse's own message stands
            return None
        return None

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        """Build the Trainer, with class-path strategies instantiated and the run folder's loggers as default.

        Raises:
            CommandError: the trainer configuration cannot work here: an unknown strategy name, GPUs or an
                accelerator that do not exist, a number the Trainer cannot run with, any ``ConfigurationError`` of
                the strategy while the Trainer is built, or any exception the Trainer's constructor raises from
                Lightning's own code (``refused_by_the_trainer``).
        """
        namespace = self._namespace
        config = self.config_init.get(str(self.subcommand), self.config_init)  # under the subcommand, when one ran
        trainer_config = config.get("trainer", {})
        try:
            check_gpus_exist(trainer_config.get("accelerator"), trainer_config.get("devices"))
            check_trainer_values(trainer_config, namespace)
            strategy = trainer_config.get("strategy")
            if isinstance(strategy, str) and "." in strategy:
                kwargs["strategy"] = _strategy_from_class_path(strategy, namespace)
            elif isinstance(strategy, str):
                _check_strategy_name(strategy, namespace)
            root = trainer_config.get("default_root_dir")
            if not root:  # never the current directory itself, which may be a checkout: its runs/ folder
                root = kwargs["default_root_dir"] = os.path.join(os.getcwd(), DEFAULT_RUNS)
            if trainer_config.get("logger") in (None, True):
                loggers = _run_loggers(root, namespace)
                kwargs["logger"] = loggers
                folder = loggers[0].log_dir
                if folder and not os.path.exists(folder):
                    self._new_run_folder = folder
            return super().instantiate_trainer(**kwargs)
        except CommandError:
            raise
        except ConfigurationError as error:
            raise CommandError(str(error), setting=error.setting) from None
        except Exception as error:
            if not refused_by_the_trainer(error):
                raise
            raise _trainer_refusal(error, trainer_config, namespace) from None

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
            seconds = time.monotonic() - self._started
            print(summary(self.trainer, subcommand, seconds, log_dir, since=self._started_at), flush=True)

    def _remove_stub_run_folder(self) -> None:
        """Remove the run folder this command created when it holds its config alone: the command failed early."""
        trainer = getattr(self, "trainer", None)
        folder = self._new_run_folder
        if trainer is None or folder is None or not trainer.is_global_zero:
            return
        config = os.path.join(folder, "config.yaml")
        if os.path.isdir(folder) and os.listdir(folder) == ["config.yaml"]:
            os.remove(config)
            os.rmdir(folder)


@MGPULightningCLILogic.bindings
class MGPULightningCLI(MGPULightningCLILogic, LightningCLI):
    """LightningCLI whose model and data are given by class path (``--model``/``--data`` or a config file).

    Args:
        args: the command line after the program's name, as for LightningCLI.
        prog: the program's name in usage lines and help.
        **kwargs: passed to LightningCLI.
    """


def summary(
    trainer: pl.Trainer, subcommand: str, seconds: float, log_dir: str | None, since: float | None = None
) -> str:
    """A few lines: the final metrics, the run folder and its files, the checkpoint used or to use next.

    A metric logged both per step and per epoch is shown by its epoch value alone: the last step's (a last batch
    of one row, say) is not a value to quote.

    Args:
        trainer: the Trainer after the command.
        subcommand: ``fit``, ``validate``, ``test`` or ``predict``.
        seconds: how long the command took.
        log_dir: the run folder.
        since: when the command started (``time.time()``); images in the run folder written since are listed.
    """
    if subcommand == "fit":
        what = f"{trainer.global_step} training steps"
    elif trainer.ckpt_path:
        what = f"checkpoint {trainer.ckpt_path}"
    else:
        what = "the model's initial weights: no --ckpt_path given"
    lines = [f"{PROG} {subcommand}: done in {seconds:.1f} s ({what})"]
    metrics = {key: float(value) for key, value in trainer.callback_metrics.items() if value.numel() == 1}
    for key in [key for key in metrics if key.endswith(("_step", "_epoch")) and key.rpartition("_")[0] in metrics]:
        del metrics[key]  # logged per step and per epoch: the plain key holds the epoch's value, the one to quote
    if metrics:
        lines.append(_entry("final metrics", ", ".join(f"{key}={value:.4g}" for key, value in sorted(metrics.items()))))
    files: list[str] = []
    if log_dir:
        lines.append(_entry("run folder", log_dir))
        files.append(os.path.join(log_dir, "config.yaml"))
    namespace = namespace_of(type(trainer)) or LIGHTNING
    files += [
        os.path.join(logger.log_dir, "metrics.csv")
        for logger in trainer.loggers
        if isinstance(logger, namespace.CSVLogger)
    ]
    if subcommand == "predict":
        files += _prediction_files(trainer, log_dir, namespace)
    if log_dir and since is not None:
        images = sorted(glob.glob(os.path.join(glob.escape(log_dir), "*.png")))
        files += [image for image in images if os.path.getmtime(image) >= since - 1]
    for path in dict.fromkeys(files):
        if os.path.isfile(path):
            lines.append(_entry(os.path.basename(path), path))
    callback = trainer.checkpoint_callback
    best = getattr(callback, "best_model_path", "") if callback is not None else ""
    if subcommand == "fit" and best:
        lines.append(_entry("checkpoint", best))
    return "\n".join(lines)


def _entry(label: str, value: str) -> str:
    return f"  {label + ':':<14} {value}"


def _prediction_files(trainer: pl.Trainer, log_dir: str | None, namespace: Namespace) -> list[str]:
    """Where the prediction writers wrote: their ``path`` attribute, else ``predictions.csv`` in the run folder."""
    paths = [
        os.fspath(path)
        for callback in trainer.callbacks  # type: ignore[attr-defined]
        if isinstance(callback, namespace.BasePredictionWriter)
        and isinstance(path := getattr(callback, "path", None), (str, os.PathLike))
    ]
    return paths or ([os.path.join(log_dir, PREDICTIONS_FILE)] if log_dir else [])


def _check_strategy_name(name: str, namespace: Namespace) -> None:
    """Raise ``StrategyNameError`` for a name ``namespace``'s Trainer would reject (it accepts any letter case)."""
    if name.lower() == "auto" or name.lower() in namespace.StrategyRegistry:
        return
    matches = close_names(name, namespace)
    hint = f"Did you mean {' or '.join(repr(match) for match in matches)}? " if matches else ""
    raise StrategyNameError(
        f"trainer.strategy {name!r} is not a registered strategy name. {hint}lightning_mgpu registers mgpu_dp,"
        " mgpu_ddp and dp (Lightning 1.x's name for mgpu_dp); Lightning's own include ddp, ddp_spawn, fsdp and"
        " deepspeed. A class path such as lightning_mgpu.MGPUDPStrategy works too."
    )


def _strategy_from_class_path(class_path: str, namespace: Namespace) -> Strategy:
    try:
        strategy_class = imported(class_path)
    except (ImportError, AttributeError) as error:
        raise ClassPathError(
            f"trainer.strategy {class_path!r} is neither a registered strategy name nor an importable class"
            f" ({error}). Use a name such as mgpu_ddp, or a class path such as lightning_mgpu.MGPUDDPStrategy."
        ) from None
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, namespace.Strategy)):
        raise ClassPathError(f"trainer.strategy {class_path!r} is not a Strategy subclass.")
    return strategy_class()


def _run_loggers(root: str, namespace: Namespace) -> list[Logger]:
    csv = namespace.CSVLogger(save_dir=root, name="")
    loggers: list[Logger] = [csv]
    try:
        importlib.import_module("tensorboard")
    except ImportError:
        return loggers
    loggers.append(namespace.TensorBoardLogger(save_dir=root, name="", version=csv.version, default_hp_metric=False))
    return loggers


def _note_loggers(config_path: str, loggers: Sequence[Logger]) -> None:
    """Say after ``logger: null`` (or ``true``) in the trainer section of the saved config which loggers ran."""
    names = [_logger_class_path(type(logger)) for logger in loggers]
    note = f"  # lightning-mgpu's default: {' and '.join(names)}, writing into this folder"
    with open(config_path) as file:
        lines = file.read().split("\n")
    section = None
    for index, line in enumerate(lines):
        if line and not line[0].isspace():
            section = line.split(":", 1)[0]
        elif section == "trainer" and re.fullmatch(r"  logger: (null|true)", line):
            lines[index] = line + note
            break
    with open(config_path, "w") as file:
        file.write("\n".join(lines))


def _logger_class_path(cls: type) -> str:
    """``cls`` as a config names it: by the path Lightning exports it under when it is one of Lightning's loggers."""
    namespace = namespace_of(cls)
    return _class_path_of(cls, f"{namespace.name}.loggers" if namespace is not None else None)


def _class_path_of(cls: type, exported_by: str | None) -> str:
    """``cls`` as a config names it: ``<exported_by>.<Name>`` where that module exports it, else its own module's."""
    if exported_by is not None and getattr(importlib.import_module(exported_by), cls.__name__, None) is cls:
        return f"{exported_by}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def _class_path_problem(message: str, working_directory: str) -> ClassPathError | None:
    """The first class path named in a jsonargparse error that does not import, as a ``ClassPathError``."""
    key, class_paths = parser_error_facts(message)
    where = f"{key}: class path" if key else "class path"
    for class_path in class_paths:
        module_name, _, class_name = class_path.rpartition(".")
        if not module_name:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as error:
            missing = error.name or ""
            if module_name == missing or module_name.startswith(missing + "."):
                package = missing.partition(".")[0]
                if missing == package:
                    root = " (the repository root)" if package == "examples" else ""
                    return ClassPathError(
                        f"{where} {class_path!r} does not import: there is no package {package!r} in the current"
                        f" directory ({working_directory}) or on PYTHONPATH. Run the command from the folder that"
                        f" holds {package}/{root}, or put that folder on PYTHONPATH.",
                        missing_package=package,
                    )
                return ClassPathError(f"{where} {class_path!r} does not import: there is no module {missing!r}.")
            return ClassPathError(
                f"{where} {class_path!r} does not import: importing {module_name} needs {missing!r}, which is not"
                f" installed ({error})."
            )
        except Exception as error:
            return ClassPathError(
                f"{where} {class_path!r} does not import: importing {module_name} raised {type(error).__name__}:"
                f" {error}"
            )
        if not hasattr(module, class_name):
            return ClassPathError(
                f"{where} {class_path!r} does not import: module {module_name} has no {class_name!r}; check the name."
            )
    return None


def _rejected_option_problem(message: str, parsers: Sequence[LightningArgumentParser]) -> CommandError | None:
    """A key or init argument that is not accepted, and the accepted one closest to it, as a ``CommandError``."""
    option = rejected_option(message)
    if option is None:
        return None
    key, class_paths = parser_error_facts(message)
    if key and class_paths:  # an init argument of the class at ``key``
        known = _init_arguments(class_paths[0])
        meant = [f"{key}.init_args.{name}" for name in difflib.get_close_matches(option, known, n=1)]
        takes = f"; it takes {', '.join(known)}" if known else ""
        hint = f"Did you mean {meant[0]}?" if meant else f"Check the name{takes}."
        return CommandError(
            f"{key}.init_args.{option} is not an argument of {class_paths[0]}. {hint}",
            setting=f"{class_paths[0].rpartition('.')[2]}.{option}",
        )
    # A jsonargparse Namespace iterates over its (key, value) items; its keys() are the dotted keys.
    defaults = [parser.get_defaults(skip_check=True) for parser in parsers]
    known = sorted({name for namespace in defaults for name in namespace.keys()})  # noqa: SIM118
    meant = difflib.get_close_matches(option, known, n=1)
    hint = f"Did you mean {meant[0]}?" if meant else "Check the name (--help lists the settings)."
    return CommandError(f"{option!r} is not a setting of this command. {hint}")


def _rejected_value_problem(message: str, namespace: Namespace) -> CommandError | None:
    """A value of the wrong type, said in one line with its full key and what the key takes.

    What a key takes is read from its annotation (the Trainer's, or the init argument's of the class named), and from
    jsonargparse's message where the annotation does not resolve here.
    """
    key, _ = parser_error_facts(message)
    init_value = rejected_init_value(message)
    if key and init_value is not None:
        class_path, name, expected, given = init_value
        takes = init_argument_takes(class_path, name) or describe_types([expected])
        return CommandError(
            f"{key}.init_args.{name} takes {takes}, not {shown(given)}.",
            setting=f"{class_path.rpartition('.')[2]}.{name}",
        )
    name_given, init_args = not_a_class_path(message), given_init_args(message)
    if key and name_given is not None and init_args:
        return _init_args_of_a_name(key, name_given, *next(iter(init_args.items())), namespace)
    rejected = rejected_value(message)
    if rejected is None:
        return None
    expected_types, given = rejected
    option = key.removeprefix("trainer.") if key else ""
    if key and key.startswith("trainer.") and "." not in option:
        return CommandError(
            f"{key} takes {trainer_takes(option, namespace)}, not {given!r}.", setting=f"Trainer.{option}"
        )
    return CommandError(f"{key or 'a setting'} takes {describe_types(expected_types)}, not {given!r}.")


def _init_args_of_a_name(key: str, name: str, argument: str, value: Any, namespace: Namespace) -> CommandError:
    """Init arguments for a key given as a name (``strategy: mgpu_dp``) or without a class: say how to give one."""
    registry = namespace.StrategyRegistry  # its get() builds the strategy: read the entry by key
    known = key == "trainer.strategy" and name.lower() in registry
    strategy = registry[name.lower()]["strategy"] if known else None
    class_path = _class_path_of(strategy, strategy.__module__.partition(".")[0]) if strategy else "a.module.Class"
    given = f"the name {name!r}, which takes no init_args" if name else "given without a class_path"
    written = value if isinstance(value, str) else shown(value)
    return CommandError(
        f"{key}.init_args.{argument} cannot be set: {key} is {given}. Give the class:"
        f" --{key}.class_path {class_path} --{key}.init_args.{argument} {written}, or"
        f" class_path: {class_path} beside init_args under {key.rpartition('.')[2]}: in the config.",
        setting=f"{key.rpartition('.')[2]}.init_args",
    )


def _trainer_refusal(error: Exception, trainer: Any, namespace: Namespace) -> CommandError:
    """The Trainer's refusal of its settings in one line: the settings its message names, their values, the reason."""
    reason = _one_line(str(error))
    names = settings_named(str(error), trainer, namespace)
    if not names:
        return CommandError(f"the Trainer refuses these settings: {reason}. Change the trainer settings it names.")
    refused = " and ".join(f"trainer.{name} {shown(trainer[name])}" for name in names)
    takes = f" (it takes {trainer_takes(names[0], namespace)})" if len(names) == 1 else ""
    change = " or ".join(f"trainer.{name}" for name in names)
    return CommandError(
        f"the Trainer refuses {refused}{takes}: {reason}. Change {change}.", setting=f"Trainer.{names[0]}"
    )


def _init_arguments(class_path: str) -> list[str]:
    """The init arguments jsonargparse accepts for ``class_path``; none when it does not import."""
    try:
        cls = imported(class_path)
    except (ImportError, AttributeError, ValueError):  # ValueError: a class path without a module
        return []
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls)
    return list(parser.get_defaults(skip_check=True).keys())


def _one_line(message: str) -> str:
    """The message of jsonargparse or Lightning on one line, ``Parser key "k":`` read as ``k:``."""
    return re.sub(r"\s+", " ", re.sub(r'Parser key "([^"]+)":', r"\1:", message)).strip().rstrip(".")
