"""Split a batch into one chunk per replica: tensors along dim 0, per-sample sequences by items.

The contract, which ``gather`` inverts:

* N, the batch's row count, is the common dim-0 size of the tensors nearest the top of the batch: those inside the
  fewest plain lists and tuples. Mappings, dataclasses, namedtuples and ``Fields`` add no level; a ``PerSample``
  counts with its length, and nothing inside it counts.
* Tensors are split along dim 0 and must have N rows. Mappings, dataclasses (``init=False`` fields included),
  namedtuples and ``Fields`` are containers, rebuilt with their type, every value read by these rules. Any other
  value reaches every replica whole.
* A ``PerSample`` is split by items. A plain list or tuple is a container, as ``torch.nn.DataParallel`` reads it,
  unless it has N items that prove one item per sample: an item is or holds a tensor whose dim 0 is not N or a
  0-dim tensor, or no item holds a tensor (names, ids, None). An item that is or holds a ``PerSample`` or
  ``Fields``, which only fields of a batch hold, keeps it a container, and so do items that differ (in type, or
  in a tensor's dtype or trailing shape). N alike items whose tensors all have N rows read both ways: such a list
  is read as the same method's earlier batches read its key path (a ``LayoutMemory``), and with no such reading,
  or no memory (the module's functions), ``BatchSplitError`` asks for a marker. A path read one way may not be
  proven the other way by a later batch: that is an error too. With one chunk the readings agree and nothing is
  asked. Where the caller knows what built the batch (a ``Source``), the builder decides instead: torch's
  ``default_collate`` transposes samples, so a list it returns holds fields unless it is N strings or bytes, and
  ``torch.nn.DataParallel`` splits a list among ``forward``'s inputs as fields where its items read both ways.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import numbers
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any

import torch

from lightning_mgpu.errors import BatchSplitError, ConfigurationError, GatherError


class PerSample(list[Any]):
    """A list with one item per sample of the batch, split between replicas by items and never inside an item.

    Return it from a ``collate_fn`` for per-sample data that does not stack into one tensor, such as one boxes
    tensor per image: ``{"images": torch.stack(images), "boxes": PerSample(boxes)}``. Each replica receives a
    ``PerSample`` of its own samples, in batch order, with its tensors on the replica's device. A plain list of N
    items is read per sample without the marker when its items prove it (a tensor whose first size is not N, or no
    tensor at all), or when they read both ways (N images with exactly N boxes each) and earlier batches proved it
    at that key path; the marker makes every batch say so, the first one included. A ``PerSample`` returned from a
    step is concatenated across replicas in batch order, whatever its length.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"PerSample({list.__repr__(self)})"


class Fields(list[Any]):
    """A list of batch fields, ``[inputs, targets]``, split field by field and never read as one item per sample.

    A plain list is read as fields already unless its items prove one item per sample, so the marker states that
    default explicitly, for a reader of the ``collate_fn`` as much as for ``mgpu_dp``. It changes the split where
    the items would prove one per sample (two lists of names in a batch of 2 rows stay two fields) and where they
    read both ways (``[x, y]`` of alike tensors in a batch of 2 rows, with no earlier batch to tell). Returned from
    a step, it is gathered item by item, never concatenated as one item per row.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Fields({list.__repr__(self)})"


class Source(enum.Enum):
    """What built a batch, where the caller knows: the builder tells how a plain list or tuple in it reads."""

    DEFAULT_COLLATE = enum.auto()
    """torch's ``default_collate``: it transposes samples into fields, and its only list with one item per sample
    is the batch's strings or bytes, so every other list is fields."""
    FORWARD_INPUTS = enum.auto()
    """``forward``'s inputs, which ``torch.nn.DataParallel`` splits as fields: a list whose items read both ways
    is fields."""


class LayoutMemory:
    """How each plain list or tuple of one method's batches, or of its step outputs, was read, by key path.

    A list can read both ways: N alike items whose tensors all have N rows may be a batch's fields or one item per
    sample, and a step's tensors with the chunk's rows may be gathered item by item or concatenated. Calls of one
    method see the same structure, and the first ones normally tell (a batch of another size, per-image tensors of
    differing lengths), so the reading a path had then decides when the items do not. ``MGPUDataParallel`` keeps
    one for the batches and one for the outputs of each method.
    """

    __slots__ = ("_by_items",)

    def __init__(self) -> None:
        self._by_items: dict[str, bool] = {}

    def recall(self, path: str) -> bool | None:
        """``True`` when ``path`` was read by items (one per sample or row), ``False`` when field by field."""
        return self._by_items.get(path)

    def remember(self, path: str, by_items: bool) -> None:
        """Record the first reading of ``path``; callers recall before they decide, so it never changes."""
        self._by_items.setdefault(path, by_items)


