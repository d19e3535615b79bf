"""The package's public names, and the 0.1 names kept for one release with a warning naming their successors."""

from __future__ import annotations

import importlib
import warnings

import pytest

import lightning_mgpu

RENAMED = {
    "DataParallel": "MGPUDataParallel",
    "DataParallelStrategy": "MGPUDPStrategy",
    "DDPStrategy": "MGPUDDPStrategy",
}


def test_every_public_name_is_importable() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no public name is a deprecated one
        for name in lightning_mgpu.__all__:
            assert getattr(lightning_mgpu, name) is not None, name
    assert not set(RENAMED) & set(lightning_mgpu.__all__)


@pytest.mark.parametrize(("old", "new"), RENAMED.items())
def test_an_old_name_still_works_and_says_what_replaces_it(old: str, new: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"lightning_mgpu\.{old} is now lightning_mgpu\.{new};.* removed in"):
        value = getattr(lightning_mgpu, old)
    assert value is getattr(lightning_mgpu, new)


def test_an_old_name_in_a_from_import_and_a_yaml_class_path_resolves() -> None:
    with pytest.warns(DeprecationWarning, match="MGPUDDPStrategy"):
        from lightning_mgpu import DDPStrategy  # noqa: F401 - the form a 0.1 script uses
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = parser.parse_args(["--strategy", '{"class_path": "lightning_mgpu.DataParallelStrategy"}'])
        strategy = parser.instantiate_classes(config).strategy
    assert type(strategy) is lightning_mgpu.MGPUDPStrategy
    assert any("is now lightning_mgpu.MGPUDPStrategy" in str(warning.message) for warning in caught)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchThing'"):
        lightning_mgpu.NoSuchThing  # noqa: B018
    assert importlib.import_module("lightning_mgpu") is lightning_mgpu
