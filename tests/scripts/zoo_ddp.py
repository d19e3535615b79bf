"""Train the named entries of a zoo one after another in one two-process mgpu_ddp job, started by Lightning's launcher.

``--zoo`` names the module of entries (``zoo`` for tests/zoo.py, ``library_zoo`` for tests/library_zoo.py); each
entry trains through that module's ``train_ddp``. Each rank saves what each entry ended with to
``--out/<entry>.rank<r>.pt``, or the traceback to ``.error``, as soon as that entry is done, and goes on with the next,
so one entry's failure leaves the others' results. Read through ``processes.zoo_result``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--zoo", choices=["zoo", "library_zoo"], required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective waits for the other rank")
    parser.add_argument("names", nargs="+")
    args = parser.parse_args()
    zoo = importlib.import_module(args.zoo)
    unknown = sorted(set(args.names) - set(zoo.ZOO))
    if unknown:
        parser.error(f"{args.zoo} has no entries {unknown}")
    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", "0"))  # Lightning's launcher sets it in the ranks it starts
    for name in args.names:
        try:
            outcome = zoo.train_ddp(zoo.ZOO[name], args.timeout)
        except Exception:  # the other rank fails too, at once or when its next collective times out
            (args.out / f"{name}.rank{rank}.error").write_text(traceback.format_exc())
            continue
        torch.save(dataclasses.asdict(outcome), args.out / f"{name}.rank{rank}.pt")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()  # rank 0 ends the job: wait until every rank has written its results


if __name__ == "__main__":
    main()
