"""Merging the replicas' outputs on the root device."""

from __future__ import annotations

import pickle
import warnings
from collections import OrderedDict, UserDict, defaultdict, namedtuple
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import pytest
import torch
from models import DictBacked, KeywordsOnly

from lightning_mgpu import Fields, GatherError, PerSample
from lightning_mgpu.engine import gather, weighted_mean
from lightning_mgpu.engine.gather import LayoutMemory

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


def test_a_dataclass_in_one_replica_and_a_tensor_in_another_is_refused() -> None:
    @dataclass
    class Result:
        value: torch.Tensor

    with pytest.raises(GatherError) as caught:
        gather([torch.ones(1), Result(torch.ones(1))], CPU)
    assert (caught.value.path, caught.value.replica) == ("output", 1)


def test_replicas_with_different_keys_are_refused() -> None:
    with pytest.raises(GatherError) as caught:
        gather([{"a": torch.ones(1)}, {"b": torch.ones(1)}], CPU)
    assert (caught.value.path, caught.value.replica) == ("output", 1)


def test_mixed_none_and_tensor_is_refused() -> None:
    with pytest.raises(GatherError) as caught:
        gather([None, torch.ones(1)], CPU)
    assert (caught.value.path, caught.value.replica) == ("output", 1)


def test_shapes_that_differ_beyond_dim_0_are_refused() -> None:
    with pytest.raises(GatherError, match=r"shapes \[\(1, 2\), \(1, 3\)\].*Pad them"):
        gather([torch.ones(1, 2), torch.ones(1, 3)], CPU)


def test_weighted_mean_equals_the_mean_over_all_rows() -> None:
    rows = torch.arange(5.0)
    per_replica = torch.stack([rows[:3].mean(), rows[3:].mean()])
    torch.testing.assert_close(weighted_mean(per_replica, [3, 2]), rows.mean())
    assert weighted_mean(torch.tensor([1, 3]), [1, 1]).dtype == torch.get_default_dtype()


def test_persample_outputs_are_concatenated_in_batch_order() -> None:
    gathered = gather([PerSample(["a", torch.zeros(2)]), PerSample([None])], CPU)
    assert type(gathered) is PerSample
    assert gathered[0] == "a"
    assert gathered[1].shape == (2,)
    assert gathered[2] is None


@pytest.mark.parametrize("sizes", [[3, 2], [2, 2], [1, 1]], ids=["uneven", "even", "one-row-each"])
def test_a_list_of_names_with_one_per_row_is_concatenated(sizes: list[int]) -> None:
    names = [f"sample-{index}" for index in range(sum(sizes))]
    outputs = [names[: sizes[0]], names[sizes[0] :]]
    assert gather(outputs, CPU, sizes) == names
    assert gather([tuple(output) for output in outputs], CPU, sizes) == tuple(names)


@pytest.mark.parametrize(
    "rows",
    [
        [1, 2, 3, 4],
        [None, None, None, None],
        [{"name": "a"}, {"name": "b"}, {"name": "c"}, {"name": "d"}],
        [torch.zeros(5, 4), torch.zeros(1, 4), torch.zeros(2, 4), torch.zeros(0, 4)],
        [torch.zeros(2, 4), torch.zeros(1, 4), torch.zeros(3, 4), torch.zeros(2, 4)],
        [["tok", "en"], ["x"], ["a", "b"], []],
    ],
    ids=["numbers", "none", "dicts-with-strings", "boxes", "boxes-some-with-chunk-rows", "token-lists"],
)
def test_a_list_with_one_item_per_row_that_cannot_merge_item_by_item_is_concatenated(rows: list) -> None:
    gathered = gather([rows[:2], rows[2:]], CPU, [2, 2])
    assert len(gathered) == 4
    assert all(a is b for a, b in zip(gathered, rows, strict=True))


def test_per_row_lists_nested_in_containers_are_concatenated() -> None:
    outputs = [{"pred": torch.zeros(3), "names": ["a", "b", "c"]}, {"pred": torch.ones(2), "names": ["d", "e"]}]
    gathered = gather(outputs, CPU, [3, 2])
    assert gathered["names"] == ["a", "b", "c", "d", "e"]
    assert gathered["pred"].tolist() == [0, 0, 0, 1, 1]


