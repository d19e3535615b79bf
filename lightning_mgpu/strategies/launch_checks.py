"""Fail fast when the processes a launcher started disagree with ``Trainer(devices=..., num_nodes=...)``.

Under torchrun, SLURM or a hand-made launch, each process reads its rank from the launcher's variables while
Lightning derives the group's size from the Trainer. When the two disagree, the processes wait for partners that
were never started (until the collective timeout, 30 minutes by default) or fail with an error that names neither
number. Every process can see the mismatch on its own, so each raises at once, without talking to the others.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from lightning.fabric.plugins import ClusterEnvironment

from lightning_mgpu.errors import ConfigurationError
from lightning_mgpu.namespaces import namespace_of


@dataclass(frozen=True)
class _Launch:
    """What one launcher reports, each number with the variable it came from; ``None`` where it says nothing."""

    name: str
    processes: tuple[int, str] | None = None
    per_node: tuple[list[int], str] | None = None
    nodes: tuple[int, str] | None = None
    local_rank: tuple[int, str] | None = None
    node_rank: tuple[int, str] | None = None
    fix: str = ""


def check_launch_matches_trainer(
    environment: ClusterEnvironment | None, devices: int, num_nodes: int, environ: Mapping[str, str] | None = None
) -> None:
    """Raise :class:`ConfigurationError` when the launcher's process counts disagree with the Trainer's.

    Checked: the total number of processes against ``devices * num_nodes``, the processes per node against
    ``devices``, and the number of nodes against ``num_nodes``, wherever the launcher states them. Nothing is
    checked when Lightning starts the processes itself, or under a cluster environment other than torchrun's,
    SLURM's or Lightning's own.

    Args:
        environment: the Trainer's cluster environment; it tells which launcher's variables to read.
        devices: the devices per node, as the Trainer resolved them (``len(parallel_devices)``).
        num_nodes: ``Trainer(num_nodes=...)``.
        environ: the process's environment variables; ``os.environ`` when ``None``.
    """
    launch = _read_launch(environment, os.environ if environ is None else environ, devices, num_nodes)
    if launch is None:
        return
    trainer = f"Trainer(devices={devices}, num_nodes={num_nodes})"
    expected = devices * num_nodes
    problems: list[tuple[str, str | None]] = []  # each with the Trainer setting it concerns, if only one
    if launch.processes is not None and launch.processes[0] != expected:
        count, source = launch.processes
        problems.append(
            (f"{launch.name} started {_processes(count)} ({source}) but {trainer} expects {expected}", None)
        )
    if launch.per_node is not None and any(count != devices for count in launch.per_node[0]):
        counts, source = launch.per_node
        started = f"{_processes(counts[0])} per node" if len(set(counts)) == 1 else f"{_listed(counts)} processes"
        problems.append(
            (f"{launch.name} started {started} ({source}) but {trainer} expects {devices} per node", "Trainer.devices")
        )
    if launch.nodes is not None and launch.nodes[0] != num_nodes:
        count, source = launch.nodes
        problems.append(
            (
                f"{launch.name} runs on {_plural(count, 'node')} ({source}) but {trainer} expects {num_nodes}",
                "Trainer.num_nodes",
            )
        )
    if launch.local_rank is not None and not 0 <= launch.local_rank[0] < devices:
        rank, source = launch.local_rank
        problems.append(
            (
                f"this process has local rank {rank} ({source}) but {trainer} allows {_ranks('local', devices)}",
                "Trainer.devices",
            )
        )
    if launch.node_rank is not None and not 0 <= launch.node_rank[0] < num_nodes:
        rank, source = launch.node_rank
        problems.append(
            (
                f"this process has node rank {rank} ({source}) but {trainer} allows {_ranks('node', num_nodes)}",
                "Trainer.num_nodes",
            )
        )
    if problems:
        concerned = {setting for _, setting in problems if setting is not None}
        lines = "".join(f"\n  - {problem}" for problem, _ in problems)
        raise ConfigurationError(
            "The processes the launcher started do not match Trainer(devices=..., num_nodes=...); left alone,"
            f" training would hang until the collective timeout or fail obscurely:{lines}\nFix: {launch.fix}",
            setting="Trainer.num_nodes" if concerned == {"Trainer.num_nodes"} else "Trainer.devices",
        )


def _read_launch(
    environment: ClusterEnvironment | None, environ: Mapping[str, str], devices: int, num_nodes: int
) -> _Launch | None:
    namespace = namespace_of(type(environment))  # lightning.fabric's under lightning.pytorch, else lightning_fabric's
    if namespace is None:
        return None
    if isinstance(environment, namespace.TorchElasticEnvironment):
        return _torchrun(environ, devices, num_nodes)
    if isinstance(environment, namespace.SLURMEnvironment):
        return _slurm(environ, devices, num_nodes)
    if isinstance(environment, namespace.LightningEnvironment) and "LOCAL_RANK" in environ:
        return _by_hand(environ, devices, num_nodes)
    return None  # Lightning starts the processes (or an environment whose variables this module does not know)


def _torchrun(environ: Mapping[str, str], devices: int, num_nodes: int) -> _Launch:
    """torchrun, and ``python -m torch.distributed.launch``, which is torchrun underneath on torch 2."""
    world = _int(environ, "WORLD_SIZE")
    local = _int(environ, "LOCAL_WORLD_SIZE")
    nodes = None
    if world is not None and local is not None and local > 0 and world % local == 0:
        nodes = (world // local, f"WORLD_SIZE={world} / LOCAL_WORLD_SIZE={local}")
    started = f"devices={local}, num_nodes={nodes[0]}" if local is not None and nodes is not None else None
    fix = (
        f"start torchrun with --nproc-per-node {devices} --nnodes {num_nodes} (torch.distributed.launch:"
        f" --nproc_per_node {devices} --nnodes {num_nodes}), what the Trainer expects"
        + (f", or build the Trainer with {started}, what torchrun started." if started else ".")
    )
    return _Launch(
        "torchrun",
        processes=_with_source(world, "WORLD_SIZE"),
        per_node=([local], f"LOCAL_WORLD_SIZE={local}") if local is not None else None,
        nodes=nodes,
        fix=fix,
    )


def _slurm(environ: Mapping[str, str], devices: int, num_nodes: int) -> _Launch:
    """SLURM's variables for the job step that ``srun`` started."""
    per_node: tuple[list[int], str] | None = None
    explicit = _int(environ, "SLURM_NTASKS_PER_NODE")
    if explicit is not None:
        per_node = ([explicit], f"SLURM_NTASKS_PER_NODE={explicit}")
    elif (counts := _tasks_per_node(environ.get("SLURM_TASKS_PER_NODE", ""))) is not None:
        per_node = (counts, f"SLURM_TASKS_PER_NODE={environ['SLURM_TASKS_PER_NODE']}")
    nodes = _int(environ, "SLURM_NNODES")
    nodes_source = "SLURM_NNODES"
    if nodes is None:
        nodes, nodes_source = _int(environ, "SLURM_JOB_NUM_NODES"), "SLURM_JOB_NUM_NODES"
    started = None
    if per_node is not None and len(set(per_node[0])) == 1 and nodes is not None:
        started = f"devices={per_node[0][0]}, num_nodes={nodes}"
    fix = (
        f"ask SLURM for --ntasks-per-node={devices} --nodes={num_nodes} (in #SBATCH lines or on srun), what the"
        " Trainer expects" + (f", or build the Trainer with {started}, what SLURM started." if started else ".")
    )
    return _Launch(
        "SLURM",
        processes=_with_source(_int(environ, "SLURM_NTASKS"), "SLURM_NTASKS"),
        per_node=per_node,
        nodes=_with_source(nodes, nodes_source),
        local_rank=None if per_node is not None else _with_source(_int(environ, "SLURM_LOCALID"), "SLURM_LOCALID"),
        fix=fix,
    )


