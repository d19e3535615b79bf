"""Splitting a batch into one chunk per replica."""

from __future__ import annotations

import pickle
import warnings
from collections import OrderedDict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch
from models import DictBacked, KeywordsOnly

from lightning_mgpu import BatchSplitError, Fields, MGPUDataParallel, PerSample
from lightning_mgpu.engine import chunk_sizes, scatter
from lightning_mgpu.engine.scatter import LayoutMemory, batch_size_of

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
    with pytest.raises(BatchSplitError) as caught:
        scatter({"x": torch.zeros(4), "y": torch.zeros(3)}, CPU2)
    assert caught.value.path == "batch['y']"


def test_a_batch_without_tensors_is_refused() -> None:
    with pytest.raises(BatchSplitError, match=r"holds no tensor with a batch dimension.*DataLoader"):
        scatter({"ids": [1, 2]}, CPU2)


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter(torch.zeros(0, 3), CPU2)
    assert caught.value.path == "batch"


def test_a_0_dim_tensor_in_the_batch_is_refused() -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter((torch.zeros(4), torch.tensor(1.0)), CPU2)
    assert caught.value.path == "batch[1]"


def test_a_plain_list_of_per_sample_tensors_is_split_by_items() -> None:
    boxes = [torch.full((count, 4), float(count)) for count in (1, 3, 2, 5)]
    chunks, _ = scatter({"images": torch.arange(4), "boxes": boxes}, CPU2)
    assert [[len(item) for item in chunk["boxes"]] for chunk in chunks] == [[1, 3], [2, 5]]
    assert all(type(chunk["boxes"]) is list for chunk in chunks)
    assert chunks[1]["boxes"][0] is boxes[2], "items are handed over whole, not copied"


def test_a_per_sample_list_where_one_item_has_as_many_rows_as_the_batch_is_split_by_items() -> None:
    boxes = [torch.zeros(4, 4), torch.zeros(2, 4), torch.zeros(4, 4), torch.zeros(4, 4)]
    chunks, _ = scatter((torch.arange(4), tuple(boxes)), CPU2)
    assert [len(chunk[1]) for chunk in chunks] == [2, 2]
    assert isinstance(chunks[0][1], tuple)
    assert chunks[0][1][1] is boxes[1]


@pytest.mark.parametrize(
    "items",
    [
        ["a", "b", "c"],
        [b"a", b"b", b"c"],
        [7, 8.5, True],
        [None, None, None],
        [{"name": "a"}, {"name": "b"}, {"name": "c"}],
        [["tok"], ["tok", "en"], []],
        [torch.tensor(1), torch.tensor(0), torch.tensor(1)],
        [torch.zeros(5), torch.zeros(5), torch.zeros(5)],
    ],
    ids=["strings", "bytes", "numbers", "none", "dicts", "nested-lists", "0-dim-tensors", "other-row-count"],
)
def test_a_list_with_one_item_per_row_is_split_by_items(items: list) -> None:
    chunks, _ = scatter({"x": torch.arange(3), "per_row": items}, CPU2)
    assert [len(chunk["per_row"]) for chunk in chunks] == [2, 1]
    assert chunks[1]["per_row"][0] is items[2]


def test_persample_is_split_by_items_and_keeps_its_type() -> None:
    images = PerSample(torch.zeros(3, 2, 2) for _ in range(3))
    chunks, sizes = scatter({"x": torch.arange(3), "images": images}, CPU2)
    assert sizes == [2, 1]
    assert [type(chunk["images"]) for chunk in chunks] == [PerSample, PerSample]
    assert chunks[1]["images"][0] is images[2]
    assert repr(PerSample([1])) == "PerSample([1])"