def chunk_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Sizes that differ by at most one, one per replica; fewer replicas when the batch is smaller.

    ``torch.chunk`` would give 5 rows on 4 devices as 2 + 2 + 1 (three replicas); this gives 2 + 1 + 1 + 1.
    """
    _check_not_empty(batch_size)
    num_chunks = min(batch_size, num_devices)
    base, extra = divmod(batch_size, num_chunks)
    return [base + 1 if i < extra else base for i in range(num_chunks)]


def weighted_chunk_sizes(batch_size: int, weights: Sequence[float]) -> list[int]:
    """Rows per device in proportion to ``weights``: one entry per device, zeros included, summing to the batch.

    Largest-remainder rounding: each device gets the whole part of its exact share, and the rows left over go one
    each to the largest fractional parts, the earlier device first on a tie. Every size is therefore within one
    row of the exact share, the split depends on nothing but the arguments (exact arithmetic, no float rounding),
    and equal weights give ``chunk_sizes``'s split, zeros appended. ``weights`` must have passed
    ``check_chunk_weights``.
    """
    _check_not_empty(batch_size)
    shares = _integer_shares(weights)
    total = sum(shares)
    sizes: list[int] = []
    remainders: list[int] = []
    for share in shares:
        size, remainder = divmod(batch_size * share, total)
        sizes.append(size)
        remainders.append(remainder)
    left = batch_size - sum(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-remainders[i], i))[:left]:
        sizes[index] += 1
    return sizes


def check_chunk_weights(weights: Any, name: str = "chunk_weights") -> tuple[float, ...]:
    """``weights`` as a tuple, or ``ConfigurationError`` naming the entry that cannot be a share of a batch.

    Checked once, where the option is given, so that a bad value stops the run before any step does.
    """
    example = f"{name}=[1, 2, 2, 2] gives the first of four devices half the rows of each of the others"
    setting = f"{'MGPUDPStrategy' if name == 'device_weights' else 'MGPUDataParallel'}.{name}"
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Sequence):
        raise ConfigurationError(
            f"{name} must be a list with one number per device (the device's relative share of every batch), but"
            f" got {weights!r}. For example, {example}.",
            setting=setting,
        )
    checked: list[float] = []
    for index, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise ConfigurationError(
                f"{name}[{index}] is {weight!r}, but each weight must be a number: the device's relative share of"
                f" every batch. For example, {example}.",
                setting=setting,
            )
        value: float = int(weight) if isinstance(weight, numbers.Integral) else float(weight)
        if not math.isfinite(value):
            raise ConfigurationError(
                f"{name}[{index}] is {value}, which is not a finite number, so no share of the batch can be worked"
                f" out from it. Give every device a finite weight of 0 or more; for example, {example}.",
                setting=setting,
            )
        if value < 0:
            raise ConfigurationError(
                f"{name}[{index}] is {value}, but a device cannot take a negative share of the batch. Give every"
                f" device a weight of 0 or more (0 gives it no rows); for example, {example}.",
                setting=setting,
            )
        checked.append(value)
    if not any(checked):
        raise ConfigurationError(
            f"{name} is {list(weights)!r}: every weight is zero, so no device would get any rows. Give at least one"
            f" device a positive weight; for example, {example}.",
            setting=setting,
        )
    return tuple(checked)


def check_chunk_weight_count(
    weights: Sequence[float], devices: Sequence[torch.device], name: str, owner: str, source: str = ""
) -> None:
    """``ConfigurationError`` unless there is one weight per device; ``owner`` has the devices, set by ``source``."""
    if len(weights) == len(devices):
        return
    shown = ", ".join(str(device) for device in devices)
    set_by = f", set by {source}" if source else ""
    raise ConfigurationError(
        f"{name} has {len(weights)} weight(s), {list(weights)!r}, but {owner} has {len(devices)} device(s)"
        f" ({shown}){set_by}. Give one weight per device, in device order (the first is the root device), for"
        f" example {name}={[1] * len(devices)} for an even split, or change the number of devices.",
        setting=f"{owner}.{name}",
    )


def batch_size_of(batch: Any) -> int:
    """The batch's row count N: the common dim-0 size of the tensors nearest the top of the batch.

    Tensors inside plain lists and tuples count only when no tensor sits at a shallower level, because such a list
    may hold one item per sample (one boxes tensor per image) whose sizes are not the row count.

    Raises:
        BatchSplitError: no tensor with a batch dimension, or the nearest tensors disagree.
    """
    return _row_count(batch)[0]


def scatter(
    batch: Any,
    devices: Sequence[torch.device],
    weights: Sequence[float] | None = None,
    *,
    memory: LayoutMemory | None = None,
    source: Source | None = None,
) -> tuple[list[Any], list[int]]:
    """Split ``batch`` into chunks, each moved to its device.

    Args:
        batch: tensors, per-sample sequences and containers of them (see the module docstring for the rules).
        devices: one per replica; a batch with fewer rows than devices uses the first ones.
        weights: one relative share per device (see ``weighted_chunk_sizes``); ``None`` splits evenly. A device
            whose share rounds to no rows gets no chunk, so the chunks may go to other devices than the first ones:
            ``scatter_to_devices`` says which.
        memory: how earlier batches read each plain list, by key path, updated with this batch's readings; it
            decides a list whose items read both ways. Without it such a list is refused.
        source: what built the batch, where the caller knows; it reads the lists as that builder made them,
            ahead of ``memory``.

    Returns:
        The chunks and their sizes along dim 0.

    Raises:
        BatchSplitError: the batch cannot be split consistently; the message names the key path and the fix.
    """
    chunks, sizes, _ = scatter_to_devices(batch, devices, weights, memory=memory, source=source)
    return chunks, sizes


def scatter_to_devices(
    batch: Any,
    devices: Sequence[torch.device],
    weights: Sequence[float] | None = None,
    *,
    memory: LayoutMemory | None = None,
    source: Source | None = None,
) -> tuple[list[Any], list[int], list[torch.device]]:
    """``scatter``, also returning the device of each chunk: the devices given rows, in device order.

    Chunks are contiguous and in batch order whatever the weights, so gathering them in the returned order puts
    the rows back in batch order.
    """
    rows, nearest = _row_count(batch)
    if weights is None:
        sizes = chunk_sizes(rows, len(devices))
        used = list(devices[: len(sizes)])
    else:
        shares = weighted_chunk_sizes(rows, weights)
        sizes = [size for size in shares if size]
        used = [device for device, size in zip(devices, shares, strict=True) if size]
    planner = _Planner(rows, len(sizes) > 1, memory, source)
    plan = planner.plan(batch, "batch")
    if planner.conflicts:
        conflicts = [f"{path}: {size}" for path, size in planner.conflicts]
        raise BatchSplitError(_disagreement(_listing(nearest) + conflicts), planner.conflicts[0][0])
    if planner.undecided:
        raise BatchSplitError(_undecided(planner.undecided, rows), planner.undecided[0])
    if memory is not None:
        for path, by_items in planner.readings.items():
            memory.remember(path, by_items)
    chunks = [
        _take(batch, plan, start, size, device) for start, size, device in zip(_starts(sizes), sizes, used, strict=True)
    ]
    return chunks, sizes, used


def scatter_inputs(
    inputs: tuple[Any, ...],
    kwargs: dict[str, Any],
    devices: Sequence[torch.device],
    weights: Sequence[float] | None = None,
    *,
    memory: LayoutMemory | None = None,
) -> tuple[list[tuple[tuple[Any, ...], dict[str, Any]]], list[int], list[torch.device]]:
    """Split a call's positional and keyword inputs as one batch: one ``(args, kwargs)`` per device given rows.

    Positional input ``i`` is ``batch['inputs'][i]`` and keyword ``name`` is ``batch['kwargs'][name]`` of the batch
    that ``scatter_to_devices`` splits (error messages and ``memory`` name them so); plain tensors alone take a
    shorter path to the same chunks. A list whose items read both ways is fields, as ``torch.nn.DataParallel``
    reads every list among the inputs.
    """
    if not kwargs and weights is None:
        split = split_plain_tensors(inputs, devices)
        if split is not None:
            chunks, sizes, used = split
            return [(chunk, {}) for chunk in chunks], sizes, used
    try:
        joined = {"inputs": Fields(inputs), "kwargs": kwargs}
        batches, sizes, used = scatter_to_devices(joined, devices, weights, memory=memory, source=Source.FORWARD_INPUTS)
    except BatchSplitError as error:
        error.add_note(
            "lightning_mgpu: MGPUDataParallel splits the positional and keyword inputs of forward as one batch:"
            " batch['inputs'][i] is positional input i, batch['kwargs'][name] the keyword argument name."
        )
        raise
    return [(tuple(batch["inputs"]), batch["kwargs"]) for batch in batches], sizes, used


def split_plain_tensors(
    tensors: Sequence[Any], devices: Sequence[torch.device]
) -> tuple[list[tuple[torch.Tensor, ...]], list[int], list[torch.device]] | None:
    """``scatter_to_devices`` of the commonest call, ``module(x, ...)`` on plain tensors, without its general walk.

    Plain tensors that agree on their rows are split along dim 0 as ``scatter_to_devices`` splits them, evenly; for
    anything else (no tensors, a subclass, a 0-dim tensor, rows that disagree or an empty batch) this returns
    ``None`` and the caller takes the general path, which raises its own errors.
    """
    rows = -1
    for tensor in tensors:
        if type(tensor) is not torch.Tensor or tensor.dim() == 0:
            return None
        size = tensor.shape[0]
        if rows == -1:
            rows = size
        elif size != rows:
            return None
    if rows < 1:
        return None
    sizes = chunk_sizes(rows, len(devices))
    used = list(devices[: len(sizes)])
    chunks = []
    start = 0
    for size, device in zip(sizes, used, strict=True):
        chunks.append(tuple([tensor.narrow(0, start, size).to(device, non_blocking=True) for tensor in tensors]))
        start += size
    return chunks, sizes, used


def move_to(
    obj: Any, device: torch.device, path: str = "value", error: Callable[[str, str], Exception] = GatherError
) -> Any:
    """``obj`` with its tensors on ``device``; containers are rebuilt only when a tensor inside them moved.

    ``path`` and ``error`` are what ``rebuild_mapping`` raises with for a Mapping it cannot rebuild.
    """
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if obj is None or isinstance(obj, _ATOMS):  # names and ids: skip the slower container checks
        return obj
    if isinstance(obj, Mapping):
        pairs = list(obj.items())
        moved_items = [(key, move_to(value, device, f"{path}[{key!r}]", error)) for key, value in pairs]
        if all(new is old for (_, new), (_, old) in zip(moved_items, pairs, strict=True)):
            return obj
        return rebuild_mapping(obj, moved_items, path, error)
    if is_dataclass_instance(obj):
        pairs = field_values(obj)
        moved_pairs = [(name, move_to(value, device, f"{path}.{name}", error)) for name, value in pairs]
        if all(new is old for (_, new), (_, old) in zip(moved_pairs, pairs, strict=True)):
            return obj
        return rebuild_dataclass(obj, moved_pairs)
    if isinstance(obj, (list, tuple)):
        moved = [move_to(value, device, f"{path}[{index}]", error) for index, value in enumerate(obj)]
        if all(new is old for new, old in zip(moved, obj, strict=True)):
            return obj
        return type(obj)(*moved) if is_namedtuple(obj) else rebuild_sequence(obj, moved)
    return obj


def is_namedtuple(obj: Any) -> bool:
    """Namedtuples are records whose fields are named, so they are never read as one item per sample."""
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def is_dataclass_instance(obj: Any) -> bool:
    """A dataclass instance, not the class itself."""
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def field_values(obj: Any) -> list[tuple[str, Any]]:
    """Every field that is set, ``init=False`` ones included; one never assigned has no value to split."""
    values = []
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name, _UNSET)
        if value is not _UNSET:
            values.append((field.name, value))
    return values


def rebuild_dataclass(original: Any, values: Iterable[tuple[str, Any]]) -> Any:
    """A shallow copy of ``original`` with new field values, without calling ``__init__`` or ``__post_init__``.

    ``dataclasses.replace`` cannot set ``init=False`` fields and would rerun ``__post_init__`` on values it has
    already processed; setting the fields on a copy works for frozen and slotted dataclasses too.
    """
    rebuilt = copy.copy(original)
    for name, value in values:
        object.__setattr__(rebuilt, name, value)
    return rebuilt


def rebuild_mapping(
    original: Mapping,
    items: list[tuple[Any, Any]],
    path: str = "output",
    error: Callable[[str, str], Exception] = GatherError,
) -> Mapping:
    """A mapping of ``original``'s type holding ``items``, built as Lightning and torch build one.

    Lightning's ``apply_to_collection`` and torch's ``default_collate`` call the type with a dict of the items
    (``defaultdict`` with its factory first); a list of the pairs is tried next. What either call builds must be of
    the type and hold the items and no others, or it is a mapping of other contents (a constructor that keeps its
    argument as it is, say), which would fail later and far from here.

    Raises:
        GatherError: (or ``error``) naming ``path`` and the type, when neither call builds the mapping.
    """
    kind: Any = type(original)
    values = dict(items)
    if kind is dict:
        return values
    name = kind.__name__
    if isinstance(original, defaultdict):
        factory = original.default_factory
        first = (f"{name}(default_factory, a dict)", lambda: kind(factory, values))
    else:
        first = (f"{name}(a dict)", lambda: kind(values))
    attempts = [first, (f"{name}(a list of (key, value) pairs)", lambda: kind(items))]
    failures = []
    for call, build in attempts:
        try:
            rebuilt = build()
        except Exception as exc:  # noqa: BLE001 - any failure of the user's constructor is reported below
            failures.append(f"{call} raised {type(exc).__name__}: {exc}")
            continue
        if _holds(rebuilt, kind, values):
            return rebuilt
        failures.append(f"{call} built a {type(rebuilt).__name__} that does not hold those items")
    raise error(
        f"{path} is a {name}, a Mapping that cannot be rebuilt around new values: {'; '.join(failures)}."
        " lightning_mgpu rebuilds a Mapping as torch's default_collate and Lightning's apply_to_collection do, by"
        f" calling its type with a dict of its items. Give {name}.__init__ a first parameter that takes"
        " such a dict as its items, or return a dict in its place.",
        path,
    )


def _holds(rebuilt: Any, kind: Any, values: dict[Any, Any]) -> bool:
    """Whether ``rebuilt`` is a ``kind`` holding ``values``, the very objects, and nothing else.

    A type may leave out the keys whose value is ``None``, as transformers' ``ModelOutput`` does.
    """
    try:
        return (
            type(rebuilt) is kind
            and all(key in values for key in rebuilt)
            and all(value is None or (key in rebuilt and rebuilt[key] is value) for key, value in values.items())
        )
    except Exception:  # noqa: BLE001 - a mapping that cannot even be read back holds other items
        return False


def rebuild_sequence(original: list | tuple, items: list[Any]) -> list | tuple:
    """A list or tuple of ``original``'s type (``PerSample`` and ``Fields`` included) holding ``items``."""
    kind = type(original)
    if kind is list:
        return items
    if kind is tuple:
        return tuple(items)
    try:
        return kind(items)
    except TypeError:
        return items if isinstance(original, list) else tuple(items)


