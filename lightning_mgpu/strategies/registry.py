"""Register the strategy names with every installed Lightning namespace on import, without relying on Lightning core.

Each namespace's registry gets the strategies bound to that namespace: ``lightning.pytorch``'s the public
``lightning_mgpu.MGPUDPStrategy`` and ``MGPUDDPStrategy``, ``pytorch_lightning``'s those of
``strategies/pytorch_lightning.py``.
"""

from __future__ import annotations

import difflib

from lightning_mgpu.namespaces import INSTALLED, LIGHTNING, PYTORCH_LIGHTNING, Namespace
from lightning_mgpu.strategies.ddp import MGPUDDPLogic
from lightning_mgpu.strategies.dp import MGPUDPLogic

if PYTORCH_LIGHTNING is not None:
    import lightning_mgpu.strategies.pytorch_lightning  # noqa: F401 - binds the strategies to pytorch_lightning

STRATEGIES = (MGPUDPLogic, MGPUDDPLogic)


def register_all() -> None:
    """Register ``mgpu_dp`` (and 1.x's ``dp``) and ``mgpu_ddp*`` with each namespace's registry.

    Safe to call any number of times, reloads included.
    """
    for namespace in INSTALLED:
        for strategy in STRATEGIES:
            strategy.bindings[namespace].register_strategies(namespace.StrategyRegistry)


def close_names(name: str, namespace: Namespace = LIGHTNING) -> list[str]:
    """The strategy names registered in ``namespace`` (and ``"auto"``) that ``name`` most likely meant, best first.

    Letter case, ``-`` for ``_`` and a dropped ``_`` are forgiven outright (``mgpu-dp``, ``mgpudp``), so the
    name meant comes first; other misspellings get difflib's closest names; maybe none.
    """
    names = ["auto", *namespace.StrategyRegistry.available_strategies()]
    spelled = name.strip().lower().replace("-", "_").replace(" ", "_")
    exact = [known for known in names if known.replace("_", "") == spelled.replace("_", "")]
    return exact or difflib.get_close_matches(spelled, names, n=3, cutoff=0.6)
