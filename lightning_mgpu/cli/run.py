"""``lightning-mgpu fit|validate|test|predict``: run the LightningCLI of the namespace the run's classes come from.

A command reads the model and data class paths of its config and command line, picks the Lightning namespace they
are of (``lightning.pytorch`` or ``pytorch_lightning``) and runs ``cli/lightning_cli.py``'s classes bound to it
(``cli_for``); models and data of different namespaces are refused before anything runs. A configuration the command
refuses (``CommandError``) ends in one line on stderr, with where the setting was given, and ``EXIT_USAGE``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import yaml

from lightning_mgpu.cli.lightning_cli import SUBCOMMANDS, CommandError, MGPULightningCLILogic
from lightning_mgpu.cli.settings import imported
from lightning_mgpu.namespaces import (
    LIGHTNING,
    PYTORCH_LIGHTNING_PACKAGES,
    Namespace,
    mixed,
    namespace_of,
    pytorch_lightning_namespace,
)
from lightning_mgpu.program import EXIT_OK, EXIT_USAGE, PROG


def cli_for(namespace: Namespace) -> type[MGPULightningCLILogic]:
    """The command line's LightningCLI bound to ``namespace``."""
    if namespace is pytorch_lightning_namespace():
        from lightning_mgpu.cli import pytorch_lightning  # noqa: F401 - binds the classes to pytorch_lightning
    return MGPULightningCLILogic.bindings[namespace]


def run(subcommand: str, args: list[str], prog: str = PROG) -> int:
    """Run one LightningCLI subcommand; the current directory is importable, as with ``python -m``.

    Returns 0, or ``EXIT_USAGE`` after one line on stderr when the configuration cannot start (``CommandError``).
    """
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # so config class paths like examples.density.DensityModel resolve
    with warnings.catch_warnings(), _without_lightning_tips():
        # LightningCLI warns when ``args`` is given while sys.argv holds arguments: here they are the same ones.
        warnings.filterwarnings("ignore", message=".*args.* parameter is intended to run from within Python.*")
        # Lightning's own use of a torch API that torch deprecates: nothing in the user's code to change.
        warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated")
        if subcommand != "fit":  # the run folder is new, and nothing is saved into it: no best checkpoint to lose
            warnings.filterwarnings("ignore", message="The dirpath has changed from")
        try:
            cli_for(_namespace_of_run(args))(args=[subcommand, *args], prog=prog)
        except CommandError as error:
            print(f"{prog} {subcommand}: {error}{_where_it_is(error, args)}", file=sys.stderr)
            return EXIT_USAGE
    return EXIT_OK


