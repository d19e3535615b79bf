"""Register the strategy names with every Lightning namespace imported, without relying on Lightning core.

Each namespace's registry gets the strategies bound to that namespace: ``lightning.pytorch``'s the public
``lightning_mgpu.MGPUDPStrategy`` and ``MGPUDDPStrategy``, ``pytorch_lightning``'s those of
``strategies/pytorch_lightning.py``. ``pytorch_lightning`` is bound when it is imported, before or after this
package, never by this package: importing it would rebind Lightning's loggers.
"""

from __future__ import annotations

import difflib
from types import ModuleType

from lightning_mgpu.import_hook import when_imported
from lightning_mgpu.namespaces import LIGHTNING, PYTORCH_LIGHTNING_PACKAGES, Namespace, pytorch_lightning_namespace
from lightning_mgpu.strategies.base import accept_in
from lightning_mgpu.strategies.ddp import MGPUDDPLogic
from lightning_mgpu.strategies.dp import MGPUDPLogic

STRATEGIES = (MGPUDPLogic, MGPUDDPLogic)


def register_all() -> None:
    """Register ``mgpu_dp`` (and 1.x's ``dp``) and ``mgpu_ddp*`` with each namespace's registry.

    ``lightning.pytorch``'s at once, ``pytorch_lightning``'s at once where it is imported, else right after its
    import. Safe to call any number of times, reloads included.
    """
    register_with(LIGHTNING)
    when_imported(PYTORCH_LIGHTNING_PACKAGES[0], _bind_pytorch_lightning)


def register_with(namespace: Namespace) -> None:
    """Let ``namespace``'s Trainer accept every binding made so far, and register its own with its registry."""
    for strategy in STRATEGIES:
        for binding in strategy.bindings:
            accept_in(namespace, binding)
        strategy.bindings[namespace].register_strategies(namespace.StrategyRegistry)


def _bind_pytorch_lightning(module: ModuleType) -> None:
    """Bind the strategies to ``pytorch_lightning``; the module that binds them registers them once it has."""
    if pytorch_lightning_namespace() is not None:  # else a pytorch_lightning without Lightning 2.x's classes
        import lightning_mgpu.strategies.pytorch_lightning  # noqa: F401 - binds and registers the strategies


def close_names(name: str, namespace: Namespace = LIGHTNING) -> list[str]:
    """The strategy names registered in ``namespace`` (and ``"auto"``) that ``name`` most likely meant, best first.

    Letter case, ``-`` for ``_`` and a dropped ``_`` are forgiven outright (``mgpu-dp``, ``mgpudp``), so the
    name meant comes first; other misspellings get difflib's closest names; maybe none.
    """
    names = ["auto", *namespace.StrategyRegistry.available_strategies()]
    spelled = name.strip().lower().replace("-", "_").replace(" ", "_")
    exact = [known for known in names if known.replace("_", "") == spelled.replace("_", "")]
    return exact or difflib.get_close_matches(spelled, names, n=3, cutoff=0.6)
