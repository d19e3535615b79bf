"""``lightning-mgpu``: the command line. One subcommand per entry of ``_COMMANDS``, dispatched on the first argument.

``fit``, ``validate``, ``test`` and ``predict`` are LightningCLI's (``cli/lightning_cli.py``); ``doctor`` is ours
(``cli/doctor.py``). Each is imported when it runs; the program name and exit codes are ``lightning_mgpu.program``'s.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from lightning_mgpu.helpers import parse_local_rank
from lightning_mgpu.program import EXIT_OK, EXIT_USAGE, PROG

Command = Callable[[list[str]], int]


def main(argv: list[str] | None = None) -> int:
    """Run ``lightning-mgpu <command> ...`` and return its exit code; ``argv`` replaces ``sys.argv[1:]``.

    Started by ``python -m torch.distributed.launch``, the process gets ``--local-rank=N`` before the command; it is
    taken out of ``sys.argv`` first, so that neither the dispatch here nor LightningCLI sees it.
    """
    if argv is None:
        parse_local_rank()
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(_help())
        return EXIT_OK
    if not args or args[0] not in _COMMANDS:
        problem = f"unknown command {args[0]!r}" if args else "no command given"
        print(f"{PROG}: {problem}.\n\n{_help()}", file=sys.stderr)
        return EXIT_USAGE
    command, _ = _COMMANDS[args[0]]
    return command(args[1:])


def _doctor(argv: list[str]) -> int:
    from lightning_mgpu.cli.doctor import doctor

    return doctor(argv)


def _lightning(subcommand: str) -> Command:
    def command(argv: list[str]) -> int:
        from lightning_mgpu.cli.run import run  # imported on use: doctor alone needs no LightningCLI

        return run(subcommand, argv)

    return command


_COMMANDS: dict[str, tuple[Command, str]] = {
    "fit": (_lightning("fit"), "train a model from a YAML config and command-line overrides (LightningCLI)"),
    "validate": (_lightning("validate"), "run the validation loop once"),
    "test": (_lightning("test"), "run the test loop once"),
    "predict": (_lightning("predict"), "run prediction"),
    "doctor": (_doctor, "find a LightningModule's multi-GPU traps on the CPU, before GPU hours are spent"),
}


def _help() -> str:
    width = max(len(name) for name in _COMMANDS)
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in _COMMANDS.items())
    return (
        f"usage: {PROG} <command> [options]\n\ncommands:\n{listing}\n\n"
        f"Run '{PROG} <command> --help' for the options of a command."
    )