_UNSET = object()
_ATOMS = (str, bytes, int, float)


class Fit(enum.StrEnum):
    """How a value could be read when a list holding it is split or gathered by items (shared with ``gather``)."""

    ROWS = "rows"
    """It carries the rows: split or concatenated along them."""
    FREE = "free"
    """It holds no tensor (names, ids, numbers, None), so it reads either way."""
    CONFLICT = "conflict"
    """It cannot be read by the rows (a tensor of other rows): the list around it holds one item per sample."""
    MARKED = "marked"
    """It is or holds a ``PerSample`` or ``Fields``, which only batch data can: the list around it is a container."""


class Cut(enum.Enum):
    """How ``_take`` cuts a value for one replica, decided once per batch by ``_Planner``."""

    SPLIT = enum.auto()
    """A tensor, narrowed to the replica's rows."""
    WHOLE = enum.auto()
    """Any other value, given whole to every replica."""
    ITEMS = enum.auto()
    """A per-sample sequence, sliced to the replica's items; its plan holds its key path."""
    MAPPING = enum.auto()
    """A mapping; its plan holds its key path, for a type that cannot be rebuilt, and its values' plans."""
    DATACLASS = enum.auto()
    NAMEDTUPLE = enum.auto()
    SEQUENCE = enum.auto()
    """Containers, rebuilt with their type from their values' cuts."""