def test_without_chunk_sizes_lists_are_gathered_item_by_item() -> None:
    gathered = gather([[torch.zeros(2), torch.zeros(2)], [torch.ones(2), torch.ones(2)]], CPU)
    assert [item.tolist() for item in gathered] == [[0, 0, 1, 1], [0, 0, 1, 1]]


def test_tensors_with_the_chunks_rows_are_gathered_item_by_item_as_torch_does() -> None:
    outputs = [{"pair": (torch.tensor(1.0), torch.tensor(2.0))}, {"pair": (torch.tensor(3.0), torch.tensor(4.0))}]
    first, second = gather(outputs, CPU, [2, 2])["pair"]
    assert (first.tolist(), second.tolist()) == ([1.0, 3.0], [2.0, 4.0])
    logits, features = gather(
        [(torch.zeros(2, 5), torch.zeros(2, 3)), (torch.ones(2, 5), torch.ones(2, 3))], CPU, [2, 2]
    )
    assert (logits.shape, features.shape) == ((4, 5), (4, 3))


def test_per_sample_tensors_with_the_chunks_rows_are_concatenated_when_marked() -> None:
    outputs = [PerSample([torch.zeros(2, 4), torch.zeros(2, 4)]), PerSample([torch.ones(2, 4), torch.ones(2, 4)])]
    gathered = gather(outputs, CPU, [2, 2])
    assert [item.shape for item in gathered] == [(2, 4)] * 4
    assert [float(item.sum()) for item in gathered] == [0.0, 0.0, 8.0, 8.0]


def test_memory_gathers_a_list_as_earlier_steps_did() -> None:
    memory = LayoutMemory()
    gather([[torch.tensor(1.0), torch.zeros(4)], [torch.tensor(2.0), torch.zeros(4)]], CPU, [4, 4], memory=memory)
    loss, rows = gather(
        [[torch.tensor(1.0), torch.zeros(2)], [torch.tensor(2.0), torch.ones(2)]], CPU, [2, 2], memory=memory
    )
    assert loss.tolist() == [1.0, 2.0]
    assert rows.tolist() == [0, 0, 1, 1]


def test_memory_refuses_a_list_that_was_per_row_and_now_is_not() -> None:
    memory = LayoutMemory()
    gather([["a", "b"], ["c", "d"]], CPU, [2, 2], memory=memory)
    with pytest.raises(
        GatherError,
        match=r"output was concatenated as one item per row in an earlier step.*\[2, 2\]"
        r" items for chunks of \[4, 4\] rows",
    ):
        gather([["a", "b"], ["c", "d"]], CPU, [4, 4], memory=memory)


def test_a_list_that_merges_both_ways_from_a_lone_replica_is_gathered_item_by_item() -> None:
    gathered = gather([[torch.zeros(2), torch.zeros(2)]], CPU, [2])
    assert [item.shape for item in gathered] == [(2,), (2,)]


def test_fields_and_lists_holding_markers_are_gathered_item_by_item() -> None:
    pair = gather(
        [Fields([torch.tensor(1.0), torch.zeros(2)]), Fields([torch.tensor(2.0), torch.ones(2)])], CPU, [2, 2]
    )
    assert type(pair) is Fields
    assert pair[0].tolist() == [1.0, 2.0]
    marked = gather([[PerSample(["a"]), torch.zeros(1)], [PerSample(["b"]), torch.ones(1)]], CPU, [2, 2])
    assert marked[0] == ["a", "b"]
    assert marked[1].tolist() == [0, 1]


def test_lengths_that_fit_neither_reading_get_advice_for_both() -> None:
    with pytest.raises(
        GatherError,
        match=r"output\['boxes'\] has \[3, 1\] items in the replicas\..*same number of items, or concatenated when"
        r" every replica returns one item per row of its chunk \(chunks of \[2, 2\] rows\).*lightning_mgpu\.PerSample",
    ):
        gather([{"boxes": ["a", "b", "c"]}, {"boxes": ["d"]}], CPU, [2, 2])


