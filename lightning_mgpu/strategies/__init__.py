"""The lightning_mgpu strategies, one per file, and ``register_all``, which puts their names in every namespace.

``pytorch_lightning`` is bound when it is imported, before or after this package, never by this package: importing
it would rebind Lightning's loggers.
"""

from types import ModuleType

from lightning_mgpu.import_hook import when_imported
from lightning_mgpu.namespaces import LIGHTNING, PYTORCH_LIGHTNING_PACKAGES, pytorch_lightning_namespace
from lightning_mgpu.strategies.ddp import MGPUDDPStrategy
from lightning_mgpu.strategies.dp import MGPUDPStrategy
from lightning_mgpu.strategies.registry import register_with

__all__ = ["MGPUDDPStrategy", "MGPUDPStrategy", "register_all"]


def register_all() -> None:
    """Register ``mgpu_dp`` (and 1.x's ``dp``) and ``mgpu_ddp*`` with each namespace's registry.

    ``lightning.pytorch``'s at once, ``pytorch_lightning``'s at once where it is imported, else right after its
    import. Safe to call any number of times, reloads included.
    """
    register_with(LIGHTNING)
    when_imported(PYTORCH_LIGHTNING_PACKAGES[0], _bind_pytorch_lightning)


def _bind_pytorch_lightning(module: ModuleType) -> None:
    """Bind the strategies to ``pytorch_lightning``; the module that binds them registers them once it has."""
    if pytorch_lightning_namespace() is not None:  # else a pytorch_lightning without Lightning 2.x's classes
        import lightning_mgpu.strategies.pytorch_lightning  # noqa: F401 - binds and registers the strategies
