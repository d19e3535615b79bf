"""Property-based tests: gather(scatter(x)) == x, and weighted reductions equal one device, for random inputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mgpu import Fields, PerSample
from lightning_mgpu.engine import chunk_sizes, gather, scatter, weighted_mean
from lightning_mgpu.engine.scatter import list_reading, rebuild_sequence

CPU = torch.device("cpu")


def _tensor(rows: int, seed: int, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((rows, *trailing), generator=generator)
    return values.to(dtype) if dtype.is_floating_point else (values * 10).to(dtype)


@dataclass
class _Record:
    """A dataclass batch whose derived field is set after ``__init__``, as a ``__post_init__`` would set it."""

    inputs: Any
    derived: Any = field(init=False, default=None)


def _record(inputs: Any, derived: Any) -> _Record:
    record = _Record(inputs)
    record.derived = derived
    return record


class _PerReplica:
    """Where the batch held a number: every replica receives it whole, so gather returns one per replica."""

    def __init__(self, value: float) -> None:
        self.value = value


Drawn = tuple[Any, Any]  # (a part of the batch, what gather returns for it)


@st.composite
def batches(draw: st.DrawFn) -> tuple[Any, Any, int, int]:
    """A random nested batch, what gather(scatter(batch)) returns for it, its rows and the replica count.

    Tensors share a leading dimension; numbers and None are mixed in; dataclasses carry an ``init=False`` field;
    plain lists and tuples with one item per row (names, ids, None, dicts, per-sample tensors of other lengths)
    and ``PerSample`` lists of anything are split by items. Other lists, plain or ``Fields``, hold a tensor or a
    marker, so they are fields whatever their length, the batch's row count and the chunks' included. A plain one
    whose items read both ways (as many alike row tensors as rows) is drawn as a ``Fields``, since ``scatter``
    without a memory refuses it when it splits the batch. Per-sample items hold tensors only when a row tensor sits
    outside every list, where it sets the row count.
    """
    rows = draw(st.integers(min_value=1, max_value=17))
    replicas = draw(st.integers(min_value=1, max_value=6))
    anchored = draw(st.booleans())
    seeds = st.integers(0, 10_000)
    dtypes = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32])
    trailing = st.lists(st.integers(min_value=1, max_value=3), max_size=2).map(tuple)
    row_tensor = st.builds(lambda seed, shape, dtype: _tensor(rows, seed, shape, dtype), seeds, trailing, dtypes)
    names = st.text(max_size=3)
    sample_values = [names, st.integers(-5, 5), st.none(), st.fixed_dictionaries({"name": names})]
    if anchored:
        boxes = st.builds(
            lambda count, seed: _tensor(count, seed, (4,), torch.float32), st.integers(rows + 1, 20), seeds
        )
        sample_values += [boxes, st.fixed_dictionaries({"name": names, "boxes": boxes})]
    sample = st.one_of(sample_values)
    per_sample = st.one_of(
        st.lists(sample, min_size=rows, max_size=rows), st.lists(sample, min_size=rows, max_size=rows).map(tuple)
    ).map(lambda items: (items, items))
    scalar = st.builds(lambda seed: _tensor(1, seed, (), torch.float32)[0], seeds)
    marked = st.lists(st.one_of(sample, row_tensor, scalar), min_size=rows, max_size=rows).map(PerSample)
    leaf = st.one_of(row_tensor, marked).map(lambda value: (value, value))
    number = st.one_of(st.integers(-5, 5), st.floats(-1, 1, allow_nan=False))
    extra = st.one_of(st.just((None, None)), number.map(lambda n: (n, _PerReplica(n))), per_sample)

    def sequence(pairs: list[Drawn], kind: type) -> Drawn:
        values, expected = [pair[0] for pair in pairs], [pair[1] for pair in pairs]
        if min(rows, replicas) > 1 and list_reading(values, rows) is None:
            kind = Fields
        return kind(values), kind(expected)

    def mapping(items: dict[str, Drawn]) -> Drawn:
        return {key: pair[0] for key, pair in items.items()}, {key: pair[1] for key, pair in items.items()}

    tree = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.tuples(
                st.tuples(st.lists(children, min_size=1, max_size=2), st.lists(extra, max_size=2)).flatmap(
                    lambda parts: st.permutations(parts[0] + parts[1])
                ),
                st.sampled_from([list, Fields]),
            ).map(lambda drawn: sequence(*drawn)),
            st.tuples(children, st.one_of(children, extra)).map(lambda pairs: sequence(list(pairs), tuple)),
            st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=3).map(mapping),
            st.tuples(children, st.one_of(children, extra)).map(
                lambda pairs: (_record(pairs[0][0], pairs[1][0]), _record(pairs[0][1], pairs[1][1]))
            ),
        ),
        max_leaves=6,
    )
    batch, expected = draw(tree)
    if anchored:
        anchor = draw(row_tensor)
        batch, expected = {"anchor": anchor, "tree": batch}, {"anchor": anchor, "tree": expected}
    return batch, expected, rows, replicas


def _materialize(expected: Any, replicas: int) -> Any:
    """Turn each number the batch held into the one-per-replica tensor that gather makes of it."""
    if isinstance(expected, _PerReplica):
        return torch.tensor([expected.value] * replicas)
    if isinstance(expected, dict):
        return {key: _materialize(value, replicas) for key, value in expected.items()}
    if isinstance(expected, _Record):
        return _record(_materialize(expected.inputs, replicas), _materialize(expected.derived, replicas))
    if isinstance(expected, (list, tuple)):
        return rebuild_sequence(expected, [_materialize(value, replicas) for value in expected])
    return expected


def _assert_equal(left: Any, right: Any) -> None:
    assert type(left) is type(right)
    if isinstance(left, torch.Tensor):
        assert left.dtype == right.dtype
        assert torch.equal(left, right)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            _assert_equal(left[key], right[key])
    elif isinstance(left, _Record):
        _assert_equal(left.inputs, right.inputs)
        _assert_equal(left.derived, right.derived)
    elif isinstance(left, (list, tuple)):
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_equal(a, b)
    else:
        assert left == right


@settings(max_examples=300, deadline=None)
@given(batches())
def test_gather_of_scatter_is_the_identity(drawn: tuple[Any, Any, int, int]) -> None:
    batch, expected, rows, replicas = drawn
    chunks, sizes = scatter(batch, [CPU] * replicas)
    assert sizes == chunk_sizes(rows, replicas)
    assert len(chunks) == min(rows, replicas)
    _assert_equal(gather(chunks, CPU, sizes), _materialize(expected, len(chunks)))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.floats(-1e3, 1e3, allow_nan=False), min_size=1, max_size=40),
    st.integers(min_value=1, max_value=8),
)
def test_weighted_mean_of_chunk_means_is_the_mean(values: list[float], replicas: int) -> None:
    rows = torch.tensor(values, dtype=torch.float64)
    chunks, sizes = scatter(rows, [CPU] * replicas)
    per_replica = torch.stack([chunk.mean() for chunk in chunks])
    torch.testing.assert_close(weighted_mean(per_replica, sizes), rows.mean(), atol=1e-9, rtol=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.integers(-100, 100), st.floats(-10, 10, allow_nan=False)), min_size=1, max_size=8))
def test_numbers_gather_to_one_element_per_replica(numbers: list[float]) -> None:
    gathered = gather(numbers, CPU)
    assert gathered.shape == (len(numbers),)
    torch.testing.assert_close(gathered.double(), torch.tensor(numbers, dtype=torch.float64), atol=1e-5, rtol=1e-6)