def test_lengths_that_differ_without_chunk_sizes_get_the_advice_that_applies() -> None:
    with pytest.raises(GatherError, match=r"same number of items; return one of those, or wrap .*PerSample") as error:
        gather([[torch.ones(1)] * 3, [torch.ones(1)]], CPU)
    assert "one item per row" not in str(error.value)


def test_a_dataclass_is_gathered_field_by_field_with_its_init_false_fields() -> None:
    @dataclass
    class Prediction:
        scores: torch.Tensor
        names: list[str]
        total: torch.Tensor = field(init=False)

        def __post_init__(self) -> None:
            self.total = self.scores.sum(0, keepdim=True)

    outputs = [Prediction(torch.ones(2), ["a", "b"]), Prediction(torch.zeros(1), ["c"])]
    gathered = gather(outputs, CPU, [2, 1])
    assert isinstance(gathered, Prediction)
    assert gathered.scores.tolist() == [1, 1, 0]
    assert gathered.names == ["a", "b", "c"]
    assert gathered.total.tolist() == [2.0, 0.0]


def test_dataclasses_of_different_types_are_refused() -> None:
    @dataclass
    class A:
        x: torch.Tensor

    @dataclass
    class B:
        x: torch.Tensor

    with pytest.raises(GatherError) as caught:
        gather([A(torch.ones(1)), B(torch.ones(1))], CPU)
    assert (caught.value.path, caught.value.replica) == ("output", 1)


@pytest.mark.parametrize(
    ("outputs", "path", "replica"),
    [
        (({"a": torch.ones(1)}, {"b": torch.ones(1)}), "output", 1),
        (({"x": torch.ones(2, 3)}, {"x": torch.ones(2, 4)}), "output['x']", None),
        (({"x": torch.ones(2)}, {"x": object()}), "output['x']", 1),
        (([torch.ones(2)], {"x": torch.ones(2)}), "output", 1),
        ((torch.ones(()), torch.ones(2)), "output", None),
    ],
    ids=["keys", "shapes", "an object", "list against dict", "0-dim against rows"],
)
def test_a_gather_error_carries_the_path_and_the_replica(outputs: tuple, path: str, replica: int | None) -> None:
    with pytest.raises(GatherError) as caught:
        gather(outputs, CPU, [2, 2])
    assert (caught.value.path, caught.value.replica) == (path, replica)
    assert str(caught.value).startswith(path)


def test_a_gather_error_keeps_its_facts_when_pickled() -> None:
    error = pickle.loads(pickle.dumps(GatherError("output['x'] differs", "output['x']", 1)))
    assert (str(error), error.path, error.replica) == ("output['x'] differs", "output['x']", 1)


@pytest.mark.parametrize(
    "kind",
    [DictBacked, OrderedDict, UserDict, MappingProxyType, lambda items: defaultdict(list, items)],
    ids=["own", "OrderedDict", "UserDict", "MappingProxyType", "defaultdict"],
)
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_mapping_is_gathered_with_its_type_as_torch_and_lightning_rebuild_it(kind: Any, replicas: int) -> None:
    outputs = [{"inner": kind({"errors": torch.full((2,), float(index)), "index": index})} for index in range(replicas)]
    gathered = gather(outputs, CPU, [2] * replicas)
    inner = gathered["inner"]
    assert type(inner) is type(outputs[0]["inner"])
    assert list(inner.keys()) == ["errors", "index"]
    assert inner["errors"].tolist() == [float(index) for index in range(replicas) for _ in range(2)]
    assert inner["index"].tolist() == list(range(replicas))
    if isinstance(inner, defaultdict):
        assert inner.default_factory is list


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_mapping_that_cannot_be_rebuilt_is_refused_naming_its_type_path_and_fix(replicas: int) -> None:
    outputs = [{"record": KeywordsOnly(loss=torch.tensor(1.0), errors=torch.ones(2))} for _ in range(replicas)]
    with pytest.raises(GatherError) as caught:
        gather(outputs, CPU, [2] * replicas)
    assert (caught.value.path, caught.value.replica) == ("output['record']", None)
    message = str(caught.value)
    assert message.startswith("output['record'] is a KeywordsOnly")
    assert "KeywordsOnly(a dict) raised TypeError" in message
    assert "return a dict in its place" in message
