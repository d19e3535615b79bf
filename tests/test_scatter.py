"""Splitting a batch into one chunk per replica."""

from __future__ import annotations

from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import pytest
import torch

from lightning_mgpu import BatchSplitError
from lightning_mgpu.engine import chunk_sizes, scatter

CPU2 = [torch.device("cpu")] * 2


@pytest.mark.parametrize(
    ("rows", "devices", "expected"),
    [(4, 2, [2, 2]), (5, 2, [3, 2]), (5, 4, [2, 1, 1, 1]), (1, 3, [1]), (2, 4, [1, 1]), (7, 3, [3, 2, 2])],
)
def test_chunk_sizes_differ_by_at_most_one(rows: int, devices: int, expected: list[int]) -> None:
    assert chunk_sizes(rows, devices) == expected
    assert sum(expected) == rows


def test_tensors_split_along_dim_0_in_order() -> None:
    x = torch.arange(10).reshape(5, 2)
    chunks, sizes = scatter(x, CPU2)
    assert sizes == [3, 2]
    assert torch.equal(torch.cat(chunks), x)
    assert chunks[1].tolist() == [[6, 7], [8, 9]]


def test_containers_keep_their_type_and_other_values_reach_every_replica() -> None:
    pair = namedtuple("pair", ["x", "y"])

    @dataclass
    class Batch:
        inputs: torch.Tensor
        tag: str

    batch = OrderedDict(
        a=pair(torch.arange(4), torch.zeros(4, 3)),
        b=[torch.ones(4), 7, None],
        c=Batch(torch.arange(4.0), "same"),
    )
    chunks, _ = scatter(batch, CPU2)
    second = chunks[1]
    assert isinstance(second, OrderedDict)
    assert isinstance(second["a"], pair)
    assert second["a"].x.tolist() == [2, 3]
    assert second["b"][1:] == [7, None]
    assert isinstance(second["c"], Batch)
    assert second["c"].inputs.tolist() == [2.0, 3.0]
    assert second["c"].tag == "same"


def test_lists_of_strings_with_one_entry_per_row_are_split_with_their_rows() -> None:
    batch = {"x": torch.arange(3), "names": ["a", "b", "c"], "vocabulary": ("yes", "no")}
    chunks, _ = scatter(batch, CPU2)
    assert [chunk["names"] for chunk in chunks] == [["a", "b"], ["c"]]
    assert [chunk["vocabulary"] for chunk in chunks] == [("yes", "no"), ("yes", "no")]


def test_gradients_flow_back_through_the_split() -> None:
    x = torch.ones(4, 2, requires_grad=True)
    chunks, _ = scatter(x, CPU2)
    (chunks[0].sum() * 2 + chunks[1].sum() * 3).backward()
    assert x.grad.tolist() == [[2, 2], [2, 2], [3, 3], [3, 3]]


def test_tensors_that_disagree_on_dim_0_name_each_path() -> None:
    with pytest.raises(BatchSplitError, match=r"batch\['x'\]: 4, batch\['y'\]: 3.*one row per sample"):
        scatter({"x": torch.zeros(4), "y": torch.zeros(3)}, CPU2)


def test_a_batch_without_tensors_is_refused() -> None:
    with pytest.raises(BatchSplitError, match=r"holds no tensor with a batch dimension.*DataLoader"):
        scatter({"ids": [1, 2]}, CPU2)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(BatchSplitError, match="batch is empty"):
        scatter(torch.zeros(0, 3), CPU2)


def test_a_0_dim_tensor_in_the_batch_is_refused() -> None:
    with pytest.raises(BatchSplitError, match=r"batch\[1\] is a 0-dim tensor"):
        scatter((torch.zeros(4), torch.tensor(1.0)), CPU2)