def test_a_batch_of_persample_lists_alone_has_their_length_as_its_rows() -> None:
    images = PerSample(torch.zeros(3, 2 + index, 2) for index in range(2))
    targets = PerSample({"boxes": torch.zeros(count, 4)} for count in (5, 1))
    chunks, sizes = scatter((images, targets), CPU2)
    assert sizes == [1, 1]
    assert chunks[1][0][0].shape == (3, 3, 2)
    assert chunks[1][1][0]["boxes"].shape == (1, 4)


def test_tensors_inside_per_sample_items_move_to_the_replica_device() -> None:
    boxes = [torch.zeros(count, 4) for count in (1, 3)]
    chunks, _ = scatter(
        {"x": torch.arange(2), "boxes": boxes, "meta": [{"b": box} for box in boxes]},
        [torch.device("cpu"), torch.device("meta")],
    )
    assert chunks[0]["boxes"][0] is boxes[0]
    assert chunks[1]["boxes"][0].device.type == "meta"
    assert chunks[1]["meta"][0]["b"].device.type == "meta"
    assert chunks[1]["x"].device.type == "meta"


@pytest.mark.parametrize("kind", [list, tuple])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_a_two_row_pair_batch_is_split_as_fields_as_torch_splits_it(kind: type, replicas: int) -> None:
    x, y = torch.arange(6.0).reshape(2, 3), torch.tensor([[10.0], [20.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunks, sizes = scatter(kind([x, y]), [torch.device("cpu")] * replicas)
    assert sizes == ([2] if replicas == 1 else [1, 1])
    assert all(type(chunk) is kind for chunk in chunks)
    start = 0
    for chunk, size in zip(chunks, sizes, strict=True):
        assert torch.equal(chunk[0], x[start : start + size])
        assert torch.equal(chunk[1], y[start : start + size])
        start += size


def test_n_images_with_n_boxes_each_are_refused_without_a_marker_or_an_earlier_batch() -> None:
    boxes = [torch.full((4, 4), float(image)) for image in range(4)]
    with pytest.raises(BatchSplitError) as caught:
        scatter({"images": torch.arange(4), "boxes": boxes}, CPU2)
    assert caught.value.path == "batch['boxes']"
    assert str(caught.value) == (
        "batch['boxes'] holds 4 alike items whose tensors all have the batch's 4 rows, so it reads both as fields"
        " (each item split by rows, as torch.nn.DataParallel splits a list) and as one item per sample (each item"
        " given whole to its sample's replica), and no earlier batch told which. Mark the list in your collate_fn:"
        " wrap one item per sample in lightning_mgpu.PerSample(...), as in"
        ' {"images": torch.stack(images), "boxes": PerSample(boxes)}, or fields in lightning_mgpu.Fields(...), as in'
        " Fields([x, y])."
    )
    marked, _ = scatter({"images": torch.arange(4), "boxes": PerSample(boxes)}, CPU2)
    assert [[float(item[0, 0]) for item in chunk["boxes"]] for chunk in marked] == [[0.0, 1.0], [2.0, 3.0]]
    assert all(item.shape == (4, 4) for chunk in marked for item in chunk["boxes"])
    fields, _ = scatter({"images": torch.arange(4), "boxes": Fields(boxes)}, CPU2)
    assert [item.shape for item in fields[1]["boxes"]] == [(2, 4)] * 4
    assert [float(item[0, 0]) for item in fields[1]["boxes"]] == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    "items",
    [
        [torch.zeros(2, 3), torch.ones(2, 3)],
        (torch.zeros(2, 3), torch.ones(2, 3)),
        [{"boxes": torch.zeros(2, 4), "labels": torch.zeros(2)}, {"boxes": torch.ones(2, 4), "labels": torch.ones(2)}],
        [[torch.zeros(2, 4), torch.zeros(2, 4)], [torch.ones(2, 4), torch.ones(2, 4)]],
    ],
    ids=["pair", "tuple", "dicts", "nested-lists"],
)
def test_every_list_that_reads_both_ways_is_named(items: list | tuple) -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter({"x": torch.arange(2), "a": items, "b": {"c": items}}, CPU2)
    assert caught.value.path == "batch['a']"
    assert "batch['a'] and batch['b']['c'] each hold 2 alike items" in str(caught.value)


@pytest.mark.parametrize(
    "items",
    [
        [torch.zeros(2, 3), torch.ones(2, 1)],
        [torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.float64)],
        [torch.zeros(2, 3), (torch.ones(2, 3),)],
        [{"boxes": torch.zeros(2, 4)}, {"points": torch.zeros(2, 4)}],
        [[torch.zeros(2, 4), torch.zeros(2, 5)], [torch.ones(2, 4), torch.ones(2, 6)]],
        [torch.zeros(2, 3), None],
    ],
    ids=["trailing-shape", "dtype", "type", "keys", "nested-trailing-shape", "none"],
)
def test_items_that_differ_make_a_list_of_n_items_fields_without_a_message(items: list) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chunks, _ = scatter({"x": torch.arange(2), "pair": items}, CPU2)
    assert [len(chunk["pair"]) for chunk in chunks] == [2, 2], "both items reach each replica, cut by rows"


@pytest.mark.parametrize(
    ("rows", "devices", "weights"),
    [(2, 1, None), (1, 2, None), (2, 2, [1, 0])],
    ids=["one-device", "one-row", "weights"],
)
def test_a_list_that_reads_both_ways_is_not_refused_when_one_chunk_takes_the_batch(
    rows: int, devices: int, weights: list[int] | None
) -> None:
    """With one chunk both readings give the same chunk, so there is nothing to ask."""
    pair = [torch.randn(rows, 3), torch.randn(rows, 3)]
    chunks, sizes = scatter(pair, [torch.device("cpu")] * devices, weights)
    assert sizes == [rows]
    assert all(torch.equal(left, right) for left, right in zip(chunks[0], pair, strict=True))


def test_a_memory_reads_a_list_that_reads_both_ways_as_earlier_batches_read_its_path() -> None:
    memory = LayoutMemory()
    per_image = [torch.zeros(count, 4) for count in (1, 3, 2, 5)]
    scatter({"x": torch.arange(4), "boxes": per_image}, CPU2, memory=memory)
    square = [torch.full((4, 4), float(image)) for image in range(4)]
    chunks, _ = scatter({"x": torch.arange(4), "boxes": square}, CPU2, memory=memory)
    assert [[float(item[0, 0]) for item in chunk["boxes"]] for chunk in chunks] == [[0.0, 1.0], [2.0, 3.0]]
    assert chunks[1]["boxes"][0] is square[2]
    scatter([torch.zeros(4, 3), torch.ones(4, 3)], CPU2, memory=memory)  # 2 items in a batch of 4 rows: fields
    pair, sizes = scatter([torch.zeros(2, 3), torch.ones(2, 3)], CPU2, memory=memory)
    assert sizes == [1, 1]
    assert [[item.tolist() for item in chunk] for chunk in pair] == [[[[0.0] * 3], [[1.0] * 3]]] * 2
    assert (memory.recall("batch['boxes']"), memory.recall("batch")) == (True, False)


def test_a_key_path_read_one_way_is_refused_when_a_later_batch_proves_the_other() -> None:
    memory = LayoutMemory()
    scatter({"x": torch.arange(8), "shape": [224, 224]}, CPU2, memory=memory)
    with pytest.raises(BatchSplitError) as caught:
        scatter({"x": torch.arange(2), "shape": [224, 224]}, CPU2, memory=memory)
    assert caught.value.path == "batch['shape']"
    assert str(caught.value).startswith(
        "batch['shape'] was read as fields in an earlier batch, but its 2 items in this batch of 2 rows can only be"
        " read as one item per sample; one key path is read one way in a run, so that no step receives its data cut"
        " the other way. Mark the list in your collate_fn:"
    )
    scatter({"x": torch.arange(2), "ids": ["a", "b"]}, CPU2, memory=memory)
    with pytest.raises(BatchSplitError) as caught:
        scatter({"x": torch.arange(3), "ids": ["a", "b"]}, CPU2, memory=memory)
    assert caught.value.path == "batch['ids']"
    chunks, _ = scatter({"x": torch.arange(1), "shape": [224]}, CPU2, memory=memory)
    assert chunks[0]["shape"] == [224], "one chunk: both readings give it, so nothing differs from the earlier batch"


def test_persample_makes_a_pair_that_would_be_fields_one_item_per_sample() -> None:
    pair = PerSample([torch.zeros(2, 3), torch.ones(2, 3)])
    chunks, sizes = scatter(pair, CPU2)
    assert sizes == [1, 1]
    assert [type(chunk) for chunk in chunks] == [PerSample, PerSample]
    assert chunks[1][0] is pair[1], "each replica gets its own sample whole, with all of its 2 rows"


def test_a_pair_whose_tensors_disagree_at_the_top_is_refused_with_both_sizes_and_the_fixes() -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter([torch.zeros(2, 3), torch.zeros(3, 1)], CPU2)
    assert str(caught.value) == (
        "The tensors in the batch disagree on their size along dim 0 (batch[0]: 2, batch[1]: 3), so the batch cannot"
        " be split into matching chunks per replica. Make every tensor in the batch hold one row per sample; wrap a"
        " list that holds one item per sample (such as one boxes tensor per image) in lightning_mgpu.PerSample(...)"
        " in your collate_fn; or move per-batch data out of the batch (for example into the LightningModule)."
    )


def test_a_0_dim_tensor_outside_every_list_is_refused_by_its_path() -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter({"x": torch.zeros(2), "scale": torch.tensor(0.5)}, CPU2)
    assert caught.value.path == "batch['scale']"


def test_fields_and_namedtuples_are_always_split_field_by_field() -> None:
    pair = namedtuple("pair", ["x", "y"])
    for batch in (Fields([torch.arange(2), torch.arange(2)]), pair(torch.arange(2), ["a", "b"])):
        chunks, _ = scatter(batch, CPU2)
        assert type(chunks[1]) is type(batch)
        assert chunks[1][0].tolist() == [1]
    x, y = scatter(Fields([torch.arange(2), torch.arange(2)]), CPU2)[0][0]
    assert x.tolist() == y.tolist() == [0]


def test_a_list_holding_a_marker_is_split_field_by_field() -> None:
    batch = (PerSample(torch.zeros(3, 5, 5) for _ in range(2)), PerSample(["a", "b"]))
    chunks, sizes = scatter(batch, CPU2)
    assert sizes == [1, 1]
    assert isinstance(chunks[0], tuple)
    assert chunks[1][1] == ["b"]


def test_rows_come_from_the_tensors_outside_lists_first() -> None:
    batch = {"images": torch.arange(2), "boxes": [torch.zeros(3, 4), torch.zeros(3, 4)]}
    assert batch_size_of(batch) == 2
    assert batch_size_of([torch.zeros(5, 2), [torch.zeros(7)]]) == 5


def test_tensors_of_the_nearest_level_that_disagree_are_refused_with_the_persample_fix() -> None:
    images = tuple(torch.zeros(3, 8, 8) for _ in range(2))
    targets = tuple({"boxes": torch.zeros(count, 4)} for count in (5, 1))
    with pytest.raises(BatchSplitError) as caught:
        scatter((images, targets), CPU2)
    assert caught.value.path == "batch[1][0]['boxes']"


def test_a_persample_with_the_wrong_length_is_refused() -> None:
    with pytest.raises(BatchSplitError, match=r"batch\['x'\]: 3, batch\['names'\]: 2 items") as caught:
        scatter({"x": torch.arange(3), "names": PerSample(["a", "b"])}, CPU2)
    assert caught.value.path == "batch['names']"


def test_a_deeper_tensor_with_the_wrong_rows_is_named_with_the_rows_it_disagrees_with() -> None:
    with pytest.raises(BatchSplitError, match=r"batch\['x'\]: 4, batch\['pair'\]\[1\]: 3") as caught:
        scatter({"x": torch.arange(4), "pair": [torch.zeros(4), torch.zeros(3)]}, CPU2)
    assert caught.value.path == "batch['pair'][1]"


def test_a_dataclass_with_init_false_fields_is_rebuilt_without_init() -> None:
    calls: list[int] = []

    @dataclass
    class Batch:
        x: torch.Tensor
        names: list[str]
        rows: int = field(init=False)
        doubled: torch.Tensor = field(init=False)
        never_set: torch.Tensor = field(init=False)

        def __post_init__(self) -> None:
            calls.append(1)
            self.rows = len(self.x)
            self.doubled = self.x * 2

    batch = Batch(torch.arange(3.0), ["a", "b", "c"])
    chunks, _ = scatter(batch, CPU2)
    assert len(calls) == 1, "__init__ and __post_init__ are not run again for the chunks"
    assert chunks[1].x.tolist() == [2.0]
    assert chunks[1].doubled.tolist() == [4.0]
    assert chunks[1].names == ["c"]
    assert chunks[1].rows == 3, "a value of its own reaches every replica whole"
    assert not hasattr(chunks[1], "never_set")


def test_a_frozen_dataclass_is_split() -> None:
    @dataclass(frozen=True)
    class Frozen:
        x: torch.Tensor
        scale: float = field(init=False, default=2.0)

    chunks, _ = scatter(Frozen(torch.arange(4)), CPU2)
    assert chunks[1].x.tolist() == [2, 3]
    assert chunks[1].scale == 2.0


def test_a_slotted_frozen_dataclass_with_an_init_false_field_is_split() -> None:
    @dataclass(slots=True, frozen=True)
    class Slotted:
        x: torch.Tensor
        doubled: torch.Tensor = field(init=False)

        def __post_init__(self) -> None:
            object.__setattr__(self, "doubled", self.x * 2)

    chunks, _ = scatter(Slotted(torch.arange(4.0)), CPU2)
    assert chunks[1].x.tolist() == [2.0, 3.0]
    assert chunks[1].doubled.tolist() == [4.0, 6.0]


@pytest.mark.parametrize(("rows", "devices"), [(5, 2), (2, 4), (7, 3), (1, 2)])
def test_plain_tensors_split_as_the_general_path_splits_them(rows: int, devices: int) -> None:
    from lightning_mgpu.engine.scatter import scatter_to_devices, split_plain_tensors

    inputs = (torch.randn(rows, 3), torch.arange(rows), torch.randn(rows, 2, 2))
    fast = split_plain_tensors(inputs, [torch.device("cpu")] * devices)
    assert fast is not None
    chunks, sizes, used = scatter_to_devices({"inputs": Fields(inputs), "kwargs": {}}, [torch.device("cpu")] * devices)
    assert fast[1] == sizes
    assert fast[2] == used
    assert len(fast[0]) == len(chunks)
    for quick, general in zip(fast[0], chunks, strict=True):
        assert type(quick) is tuple
        assert len(quick) == len(inputs)
        for left, right in zip(quick, general["inputs"], strict=True):
            assert torch.equal(left, right)


class _Tagged(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "inputs",
    [
        (),
        (torch.randn(4, 2), torch.randn(3, 2)),
        (torch.randn(4, 2), torch.tensor(1.0)),
        (torch.randn(0, 2),),
        (torch.randn(4, 2), [torch.randn(4)]),
        (torch.randn(4, 2).as_subclass(_Tagged),),
    ],
    ids=["no-inputs", "rows-disagree", "0-dim", "empty", "a-list", "a-subclass"],
)
def test_anything_but_plain_tensors_with_equal_rows_takes_the_general_path(inputs: tuple) -> None:
    from lightning_mgpu.engine.scatter import split_plain_tensors

    assert split_plain_tensors(inputs, CPU2) is None


@pytest.mark.parametrize(
    ("batch", "path"),
    [
        ({"x": torch.ones(4, 2), "y": torch.ones(3, 1)}, "batch['y']"),
        ({"x": torch.ones(4, 2), "t": torch.tensor(1.0)}, "batch['t']"),
        ([torch.ones(4, 2), [torch.ones(4), torch.ones(5)]], "batch[1][1]"),
        ({"x": torch.ones(4, 2), "ids": PerSample([1, 2, 3])}, "batch['ids']"),
        ("no tensor", "batch"),
    ],
    ids=["rows disagree", "0-dim", "nested rows disagree", "per-sample items", "no tensor"],
)
def test_a_batch_split_error_carries_the_path(batch: object, path: str) -> None:
    with pytest.raises(BatchSplitError) as caught:
        scatter(batch, [torch.device("cpu")] * 2)
    assert caught.value.path == path
    assert path in str(caught.value)


def test_a_batch_split_error_keeps_its_path_when_pickled() -> None:
    error = pickle.loads(pickle.dumps(BatchSplitError("batch['y'] disagrees", "batch['y']")))
    assert (str(error), error.path) == ("batch['y'] disagrees", "batch['y']")


class _Boxes(torch.nn.Module):
    """Scores each image against the mean of its own boxes, given in a nested list beside the images."""

    def forward(self, images: torch.Tensor, targets: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        return torch.stack([image.sum() - boxes.mean() for image, boxes in zip(images, targets["boxes"], strict=True)])


def test_forward_reads_a_nested_list_that_reads_both_ways_as_fields_and_a_method_as_its_earlier_batches() -> None:
    """forward's inputs are torch.nn.DataParallel's: such a list is fields; a method's batch keeps the rule."""
    module = _Boxes()
    wrapper = MGPUDataParallel(module, CPU2)
    images = torch.randn(4, 3)
    square = [torch.randn(4, 4) for _ in range(4)]
    try:
        inputs = wrapper.scatter((images,), {"targets": {"boxes": square}})
        assert [[len(box) for box in kwargs["targets"]["boxes"]] for _, kwargs in inputs.calls] == [[2] * 4] * 2
        marked = {"boxes": PerSample(square)}
        torch.testing.assert_close(wrapper(images, targets=marked), module(images, {"boxes": square}), atol=0, rtol=0)
        with pytest.raises(BatchSplitError) as caught:
            wrapper.scatter_batch({"images": images, "boxes": square}, method="validation_step")
        assert caught.value.path == "batch['boxes']"
        told = [torch.randn(count, 4) for count in (1, 3, 2, 5)]
        wrapper.scatter_batch({"images": images, "boxes": told}, method="validation_step")
        batches = wrapper.scatter_batch({"images": images, "boxes": square}, method="validation_step")
        assert [[len(box) for box in args[0]["boxes"]] for args, _ in batches.calls] == [[4] * 2] * 2
    finally:
        wrapper.close()


def test_a_mapping_of_its_own_is_split_with_its_type() -> None:
    batch = DictBacked({"x": torch.arange(6).reshape(3, 2), "names": ["a", "b", "c"]})
    chunks, sizes = scatter(batch, CPU2)
    assert sizes == [2, 1]
    assert [type(chunk) for chunk in chunks] == [DictBacked, DictBacked]
    assert chunks[1]["x"].tolist() == [[4, 5]]
    assert chunks[1]["names"] == ["c"]


def test_a_mapping_that_cannot_be_rebuilt_is_refused_naming_its_type_and_path() -> None:
    batch = {"x": torch.ones(4, 2), "target": KeywordsOnly(loss=torch.ones(4), errors=torch.zeros(4))}
    with pytest.raises(BatchSplitError) as caught:
        scatter(batch, CPU2)
    assert caught.value.path == "batch['target']"
    assert str(caught.value).startswith("batch['target'] is a KeywordsOnly")
