"""Helpers for scripts started by ``python -m torch.distributed.launch``, which passes the local rank as a flag."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence


def add_local_rank_argument(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let ``parser`` accept the local rank however the launcher spells it.

    ``torch.distributed.launch`` passes ``--local-rank=N`` since torch 2.0 and ``--local_rank N`` before; a script
    that parses its own arguments dies on the spelling it does not know. Both land in ``args.local_rank``, which
    defaults to the ``LOCAL_RANK`` environment variable (torchrun) or 0.
    """
    parser.add_argument(
        "--local-rank",
        "--local_rank",
        dest="local_rank",
        type=int,
        default=int(os.environ.get("LOCAL_RANK", 0)),
        help="set by torch.distributed.launch; Lightning reads the rank from the environment",
    )
    return parser


def parse_local_rank(argv: Sequence[str] | None = None) -> int:
    """Take the local rank out of ``argv`` (default ``sys.argv``), leaving the script's other arguments alone.

    Accepts ``--local-rank=N``, ``--local-rank N``, ``--local_rank=N`` and ``--local_rank N``; falls back to
    ``LOCAL_RANK`` and then 0. When ``argv`` is ``sys.argv`` the flag is removed from it, so a LightningCLI or
    argparse parser that runs afterwards never sees it.

    Only a rank passed as a flag is written to ``LOCAL_RANK`` (where the legacy launcher does not set it): outside
    any launcher the variable stays unset, since Lightning takes a set ``LOCAL_RANK`` to mean that another program
    started the processes, and would then wait for ranks that nobody starts.
    """
    in_place = argv is None
    arguments = sys.argv if argv is None else list(argv)
    parser = add_local_rank_argument(argparse.ArgumentParser(add_help=False, allow_abbrev=False))
    parser.set_defaults(local_rank=None)
    known, rest = parser.parse_known_args(arguments[1:])
    if in_place:
        sys.argv[1:] = rest
    if known.local_rank is None:
        return int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("LOCAL_RANK", str(known.local_rank))
    return int(known.local_rank)