Plan = tuple[Cut, Any]
_SPLIT_PLAN: Plan = (Cut.SPLIT, None)
_WHOLE_PLAN: Plan = (Cut.WHOLE, None)


def _row_count(batch: Any) -> tuple[int, list[tuple[str, int, bool]]]:
    """N and the (path, size, is a PerSample) it was read from, level by level so deep lists are rarely walked."""
    level: list[tuple[Any, str]] = [(batch, "batch")]
    outermost = True
    while level:
        found: list[tuple[str, int, bool]] = []
        deeper: list[tuple[Any, str]] = []
        for obj, path in level:
            _sizes_at_level(obj, path, found, deeper, outermost)
        if found:
            distinct = {size for _, size, _ in found}
            if len(distinct) > 1:
                first_size = found[0][1]
                odd = next(path for path, size, _ in found if size != first_size)
                raise BatchSplitError(_disagreement(_listing(found)), odd)
            return distinct.pop(), found
        level, outermost = deeper, False
    raise BatchSplitError(
        f"mgpu_dp splits the batch along dim 0, but the batch ({type(batch).__name__}) holds no tensor with a"
        " batch dimension. Return tensors from your DataLoader (its default collate does), wrap a list that holds"
        " one item per sample in lightning_mgpu.PerSample(...), or use a single-device strategy for this model."
    )


