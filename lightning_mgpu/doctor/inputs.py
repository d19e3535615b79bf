"""The doctor's inputs: the classes, the YAML config, the instances built from them, and the probe batch.

Classes are named as ``package.module.ClassName`` or ``path/to/file.py:ClassName`` and built through jsonargparse,
as LightningCLI builds them. Every way these can go wrong raises ``DoctorError`` with what to pass instead, since
the doctor cannot start without them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

from lightning_mgpu.namespaces import LIGHTNING, imported, namespace_of

_BATCH_HOOKS = ("on_before_batch_transfer", "on_after_batch_transfer")
_SPEC_HELP = "package.module.ClassName (importable from the current directory) or path/to/file.py:ClassName"


class DoctorError(ValueError):
    """The doctor cannot start: a class that does not load, init args that do not fit, no probe batch."""


def load_class(spec: str, option: str = "--model") -> type:
    """The class named by ``package.module.ClassName`` or ``path/to/file.py:ClassName``.

    A file is imported as a module of its own (registered in ``sys.modules``, its folder put on ``sys.path`` as
    ``python file.py`` would), once per file, so a model and a datamodule from the same file share it. The current
    directory is importable, as under ``python -m``, because the console script alone would not make it so.
    """
    file_part, colon, class_name = spec.rpartition(":")
    if colon and file_part.endswith(".py"):
        module = _import_file(Path(file_part), spec, option)
    else:
        module_name, dot, class_name = spec.rpartition(".")
        if not dot or not module_name or not class_name:
            raise DoctorError(f"{option} {spec!r} names no class. Pass {option} as {_SPEC_HELP}.")
        if "" not in sys.path and str(Path.cwd()) not in sys.path:
            sys.path.insert(0, str(Path.cwd()))
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise DoctorError(
                f"{option} {spec!r}: cannot import {module_name!r} ({error}). Pass {option} as {_SPEC_HELP}."
            ) from error
    found = getattr(module, class_name, None)
    if not isinstance(found, type):
        defined = sorted(
            name
            for name, value in vars(module).items()
            if isinstance(value, type) and value.__module__ == module.__name__
        )
        listing = f" (it defines {', '.join(defined)})" if defined else ""
        raise DoctorError(f"{option} {spec!r}: no class {class_name!r} there{listing}. Pass {option} as {_SPEC_HELP}.")
    return found


def _import_file(path: Path, spec: str, option: str) -> Any:
    if not path.is_file():
        raise DoctorError(f"{option} {spec!r}: no file {str(path)!r}. Pass {option} as {_SPEC_HELP}.")
    resolved = path.resolve()
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"_mgpu_doctor_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    if str(resolved.parent) not in sys.path:
        sys.path.insert(0, str(resolved.parent))
    loader_spec = importlib.util.spec_from_file_location(name, resolved)
    if loader_spec is None or loader_spec.loader is None:
        raise DoctorError(f"{option} {spec!r}: {str(path)!r} cannot be imported as Python.")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module  # dataclasses and pickling look the module up by name while it runs
    try:
        loader_spec.loader.exec_module(module)
    except Exception as error:
        del sys.modules[name]
        raise DoctorError(
            f"{option} {spec!r}: importing {str(path)!r} raised {type(error).__name__}: {error}"
        ) from error
    return module


def read_config(path: str | Path) -> dict[str, Any]:
    """The YAML config as a dict; only its ``model``, ``data`` and ``seed_everything`` keys are used."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise DoctorError(f"--config {str(path)!r} cannot be read ({error}); pass the path of a YAML file.") from error
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise DoctorError(f"--config {str(path)!r} is not valid YAML: {error}") from error
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise DoctorError(
            f"--config {str(path)!r} holds a {type(loaded).__name__}; it must be a mapping with model: and data:"
            " sections, as LightningCLI writes it."
        )
    return loaded