@contextlib.contextmanager
def _without_lightning_tips() -> Iterator[None]:
    """Leave out Lightning's advertising lines (``💡 Tip: ... try installing ...``) while the command runs."""

    def not_a_tip(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip:")

    loggers = [logging.getLogger(name) for name in _LIGHTNING_INFO_LOGGERS]
    for logger in loggers:
        logger.addFilter(not_a_tip)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(not_a_tip)


_LIGHTNING_INFO_LOGGERS = tuple(
    f"{package}.utilities.rank_zero" for package in (LIGHTNING.name, LIGHTNING.fabric, *PYTORCH_LIGHTNING_PACKAGES)
)
"""The loggers Lightning's ``rank_zero_info`` writes through, in every namespace, imported yet or not."""


def run_with_classes(model: str, data: str, args: Sequence[str], default_args: Sequence[str], prog: str) -> int:
    """``prog [fit|validate|test|predict] [options]`` with the model and data preset by class path.

    For scripts such as ``examples/density.py``: the presets come before ``args``, so a config's own ``class_path``
    still wins; no arguments at all run ``default_args``.
    """
    args = list(args) or list(default_args)
    if args[0] not in SUBCOMMANDS:
        asked_for_help = args[0] in ("-h", "--help")
        print(f"usage: {prog} [{'|'.join(SUBCOMMANDS)}] [options]", file=sys.stdout if asked_for_help else sys.stderr)
        return EXIT_OK if asked_for_help else EXIT_USAGE
    return run(args[0], ["--model", model, "--data", data, *args[1:]], prog)


def _where_it_is(error: CommandError, args: Sequence[str]) -> str:
    """For a missing package: the folder that holds it, found next to a config file given in ``args``."""
    package = getattr(error, "missing_package", None)
    if not package:
        return ""
    configs = [value for option, value in _options(args) if option in _CONFIG_OPTIONS]
    for config in configs:
        folder = os.path.dirname(os.path.abspath(config))
        while True:
            if os.path.isdir(os.path.join(folder, package)) or os.path.isfile(os.path.join(folder, f"{package}.py")):
                return f" Here that is {folder}: cd {folder}, or PYTHONPATH={folder}."
            parent = os.path.dirname(folder)
            if parent == folder:
                break
            folder = parent
    return ""


_CONFIG_OPTIONS = ("-c", "--config")
_CLASS_SECTIONS = ("model", "data")


def _options(args: Sequence[str]) -> Iterator[tuple[str, str]]:
    """Each option of ``args`` with its value, in order: ``--name value`` and ``--name=value`` alike."""
    for index, arg in enumerate(args):
        if not arg.startswith("-"):
            continue
        name, equals, value = arg.partition("=")
        if equals:
            yield name, value
        elif index + 1 < len(args) and not args[index + 1].startswith("-"):
            yield name, args[index + 1]


def _named_class_paths(args: Sequence[str]) -> dict[str, str]:
    """The class paths that ``args`` and the config files it names give ``model`` and ``data``, the last one winning."""
    named: dict[str, str] = {}
    for option, value in _options(args):
        section = option.removeprefix("--").removesuffix(".class_path")
        if option in _CONFIG_OPTIONS:
            config = _read_yaml(value)
            found = {key: _class_path(config.get(key)) for key in _CLASS_SECTIONS} if isinstance(config, dict) else {}
        elif section in _CLASS_SECTIONS:
            found = {section: value if option.endswith(".class_path") else _class_path(_parse_yaml(value))}
        else:
            continue
        named.update({key: path for key, path in found.items() if path is not None})
    return named


def _class_path(section: Any) -> str | None:
    """The class path of a config's ``model:`` or ``data:`` section: the section itself, or its ``class_path``."""
    if isinstance(section, dict):
        section = section.get("class_path")
    return section if isinstance(section, str) and "." in section else None


def _read_yaml(path: str) -> Any:
    try:
        with open(path) as file:
            return _parse_yaml(file.read())
    except OSError:
        return None  # LightningCLI says why when it reads the file


def _parse_yaml(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return None  # LightningCLI says why when it reads the value


def _namespace_of_run(args: Sequence[str]) -> Namespace:
    """The Lightning namespace of the model and data classes that ``args`` name, once they are of one namespace.

    Read as LightningCLI reads them (config files and ``--model``/``--data`` options in order, the last one winning)
    and imported from the current directory; ``lightning.pytorch`` when none imports.

    Raises:
        CommandError: the model's and the data's classes come from different namespaces.
    """
    classes = {f"{key} {path}": _class_if_importable(path) for key, path in _named_class_paths(args).items()}
    problem = mixed(classes)
    if problem is not None:
        raise CommandError(problem)
    found = [namespace_of(cls) for cls in classes.values() if cls is not None]
    return next((namespace for namespace in found if namespace is not None), LIGHTNING)


def _class_if_importable(class_path: str) -> type | None:
    """The class at ``class_path``; ``None`` when it does not import, which LightningCLI then explains."""
    try:
        found = imported(class_path)
    except Exception:  # the user's module may raise anything; LightningCLI imports it again and reports it
        return None
    return found if isinstance(found, type) else None