def _sizes_at_level(
    obj: Any, path: str, found: list[tuple[str, int, bool]], deeper: list[tuple[Any, str]], outermost: bool
) -> None:
    """Collect the row counts of one level; plain lists and tuples are left for the next level."""
    if isinstance(obj, torch.Tensor):
        if obj.dim() > 0:
            found.append((path, obj.shape[0], False))
        elif outermost:  # outside every list, so it cannot be one sample's value
            raise BatchSplitError(_zero_dim(path), path)
    elif isinstance(obj, PerSample):
        found.append((path, len(obj), True))
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _sizes_at_level(value, f"{path}[{key!r}]", found, deeper, outermost)
    elif is_dataclass_instance(obj):
        for name, value in field_values(obj):
            _sizes_at_level(value, f"{path}.{name}", found, deeper, outermost)
    elif isinstance(obj, Fields) or is_namedtuple(obj):
        for index, value in enumerate(obj):
            _sizes_at_level(value, f"{path}[{index}]", found, deeper, outermost)
    elif isinstance(obj, (list, tuple)):
        deeper.extend((value, f"{path}[{index}]") for index, value in enumerate(obj))


def _check_not_empty(batch_size: int) -> None:
    if batch_size < 1:
        raise BatchSplitError(
            "The batch is empty (0 rows along dim 0), so there is nothing to split across replicas."
            " Drop empty batches in your DataLoader or dataset."
        )


