"""``MGPUDDPStrategy(gather_step_end=True)``: every rank's step output, gathered for ``*_step_end`` in batch order.

Each rank describes its output first: its structure, the shape and dtype of each tensor, every other value. One
``all_gather_object`` gives every rank every description, so all ranks judge the same facts: an output that cannot be
gathered is refused by every rank at once, naming the key path and the rank, and no rank is left waiting in a
collective that the others never reach. The tensors follow, one ``all_gather`` each, padded to the longest rank's
rows. In training the gather is an autograd function whose backward adds up the gradient every rank computed for
each slice: each rank computes the same loss over the whole batch, so DDP's average of the ranks' parameter
gradients is one device's gradient of that loss, with no scaling by the world size. The outputs are then merged by
the rules ``mgpu_dp`` merges its replicas' outputs by (``lightning_mgpu.engine.gather``), a rank being a replica and
rank 0's rows coming first; a rank without a real row (the padding row of an uneven last step) is left out.
"""

from __future__ import annotations

import dataclasses
import numbers
import pickle
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_mgpu.engine.gather import gather
from lightning_mgpu.engine.scatter import (
    LayoutMemory,
    field_values,
    is_dataclass_instance,
    is_namedtuple,
    rebuild_dataclass,
    rebuild_mapping,
    rebuild_sequence,
)
from lightning_mgpu.errors import GatherError

_META = torch.device("meta")


@dataclasses.dataclass(frozen=True)
class _TensorFacts:
    """What every rank needs to know of one tensor of a rank's output to gather it: no data."""

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclasses.dataclass(frozen=True)
class _Unpicklable:
    """An object that cannot cross processes, described for the error that every rank raises about it."""

    kind: str
    text: str

    def stand_in(self) -> Any:
        """An object of a class named like the original's, whose ``repr`` is the original's, for the merge's error."""
        text = self.text
        return type(self.kind, (), {"__repr__": lambda _: text})()


class RankGather:
    """Gathers one method's step outputs across the ranks; keeps how each of its lists was read, as ``mgpu_dp`` does.

    Args:
        method: the step whose outputs these are (``"training_step"``, ...), named in errors.
    """

    def __init__(self, method: str) -> None:
        self.method = method
        self.rows = 0
        """The real rows of every rank together in the last step gathered."""
        self._layouts = LayoutMemory()

    def __call__(self, output: Any, rows: int, device: torch.device, differentiable: bool) -> Any:
        """Every rank's ``output`` merged in rank order, on ``device``; every rank must call it for the same step.

        Args:
            output: this rank's output, or ``NO_OUTPUT`` for a rank that ran no step (a padding row in evaluation).
            rows: this rank's real rows in the step; 0 for a padding row, whose output (which training needs, so
                that its backward reaches every parameter, as DDP requires) is gathered but left out of the merge.
            device: where the gathered tensors go (the rank's own device, which the process group needs).
            differentiable: gather through an autograd function, so that gradients reach every rank's own output.

        Raises:
            GatherError: on every rank, for outputs that cannot be gathered; ``replica`` is then the rank.
        """
        local_tensors: list[torch.Tensor] = []
        description = None if output is NO_OUTPUT else _describe(output, local_tensors)
        described: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(described, (rows, description))
        senders = [rank for rank, (_, sent) in enumerate(described) if sent is not None]
        ranks = [rank for rank in senders if described[rank][0] > 0]
        sizes = [described[rank][0] for rank in ranks]
        self.rows = sum(sizes)
        facts = {rank: _tensor_facts(described[rank][1]) for rank in senders}
        descriptions = [described[rank][1] for rank in ranks]
        with _named_by_rank(ranks, self.method):
            placeholders = [_built(description, _placeholder) for description in descriptions]
            gather(placeholders, _META, sizes, memory=self._layouts)
            _check_tensors_pair_up(facts, ranks[0])
        by_rank = _exchange_tensors(local_tensors, facts, ranks, dist.get_rank(), device, differentiable)
        outputs = [
            _built(description, _from(by_rank[rank])) for rank, description in zip(ranks, descriptions, strict=True)
        ]
        with _named_by_rank(ranks, self.method):
            return gather(outputs, device, sizes, memory=self._layouts)


NO_OUTPUT = object()
"""What a rank that ran no step gives ``RankGather``: it takes part in the collectives and adds nothing."""


