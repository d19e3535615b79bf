"""Merging the replicas' outputs on the root device."""

from __future__ import annotations

import warnings
from collections import namedtuple
from dataclasses import dataclass

import pytest
import torch

from lightning_mgpu import GatherError
from lightning_mgpu.engine import gather, weighted_mean

CPU = torch.device("cpu")


def test_replica_index_gathers_to_a_vector_with_its_dtype() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gathered = gather([torch.tensor(0), torch.tensor(1)], CPU)
    assert torch.equal(gathered, torch.tensor([0, 1]))
    assert gathered.dtype == torch.int64


@pytest.mark.parametrize(
    ("values", "dtype"), [([0, 1], torch.int64), ([0.5, 1.5], torch.float32), ([True, False], torch.bool)]
)
def test_numbers_become_a_tensor_with_one_element_per_replica(values: list, dtype: torch.dtype) -> None:
    gathered = gather(values, CPU)
    assert gathered.dtype == dtype
    assert gathered.tolist() == values


def test_tensors_concatenate_along_dim_0_and_keep_dtype() -> None:
    gathered = gather([torch.ones(3, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.float64)], CPU)
    assert gathered.shape == (5, 2)
    assert gathered.dtype == torch.float64
    assert gathered[:3].sum().item() == 6.0


def test_containers_are_gathered_leaf_by_leaf_and_keep_their_type() -> None:
    point = namedtuple("point", ["x", "y"])
    outputs = [
        {"p": point(torch.ones(1), 1), "l": [None, torch.tensor(2.0)], "t": (torch.zeros(2, dtype=torch.int32),)},
        {"p": point(torch.zeros(2), 2), "l": [None, torch.tensor(3.0)], "t": (torch.ones(1, dtype=torch.int32),)},
    ]
    gathered = gather(outputs, CPU)
    assert isinstance(gathered["p"], point)
    assert gathered["p"].x.tolist() == [1.0, 0.0, 0.0]
    assert gathered["p"].y.tolist() == [1, 2]
    assert gathered["l"][0] is None
    assert gathered["l"][1].tolist() == [2.0, 3.0]
    assert isinstance(gathered["t"], tuple)
    assert gathered["t"][0].tolist() == [0, 0, 1]
    assert gathered["t"][0].dtype == torch.int32


def test_gather_is_differentiable() -> None:
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(1, requires_grad=True)
    (gather([a * 2, b * 3], CPU) * torch.tensor([1.0, 1.0, 5.0])).sum().backward()
    assert a.grad.tolist() == [2.0, 2.0]
    assert b.grad.tolist() == [15.0]


def test_a_string_leaf_names_the_key_path_replica_and_fix() -> None:
    outputs = [
        {"loss": torch.tensor(1.0), "info": [torch.ones(1), "ok"]},
        {"loss": torch.tensor(2.0), "info": [torch.ones(1), "ok"]},
    ]
    with pytest.raises(GatherError, match=r"output\['info'\]\[1\] in replica 0 is a str .*Return only tensors"):
        gather(outputs, CPU)


def test_a_dataclass_leaf_is_refused() -> None:
    @dataclass
    class Result:
        value: torch.Tensor

    with pytest.raises(GatherError, match=r"output in replica 1 is a dataclass Result"):
        gather([torch.ones(1), Result(torch.ones(1))], CPU)


def test_replicas_with_different_keys_are_refused() -> None:
    with pytest.raises(GatherError, match=r"replica 1 has keys \['b'\] but replica 0 returned \['a'\]"):
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], CPU)


def test_mixed_none_and_tensor_is_refused() -> None:
    with pytest.raises(GatherError, match=r"NoneType .* in replica 0 but a Tensor .* in replica 1"):
        gather([None, torch.ones(1)], CPU)


def test_shapes_that_differ_beyond_dim_0_are_refused() -> None:
    with pytest.raises(GatherError, match=r"shapes \[\(1, 2\), \(1, 3\)\].*Pad them"):
        gather([torch.ones(1, 2), torch.ones(1, 3)], CPU)


def test_weighted_mean_equals_the_mean_over_all_rows() -> None:
    rows = torch.arange(5.0)
    per_replica = torch.stack([rows[:3].mean(), rows[3:].mean()])
    torch.testing.assert_close(weighted_mean(per_replica, [3, 2]), rows.mean())
    assert weighted_mean(torch.tensor([1, 3]), [1, 1]).dtype == torch.get_default_dtype()
