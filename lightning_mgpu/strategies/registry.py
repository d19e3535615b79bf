"""The strategy names in a Lightning namespace's registry, without relying on Lightning core, and their lookup.

Each namespace's registry gets the strategies bound to that namespace: ``lightning.pytorch``'s the public
``lightning_mgpu.MGPUDPStrategy`` and ``MGPUDDPStrategy``, ``pytorch_lightning``'s those of
``strategies/pytorch_lightning.py``, which registers them once it has bound them. ``register_all`` in
``strategies/__init__.py`` says when each namespace gets them.
"""

from __future__ import annotations

import difflib

from lightning_mgpu.namespaces import LIGHTNING, Namespace
from lightning_mgpu.strategies.base import accept_in
from lightning_mgpu.strategies.ddp import MGPUDDPLogic
from lightning_mgpu.strategies.dp import MGPUDPLogic

STRATEGIES = (MGPUDPLogic, MGPUDDPLogic)


def register_with(namespace: Namespace) -> None:
    """Let ``namespace``'s Trainer accept every binding made so far, and register its own with its registry."""
    for strategy in STRATEGIES:
        for binding in strategy.bindings:
            accept_in(namespace, binding)
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