def _by_hand(environ: Mapping[str, str], devices: int, num_nodes: int) -> _Launch:
    """A launcher Lightning does not recognise (an old ``torch.distributed.launch``, a script): LOCAL_RANK is set."""
    world = _int(environ, "WORLD_SIZE")
    node_rank = _int(environ, "NODE_RANK")
    node_source = "NODE_RANK"
    if node_rank is None:
        node_rank, node_source = _int(environ, "GROUP_RANK"), "GROUP_RANK"
    return _Launch(
        "the launcher",
        processes=_with_source(world, "WORLD_SIZE"),
        local_rank=_with_source(_int(environ, "LOCAL_RANK"), "LOCAL_RANK"),
        node_rank=_with_source(node_rank, node_source),
        fix=(
            f"start {_processes(devices)} per node on {_plural(num_nodes, 'node')} (WORLD_SIZE={devices * num_nodes},"
            f" LOCAL_RANK below {devices}, NODE_RANK below {num_nodes}), what the Trainer expects, or set"
            " Trainer(devices=..., num_nodes=...) to the processes per node and the nodes the launcher starts."
        ),
    )


def _int(environ: Mapping[str, str], name: str) -> int | None:
    """The variable as an integer; ``None`` when unset or unreadable, which leaves its rule unchecked."""
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def _with_source(value: int | None, name: str) -> tuple[int, str] | None:
    return None if value is None else (value, f"{name}={value}")


def _tasks_per_node(value: str) -> list[int] | None:
    """SLURM's compressed per-node task counts: ``"2(x3),1"`` is ``[2, 2, 2, 1]``; ``None`` when unreadable."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if match is None:
            return None
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}es" if noun.endswith("s") else f"{count} {noun}s"


def _processes(count: int) -> str:
    return _plural(count, "process")


def _ranks(kind: str, count: int) -> str:
    return f"{kind} rank 0 only" if count == 1 else f"{kind} ranks 0 to {count - 1}"


def _listed(counts: list[int]) -> str:
    """``[2, 2, 1]`` as ``"2, 2 and 1"``: the nodes' differing counts, named in order."""
    words = [str(count) for count in counts]
    return ", ".join(words[:-1]) + f" and {words[-1]}"
