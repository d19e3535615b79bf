"""Property-based tests: gather(scatter(x)) == x, and weighted reductions equal one device, for random inputs."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_mgpu.engine import chunk_sizes, gather, scatter, weighted_mean

CPU = torch.device("cpu")


def _tensor(rows: int, seed: int, trailing: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn((rows, *trailing), generator=generator)
    return values.to(dtype) if dtype.is_floating_point else (values * 10).to(dtype)


@st.composite
def batches(draw: st.DrawFn) -> tuple[Any, int]:
    """A random nested batch whose tensors share a leading dimension, with None and numbers mixed in."""
    rows = draw(st.integers(min_value=1, max_value=17))
    dtypes = st.sampled_from([torch.float32, torch.float64, torch.int64, torch.int32])
    trailing = st.lists(st.integers(min_value=1, max_value=3), max_size=2).map(tuple)
    leaf = st.builds(
        lambda seed, shape, dtype: _tensor(rows, seed, shape, dtype), st.integers(0, 10_000), trailing, dtypes
    )
    extra = st.one_of(st.none(), st.integers(-5, 5), st.floats(-1, 1, allow_nan=False))
    tree = st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(st.one_of(children, extra), min_size=1, max_size=3),
            st.tuples(children, st.one_of(children, extra)),
            st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=3),
        ),
        max_leaves=6,
    )
    return draw(tree.filter(_has_tensor)), rows


def _tensors_only(batch: Any) -> Any:
    """What gather can return: scatter hands non-tensor values to every replica whole, so drop them."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, dict):
        return {key: _tensors_only(value) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(_tensors_only(value) for value in batch if _has_tensor(value))
    return None


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _assert_equal(left: Any, right: Any) -> None:
    if isinstance(left, torch.Tensor):
        assert isinstance(right, torch.Tensor)
        assert left.dtype == right.dtype
        assert torch.equal(left, right)
    elif isinstance(left, dict):
        assert left.keys() == right.keys()
        for key in left:
            _assert_equal(left[key], right[key])
    elif isinstance(left, (list, tuple)):
        assert type(left) is type(right)
        assert len(left) == len(right)
        for a, b in zip(left, right, strict=True):
            _assert_equal(a, b)
    else:
        assert left == right


@settings(max_examples=150, deadline=None)
@given(batches(), st.integers(min_value=1, max_value=6))
def test_gather_of_scatter_is_the_identity(batch_and_rows: tuple[Any, int], replicas: int) -> None:
    batch, rows = batch_and_rows
    chunks, sizes = scatter(batch, [CPU] * replicas)
    assert sizes == chunk_sizes(rows, replicas)
    assert len(chunks) == min(rows, replicas)
    regathered = gather([_tensors_only(chunk) for chunk in chunks], CPU)
    _assert_equal(regathered, _tensors_only(batch))


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
