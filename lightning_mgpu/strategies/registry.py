"""Register the strategy names with Lightning on import, without relying on Lightning core to do it."""

from __future__ import annotations

import difflib

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mgpu.strategies import MGPUDDPStrategy, MGPUDPStrategy

STRATEGIES = (MGPUDPStrategy, MGPUDDPStrategy)


def register_all() -> None:
    """Register ``mgpu_dp`` (and 1.x's ``dp``) and ``mgpu_ddp``; safe to call any number of times, reloads included."""
    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)


def close_names(name: str) -> list[str]:
    """The registered strategy names (and ``"auto"``) that ``name`` most likely meant, best first; maybe none.

    Letter case, ``-`` for ``_`` and a dropped ``_`` are forgiven outright (``mgpu-dp``, ``mgpudp``), so the
    name meant comes first; other misspellings get difflib's closest names.
    """
    names = ["auto", *StrategyRegistry.available_strategies()]
    spelled = name.strip().lower().replace("-", "_").replace(" ", "_")
    exact = [known for known in names if known.replace("_", "") == spelled.replace("_", "")]
    return exact or difflib.get_close_matches(spelled, names, n=3, cutoff=0.6)