def _integer_shares(weights: Sequence[float]) -> list[int]:
    """Integers in exactly the proportions of ``weights`` (floats are binary fractions), for exact rounding."""
    if all(isinstance(weight, int) for weight in weights):
        return [int(weight) for weight in weights]
    fractions = [Fraction(weight) for weight in weights]
    denominator = math.lcm(*(fraction.denominator for fraction in fractions))
    return [fraction.numerator * (denominator // fraction.denominator) for fraction in fractions]


def _zero_dim(path: str) -> str:
    return (
        f"{path} is a 0-dim tensor, which has no batch dimension to split across replicas."
        " Give it a leading batch dimension, or move it out of the batch."
    )


class _Planner:
    """Reads one batch top-down, its row count known, deciding how each value is cut for the replicas."""

    def __init__(self, rows: int, several_chunks: bool, memory: LayoutMemory | None, source: Source | None) -> None:
        self.rows = rows
        self.several_chunks = several_chunks
        """Whether the batch is cut into more than one chunk, where a list's two readings give different chunks."""
        self.memory = memory
        self.source = source
        self.conflicts: list[tuple[str, str]] = []
        """(path, size) of each value whose rows are not the batch's."""
        self.undecided: list[str] = []
        """The paths of lists that read both ways, with no earlier reading to decide."""
        self.readings: dict[str, bool] = {}
        """The readings this batch's items prove, by path: by items (``True``) or field by field."""

    def plan(self, obj: Any, path: str) -> Plan:
        if isinstance(obj, torch.Tensor):
            if obj.dim() == 0:
                raise BatchSplitError(_zero_dim(path), path)
            if obj.shape[0] != self.rows:
                self.conflicts.append((path, f"{obj.shape[0]}"))
            return _SPLIT_PLAN
        if isinstance(obj, PerSample):
            if len(obj) != self.rows:
                self.conflicts.append((path, f"{len(obj)} items"))
            return (Cut.ITEMS, path)
        if isinstance(obj, Mapping):
            return (Cut.MAPPING, (path, [self.plan(value, f"{path}[{key!r}]") for key, value in obj.items()]))
        if is_dataclass_instance(obj):
            return (Cut.DATACLASS, [(name, self.plan(value, f"{path}.{name}")) for name, value in field_values(obj)])
        if isinstance(obj, (list, tuple)):
            namedtuple = is_namedtuple(obj)
            if not namedtuple and not isinstance(obj, Fields) and self._by_items(obj, path):
                return (Cut.ITEMS, path)
            children = [self.plan(value, f"{path}[{index}]") for index, value in enumerate(obj)]
            return (Cut.NAMEDTUPLE if namedtuple else Cut.SEQUENCE, children)
        return _WHOLE_PLAN

    def _by_items(self, obj: list | tuple, path: str) -> bool:
        """Whether a plain list or tuple is split by items: as its items prove, else as an earlier batch read it.

        Where ``source`` knows, it decides instead of ``memory``. A list whose items read both ways, with nothing
        to decide, is split by items only to go no deeper; it is refused when there is more than one chunk, and
        with one chunk both readings give the same chunk.
        """
        if self.source is Source.DEFAULT_COLLATE:
            return len(obj) == self.rows and all(isinstance(item, (str, bytes)) for item in obj)
        proven = list_reading(obj, self.rows)
        if proven is None and self.source is Source.FORWARD_INPUTS:
            return False
        remembered = None if self.memory is None else self.memory.recall(path)
        if proven is None:
            if remembered is None and self.several_chunks:
                self.undecided.append(path)
            return remembered is not False
        if remembered is not None and remembered != proven and self.several_chunks:
            raise BatchSplitError(_changed_reading(path, len(obj), self.rows, remembered), path)
        self.readings[path] = proven
        return proven


def list_reading(items: list | tuple, rows: int) -> bool | None:
    """How a plain list or tuple's own items read: one per sample (``True``), fields (``False``), or both (``None``).

    ``torch.nn.DataParallel`` splits every item of a list, so fields are the default. Items prove one per sample
    when they could not be fields with N rows (a tensor of other rows, a 0-dim tensor) or hold no tensor to split
    (names); a marker inside, items that differ, or another count than N make the list fields. N alike items whose
    tensors all have N rows (N images with exactly N boxes each, ``[x, y]`` of 2 rows) read both ways.
    """
    if len(items) != rows:
        return False
    fits = [_fit(item, rows) for item in items]
    if Fit.MARKED in fits:
        return False
    if Fit.CONFLICT in fits or Fit.ROWS not in fits:
        return True
    if all(fit is Fit.ROWS for fit in fits) and all(_alike(items[0], item) for item in items[1:]):
        return None
    return False


def _alike(first: Any, other: Any) -> bool:
    """Whether two items have one structure: the same types, keys and lengths, tensors of one dtype and shape[1:]."""
    if type(first) is not type(other):
        return False
    if isinstance(first, torch.Tensor):
        return first.dtype == other.dtype and first.shape[1:] == other.shape[1:]
    if isinstance(first, Mapping):
        return first.keys() == other.keys() and all(_alike(value, other[key]) for key, value in first.items())
    if is_dataclass_instance(first):
        pairs, others = field_values(first), field_values(other)
        return len(pairs) == len(others) and all(
            name == other_name and _alike(value, other_value)
            for (name, value), (other_name, other_value) in zip(pairs, others, strict=False)
        )
    if isinstance(first, (list, tuple)):
        return len(first) == len(other) and all(_alike(a, b) for a, b in zip(first, other, strict=True))
    return True


def _fit(obj: Any, rows: int) -> Fit:
    """How ``obj`` would read as batch data with ``rows`` rows, without planning it (a per-sample item is whole)."""
    if isinstance(obj, torch.Tensor):
        return Fit.ROWS if obj.dim() > 0 and obj.shape[0] == rows else Fit.CONFLICT
    if isinstance(obj, (PerSample, Fields)):
        return Fit.MARKED
    if isinstance(obj, Mapping):
        return combine_fits(_fit(value, rows) for value in obj.values())
    if is_dataclass_instance(obj):
        return combine_fits(_fit(value, rows) for _, value in field_values(obj))
    if isinstance(obj, (list, tuple)):
        fits = [_fit(value, rows) for value in obj]
        if len(obj) == rows and not is_namedtuple(obj) and Fit.MARKED not in fits:
            return Fit.FREE if all(fit is Fit.FREE for fit in fits) else Fit.ROWS  # it carries the rows either way
        return combine_fits(fits)
    return Fit.FREE


def combine_fits(fits: Iterable[Fit]) -> Fit:
    """How a container of items with these fits merges: a marker decides, a conflict beats rows, rows beat free."""
    result = Fit.FREE
    for fit in fits:
        if fit is Fit.MARKED:
            return Fit.MARKED
        if fit is Fit.CONFLICT:
            result = Fit.CONFLICT
        elif fit is Fit.ROWS and result is Fit.FREE:
            result = Fit.ROWS
    return result


def _take(obj: Any, plan: Plan, start: int, size: int, device: torch.device) -> Any:
    kind, children = plan
    if kind is Cut.SPLIT:
        return obj.narrow(0, start, size).to(device, non_blocking=True)
    if kind is Cut.WHOLE:
        return obj
    if kind is Cut.ITEMS:
        path = children
        items = [
            move_to(obj[index], device, f"{path}[{index}]", BatchSplitError) for index in range(start, start + size)
        ]
        return rebuild_sequence(obj, items)
    if kind is Cut.MAPPING:
        path, plans = children
        cut = [
            (key, _take(value, child, start, size, device))
            for (key, value), child in zip(obj.items(), plans, strict=True)
        ]
        return rebuild_mapping(obj, cut, path, BatchSplitError)
    if kind is Cut.DATACLASS:
        values = [(name, _take(getattr(obj, name), child, start, size, device)) for name, child in children]
        return rebuild_dataclass(obj, values)
    values = [_take(value, child, start, size, device) for value, child in zip(obj, children, strict=True)]
    return type(obj)(*values) if kind is Cut.NAMEDTUPLE else rebuild_sequence(obj, values)


def _starts(sizes: list[int]) -> list[int]:
    starts, offset = [], 0
    for size in sizes:
        starts.append(offset)
        offset += size
    return starts


def _listing(found: list[tuple[str, int, bool]]) -> list[str]:
    return [f"{path}: {size}{' items' if items else ''}" for path, size, items in found]


def _disagreement(listing: list[str]) -> str:
    shown = ", ".join(listing[:12]) + (f", ... ({len(listing) - 12} more)" if len(listing) > 12 else "")
    return (
        f"The tensors in the batch disagree on their size along dim 0 ({shown}), so the batch cannot be split into"
        " matching chunks per replica. Make every tensor in the batch hold one row per sample; wrap a list that"
        " holds one item per sample (such as one boxes tensor per image) in lightning_mgpu.PerSample(...) in your"
        " collate_fn; or move per-batch data out of the batch (for example into the LightningModule)."
    )


_MARK_IT = (
    "Mark the list in your collate_fn: wrap one item per sample in lightning_mgpu.PerSample(...), as in"
    ' {"images": torch.stack(images), "boxes": PerSample(boxes)}, or fields in lightning_mgpu.Fields(...), as in'
    " Fields([x, y])."
)


def _undecided(paths: list[str], rows: int) -> str:
    shown = " and ".join([", ".join(paths[:-1]), paths[-1]] if len(paths) > 1 else paths)
    holds, reads = ("holds", "it reads") if len(paths) == 1 else ("each hold", "each reads")
    return (
        f"{shown} {holds} {rows} alike items whose tensors all have the batch's {rows} rows, so {reads} both as"
        " fields (each item split by rows, as torch.nn.DataParallel splits a list) and as one item per sample (each"
        f" item given whole to its sample's replica), and no earlier batch told which. {_MARK_IT}"
    )


def _changed_reading(path: str, items: int, rows: int, by_items: bool) -> str:
    readings = ("as fields", "as one item per sample")
    return (
        f"{path} was read {readings[by_items]} in an earlier batch, but its {items} items in this batch of {rows}"
        f" rows can only be read {readings[not by_items]}; one key path is read one way in a run, so that no step"
        f" receives its data cut the other way. {_MARK_IT}"
    )
