"""Replicas alias the original parameters; buffers of replica 0 are the originals, others private copies."""

from __future__ import annotations

import torch
from torch import nn

from lightning_mgpu import DataParallel
from lightning_mgpu.engine import replicate

CPU2 = [torch.device("cpu")] * 2


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.extra = nn.ParameterList([nn.Parameter(torch.ones(2)), nn.Parameter(torch.full((2,), 2.0))])
    for index in range(2):
        model.register_parameter(f"H_{index}", nn.Parameter(torch.full((2,), float(index + 1))))
    model.rnn = nn.GRU(3, 2, batch_first=True)
    return model


def test_replicas_own_no_parameters_and_gradients_reach_the_originals() -> None:
    model = _model()
    replicas = replicate(model, CPU2)
    assert all(list(replica.parameters()) == [] for replica in replicas)
    x = torch.randn(6, 3)
    loss = sum(replica.body(x[3 * i : 3 * i + 3]).sum() for i, replica in enumerate(replicas))
    loss = loss + sum((p * p).sum() for p in replicas[1].extra) + (replicas[0].H_1 * 3).sum()
    loss = loss + replicas[1].rnn(x.view(2, 3, 3))[0].sum()
    loss.backward()
    unused = {"H_0"}
    assert all(param.grad is not None for name, param in model.named_parameters() if name not in unused)
    assert all(param.grad.abs().sum() > 0 for param in model.rnn.parameters())
    assert model.extra[1].grad.tolist() == [4.0, 4.0]
    assert model.H_1.grad.tolist() == [3.0, 3.0]
    assert model.H_0.grad is None


def test_parameter_list_reaches_every_replica() -> None:
    replicas = replicate(_model(), CPU2)
    for replica in replicas:
        assert len(replica.extra) == 2
        assert [p.tolist() for p in replica.extra] == [[1.0, 1.0], [2.0, 2.0]]


def test_only_the_first_replica_writes_to_the_original_buffers() -> None:
    model = _model()
    replicas = replicate(model, CPU2)
    original = model.body[1].running_mean
    assert replicas[0].body[1].running_mean is original
    assert replicas[1].body[1].running_mean is not original
    replicas[1].body(torch.randn(4, 3) + 10)
    assert original.abs().sum() == 0
    replicas[0].body(torch.randn(4, 3) + 10)
    assert original.abs().sum() > 0


def test_replica_shells_are_distinct_objects_that_leave_the_original_alone() -> None:
    model = _model()
    replicas = replicate(model, CPU2)
    replicas[1].note = "replica only"
    assert not hasattr(model, "note")
    assert replicas[0].body is not model.body
    assert replicas[0].body is not replicas[1].body
    assert isinstance(replicas[1].rnn, nn.GRU)


def test_data_parallel_wrapper_matches_the_module_and_passes_attributes_through() -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    wrapper = DataParallel(module, CPU2)
    try:
        x = torch.randn(5, 3)
        torch.testing.assert_close(wrapper(x), module(x))
        assert wrapper.out_features == 2
        assert wrapper.weight is module.weight
        assert wrapper.root_device == torch.device("cpu")
    finally:
        wrapper.close()


def test_the_wrapper_times_each_phase() -> None:
    wrapper = DataParallel(nn.Linear(3, 2), CPU2)
    try:
        wrapper(torch.randn(6, 3))
        wrapper(torch.randn(6, 3))
    finally:
        wrapper.close()
    assert set(wrapper.phase_seconds) == {"scatter", "replicate", "parallel_apply", "gather"}
    assert all(seconds > 0 for seconds in wrapper.phase_seconds.values())


def test_the_cache_reuses_shells_but_follows_the_module() -> None:
    from lightning_mgpu.engine.replicate import ReplicaCache

    model = _model()
    cache = ReplicaCache()
    first = cache(model, CPU2)
    first_body, first_rnn = first[1].body, first[1].rnn
    first[1].scratch = "left over by a step"
    model.note = "set between steps"
    model.eval()
    second = cache(model, CPU2)
    assert second[0] is first[0], "plain modules keep their shells"
    assert second[1].body is first_body
    assert second[1].rnn is not first_rnn, "modules with their own replication get fresh shells"
    assert second[1].note == "set between steps"
    assert not second[1].training
    assert not second[1].body[1].training
    assert not hasattr(second[1], "scratch"), "what a replica stored does not outlive its step"
    x = torch.randn(4, 3)
    torch.testing.assert_close(second[1].body(x), model.body(x))

    model.body[2] = nn.Linear(4, 1)
    third = cache(model, CPU2)
    assert third[0] is not first[0], "a changed structure rebuilds the shells"
    torch.testing.assert_close(third[0].body(x), model.body(x))


def test_cached_replicas_give_the_gradients_of_fresh_ones() -> None:
    from lightning_mgpu.engine.replicate import ReplicaCache

    cache = ReplicaCache()
    x = torch.randn(6, 3)
    grads = []
    for use_cache in (False, True, True):
        model = _model()
        replicas = cache(model, CPU2) if use_cache else replicate(model, CPU2)
        sum(replica.body(x[3 * i : 3 * i + 3]).sum() for i, replica in enumerate(replicas)).backward()
        grads.append([p.grad.clone() for p in model.body.parameters()])
    for other in grads[1:]:
        for left, right in zip(grads[0], other, strict=True):
            torch.testing.assert_close(left, right)