def resolve(
    section: str,
    spec: str | None,
    init_args: Mapping[str, Any] | None,
    configured: Any,
    base: str,
    option: str,
    args_option: str,
) -> tuple[type, dict[str, Any]]:
    """The class and init args of the ``model`` or ``data`` section: options win over the config, init args merge.

    ``base`` names the Lightning class the section's class must subclass, in any installed Lightning namespace.
    """
    config_spec, config_args = _config_section(section, configured)
    spec = spec or config_spec
    if spec is None:
        raise DoctorError(
            f"No {section} class: pass {option} as {_SPEC_HELP}, or a {section}: section with class_path in --config."
        )
    cls = load_class(spec, option)
    if not issubclass(cls, tuple(getattr(namespace, base) for namespace in imported())):
        raise DoctorError(f"{option} {spec!r} is a {cls.__name__}, not a {base}; pass a {base}.")
    return cls, {**config_args, **dict(init_args or {})}


def _config_section(section: str, configured: Any) -> tuple[str | None, dict[str, Any]]:
    if configured is None:
        return None, {}
    if isinstance(configured, str):
        return configured, {}
    if not isinstance(configured, Mapping):
        raise DoctorError(
            f"The config's {section}: section is a {type(configured).__name__}; write it as init args, or as"
            " class_path: and init_args:."
        )
    if "class_path" in configured:
        return str(configured["class_path"]), dict(configured.get("init_args") or {})
    return None, dict(configured)


def instantiate(cls: type, init_args: Mapping[str, Any], section: str, option: str) -> Any:
    """``cls(**init_args)`` as LightningCLI builds it: types checked and converted, nested ``class_path`` built.

    Building through jsonargparse, as LightningCLI does, makes the doctor's model the one ``fit --config`` trains.
    """
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, section, fail_untyped=False)
    try:
        parsed = parser.parse_object({section: dict(init_args)})
    except Exception as error:
        raise DoctorError(
            f"The init args for {cls.__name__} do not fit its __init__: {error}. Fix {option} or the config's"
            f" {section}: section."
        ) from error
    build = getattr(parser, "instantiate", None) or parser.instantiate_classes  # renamed in jsonargparse 4.49
    try:
        return getattr(build(parsed), section)
    except Exception as error:
        raise DoctorError(
            f"{cls.__name__}(...) raised {type(error).__name__}: {error}. Fix {option} or the config's {section}:"
            " section."
        ) from error


def probe_batch(datamodule: pl.LightningDataModule, module: pl.LightningModule | None = None) -> Any:
    """The first batch of ``datamodule.train_dataloader()`` after ``prepare_data()`` and ``setup("fit")``.

    The batch goes through ``on_before_batch_transfer`` and ``on_after_batch_transfer`` (the datamodule's where it
    overrides them, else the module's, as Lightning chooses), since batch-wise augmentation there is part of the
    step the replicas see.
    """
    name = type(datamodule).__name__
    try:
        datamodule.prepare_data()
        datamodule.setup("fit")
        batch = next(iter(datamodule.train_dataloader()))
    except StopIteration as error:
        raise DoctorError(f"{name}.train_dataloader() yields no batch; give the datamodule some data.") from error
    except Exception as error:
        raise DoctorError(
            f"{name} could not give a probe batch: {type(error).__name__}: {error}. The doctor calls prepare_data(),"
            " setup('fit') and takes the first batch of train_dataloader()."
        ) from error
    for hook in _BATCH_HOOKS:
        owner: Any = datamodule if _overrides(datamodule, hook) else module
        if owner is not None:
            try:
                batch = getattr(owner, hook)(batch, 0)
            except Exception as error:
                raise DoctorError(
                    f"{type(owner).__name__}.{hook} raised {type(error).__name__}: {error}. The doctor runs it outside"
                    " a Trainer, so it cannot use self.trainer."
                ) from error
    return batch


def _overrides(datamodule: Any, name: str) -> bool:
    base = (namespace_of(type(datamodule)) or LIGHTNING).LightningDataModule
    return getattr(type(datamodule), name, None) is not getattr(base, name, None)