def _describe(output: Any, tensors: list[torch.Tensor]) -> Any:
    """``output`` with each tensor replaced by its facts (and put in ``tensors``), and what cannot cross by a marker."""

    def leaf(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            return _TensorFacts(len(tensors) - 1, path, tuple(value.shape), value.dtype, value.requires_grad)
        if value is None or isinstance(value, (str, bytes, bool, numbers.Number)):
            return value
        try:
            pickle.dumps(value)
        except Exception:  # noqa: BLE001 - whatever pickling raises, the object cannot cross processes
            return _Unpicklable(type(value).__name__, f"{value!r:.40}")
        return value  # merging refuses it, on every rank alike

    return _leaves_mapped(output, "output", leaf)


def _built(description: Any, tensor_for: Callable[[_TensorFacts], Any]) -> Any:
    """A rank's output rebuilt from its description, each tensor's facts replaced by ``tensor_for(facts)``."""

    def leaf(value: Any, path: str) -> Any:
        if isinstance(value, _TensorFacts):
            return tensor_for(value)
        return value.stand_in() if isinstance(value, _Unpicklable) else value

    return _leaves_mapped(description, "output", leaf)


def _leaves_mapped(value: Any, path: str, leaf: Callable[[Any, str], Any]) -> Any:
    """``value`` with its containers rebuilt (types kept) and every other value ``leaf(value, its key path)``."""
    if isinstance(value, (torch.Tensor, _TensorFacts, _Unpicklable)):
        return leaf(value, path)
    if isinstance(value, Mapping):
        return rebuild_mapping(
            value, [(key, _leaves_mapped(item, f"{path}[{key!r}]", leaf)) for key, item in value.items()], path
        )
    if is_dataclass_instance(value):
        fields = [(name, _leaves_mapped(item, f"{path}.{name}", leaf)) for name, item in field_values(value)]
        return rebuild_dataclass(value, fields)
    if isinstance(value, (list, tuple)):
        items = [_leaves_mapped(item, f"{path}[{index}]", leaf) for index, item in enumerate(value)]
        return type(value)(*items) if is_namedtuple(value) else rebuild_sequence(value, items)
    return leaf(value, path)


def _from(tensors: list[torch.Tensor]) -> Callable[[_TensorFacts], torch.Tensor]:
    """What stands for each tensor of a rank's description: the tensor received for it."""
    return lambda facts: tensors[facts.index]


def _placeholder(facts: _TensorFacts) -> torch.Tensor:
    """A tensor of the facts' shape and dtype that holds no data, to check the outputs merge before moving any."""
    return torch.empty(facts.shape, dtype=facts.dtype, device=_META)


def _tensor_facts(description: Any) -> list[_TensorFacts]:
    found: list[_TensorFacts] = []
    _built(description, lambda facts: found.append(facts))
    return sorted(found, key=lambda facts: facts.index)


def _check_tensors_pair_up(facts: dict[int, list[_TensorFacts]], reference: int) -> None:
    """Every rank's tensors pair up with rank ``reference``'s, one to one and of one dtype, as ``all_gather`` needs.

    A padding row's output is not merged, so only this says that it differs.
    """
    first = facts[reference]
    for rank, tensors in facts.items():
        who = f"rank {rank}"
        if len(tensors) != len(first):
            raise GatherError(
                f"the output of {who} holds {len(tensors)} tensor(s) where the others hold {len(first)}. Return the"
                " same structure from every rank, a padding row's step included.",
                "output",
            )
        for own, theirs in zip(tensors, first, strict=True):
            if own.dtype != theirs.dtype:
                raise GatherError(
                    f"{own.path} is a {own.dtype} tensor in {who} but a {theirs.dtype} tensor elsewhere. Return"
                    " the same dtype from every rank.",
                    own.path,
                )


def _exchange_tensors(
    local: list[torch.Tensor],
    facts: dict[int, list[_TensorFacts]],
    ranks: list[int],
    rank: int,
    device: torch.device,
    differentiable: bool,
) -> dict[int, list[torch.Tensor]]:
    """The tensors of ``ranks``, by rank: one ``all_gather`` per tensor, each padded to the longest of the senders.

    ``facts`` holds every rank that ran a step (``ranks`` are those among them with real rows).
    """
    received: dict[int, list[torch.Tensor]] = {other: [] for other in ranks}
    for index, first in enumerate(facts[ranks[0]]):
        shapes = {sender: tensors[index].shape for sender, tensors in facts.items()}
        rows = {sender: shape[0] if shape else 1 for sender, shape in shapes.items()}  # a 0-dim tensor: one row
        trailing = first.shape[1:]
        if rank in facts:
            mine = local[index].to(device).reshape(-1, *trailing)
        else:  # no step ran here: only a place in the collective
            mine = torch.zeros((0, *trailing), dtype=first.dtype, device=device)
        padded = _padded(mine, max(rows.values()))
        # Every rank gathers through the autograd function or none does, so that every rank's backward reaches it.
        if differentiable and any(tensors[index].requires_grad for tensors in facts.values()):
            if not padded.requires_grad:
                padded = padded.detach().requires_grad_(True)
            pieces = _AllGather.apply(padded)
        else:
            pieces = _all_gather(padded.detach())
        for other in ranks:
            received[other].append(pieces[other][: rows[other]].reshape(shapes[other]))
    return received


def _padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if tensor.shape[0] == rows:
        return tensor
    padding = tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))
    return torch.cat([tensor, padding])


def _all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` (all of one shape), stacked in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return torch.stack(pieces)


class _AllGather(torch.autograd.Function):
    """``_all_gather`` whose backward gives each rank the sum over the ranks of the gradient of its own slice.

    Every rank computes the same loss from the gathered batch, so the sum is the world size times one device's
    gradient of that rank's rows; DDP's average over the ranks then makes every parameter's gradient one device's.
    An all-reduce of the whole gradient serves every backend (gloo has no reduce-scatter).
    """

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.rank = dist.get_rank()
        return _all_gather(tensor.detach())

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total[ctx.rank]


class _named_by_rank:  # noqa: N801 - used as a context manager, named like contextlib's
    """Re-raise the merge's ``GatherError`` in the words of ranks: ``replica i`` is the i-th rank with real rows."""

    def __init__(self, ranks: list[int], method: str) -> None:
        self.ranks = ranks
        self.method = method

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, traceback: Any) -> None:
        if not isinstance(error, GatherError):
            return
        ranks = self.ranks
        message = re.sub(r"\breplica (\d+)", lambda found: f"rank {ranks[int(found.group(1))]}", str(error))
        message = message.replace("replicas", "ranks").replace("every replica", "every rank")
        replica = None if error.replica is None else ranks[error.replica]
        raised = GatherError(message, error.path, replica)
        raised.add_note(
            f"lightning_mgpu: every rank's {self.method} output is gathered for its *_step_end hook"
            " (MGPUDDPStrategy(gather_step_end=True)); every rank raises this error."
        )
        raise raised from None
