"""Replicas alias the original parameters; buffers of replica 0 are the originals, others private copies."""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_mgpu import MGPUDataParallel
from lightning_mgpu.engine import replicate

CPU2 = [torch.device("cpu")] * 2
replicate_module = importlib.import_module("lightning_mgpu.engine.replicate")


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.extra = nn.ParameterList([nn.Parameter(torch.ones(2)), nn.Parameter(torch.full((2,), 2.0))])
    for index in range(2):
        model.register_parameter(f"H_{index}", nn.Parameter(torch.full((2,), float(index + 1))))
    model.rnn = nn.GRU(3, 2, batch_first=True)
    return model


def _shares_storage(tensor: torch.Tensor, original: torch.Tensor) -> bool:
    return tensor.untyped_storage().data_ptr() == original.untyped_storage().data_ptr() and tensor is not original


def test_replica_parameters_are_aliases_and_gradients_reach_the_originals() -> None:
    model = _model()
    replicas = replicate(model, CPU2)
    originals = dict(model.named_parameters())
    for replica in replicas:
        own = dict(replica.named_parameters())
        assert own.keys() == originals.keys()
        assert all(not tensor.is_leaf and _shares_storage(tensor, originals[name]) for name, tensor in own.items())
        assert [name for name, _ in replica.body.named_parameters()] == [
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
            "2.weight",
            "2.bias",
        ]
        assert next(replica.rnn.parameters()).device == torch.device("cpu")
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
    wrapper = MGPUDataParallel(module, CPU2)
    try:
        x = torch.randn(5, 3)
        torch.testing.assert_close(wrapper(x), module(x))
        assert wrapper.out_features == 2
        assert wrapper.weight is module.weight
        assert wrapper.root_device == torch.device("cpu")
    finally:
        wrapper.close()


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


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_dense() for name, p in module.named_parameters() if p.grad is not None}


def _assert_like_one_device(
    make: Callable[[], nn.Module], x: torch.Tensor, devices: int = 2
) -> tuple[nn.Module, torch.Tensor]:
    """Forward and backward through ``devices`` replicas give the output and gradients of the module itself."""
    torch.manual_seed(0)
    single = make()
    torch.manual_seed(0)
    parallel = make()
    expected = single(x)
    expected.sum().backward()
    wrapper = MGPUDataParallel(parallel, [torch.device("cpu")] * devices)
    try:
        output = wrapper(x)
        output.sum().backward()
    finally:
        wrapper.close()
    torch.testing.assert_close(output, expected, atol=1e-6, rtol=0)
    ours, theirs = _grads(single), _grads(parallel)
    assert ours
    assert ours.keys() == theirs.keys()
    for name in ours:
        # Gradients are sums over the batch, so they are compared relative to their size.
        scale = max(1.0, float(ours[name].abs().max()))
        torch.testing.assert_close(theirs[name], ours[name], atol=1e-6 * scale, rtol=0, msg=f"gradient of {name}")
    return parallel, output


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x)) * 2


class _Outer(nn.Module):
    def __init__(self, encoder: nn.Module) -> None:
        super().__init__()
        self.enc = encoder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.enc(x) + 1


@pytest.mark.parametrize("form", ["torch.compile(module)", "module.compile()"])
def test_compiled_submodules_run_their_own_replica_and_leave_the_module_whole(
    form: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make() -> nn.Module:
        encoder = _Encoder()
        if form == "module.compile()":
            encoder.compile(backend="eager")
            return _Outer(encoder)
        return _Outer(torch.compile(encoder, backend="eager"))

    parallel, _ = _assert_like_one_device(make, torch.randn(5, 4))
    encoder = parallel.enc._orig_mod if form == "torch.compile(module)" else parallel.enc
    assert [name for name, _ in parallel.named_parameters()] == [
        f"enc.{'_orig_mod.' if form == 'torch.compile(module)' else ''}linear.{kind}" for kind in ("weight", "bias")
    ]
    assert [type(child).__name__ for child in encoder.modules()] == ["_Encoder", "Linear"]
    # Replicas whose weights differ from the module's, as copies on other GPUs may: a replica that ran the module
    # itself would return the module's output instead of its own.
    monkeypatch.setattr(replicate_module, "replica_parameters", lambda params: [param * 0 for param in params])
    replicas = replicate(parallel, CPU2)
    torch.testing.assert_close(replicas[1](torch.randn(3, 4)), torch.ones(3, 4))


def test_a_compiled_call_that_cannot_be_rebound_runs_uncompiled_with_a_warning() -> None:
    from lightning_mgpu import _compat

    encoder = _Encoder()
    encoder.compile(backend="eager")
    assert _compat.recompile_call(_compat.compiled_call(encoder), _Encoder()) is not None
    encoder.__dict__["_compiled_call_impl"] = lambda *args: encoder._call_impl(*args)  # no compile context inside
    with pytest.warns(UserWarning, match=r"_Encoder was compiled in place.*run it uncompiled.*torch.compile\(module\)"):
        replicas = replicate(encoder, CPU2)
    x = torch.randn(3, 4)
    torch.testing.assert_close(replicas[1](x), torch.tanh(encoder.linear(x)) * 2)


def test_sparse_embedding_gradients_are_those_of_one_device() -> None:
    def make() -> nn.Module:
        return nn.Sequential(nn.Embedding(10, 3, sparse=True), nn.Flatten(), nn.Linear(6, 1))

    parallel, _ = _assert_like_one_device(make, torch.tensor([[1, 2], [2, 3], [9, 1], [4, 4], [0, 2]]), devices=3)
    assert parallel[0].weight.grad.is_sparse


@pytest.mark.parametrize("kind", [nn.LSTM, nn.GRU, nn.RNN])
def test_recurrent_replicas_use_their_own_flat_weights(kind: type[nn.RNNBase]) -> None:
    def make() -> nn.Module:
        rnn = kind(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        return nn.Sequential(rnn, _First())

    _assert_like_one_device(make, torch.randn(5, 6, 3), devices=3)
    replica = replicate(make(), CPU2)[1][0]
    names = replica._flat_weights_names
    assert [w is getattr(replica, name) for w, name in zip(replica._flat_weights, names, strict=True)] == [True] * len(
        names
    )


class _First(nn.Module):
    def forward(self, output: tuple[torch.Tensor, object]) -> torch.Tensor:
        return output[0]


def test_tied_weights_stay_one_tensor_in_a_replica() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(5, 3)
    model.out = nn.Linear(3, 5, bias=False)
    model.out.weight = model.embed.weight
    replica = replicate(model, CPU2)[1]
    assert replica.out.weight is replica.embed.weight
    assert len(list(replica.parameters())) == len(list(model.parameters())) == 1


def test_weight_norm_and_parametrizations_replicate_exactly() -> None:
    def make() -> nn.Module:
        return nn.Sequential(
            nn.utils.weight_norm(nn.Linear(4, 4)),
            nn.utils.parametrizations.weight_norm(nn.Linear(4, 4)),
            nn.utils.parametrizations.orthogonal(nn.Linear(4, 4)),
            nn.utils.spectral_norm(nn.Linear(4, 2)),
        )

    _assert_like_one_device(make, torch.randn(5, 4), devices=3)


def test_a_buffer_reassigned_by_replica_0_is_kept() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("calls", torch.zeros(()))
            self.linear = nn.Linear(2, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls = self.calls + 1
            return self.linear(x)

    model = Counter()
    wrapper = MGPUDataParallel(model, CPU2)
    try:
        for _ in range(3):
            wrapper(torch.randn(4, 2))
    finally:
        wrapper.close()
    assert model.calls.item() == 3.0
    assert "calls" in dict(model.named_buffers())


def test_a_replica_records_one_autograd_node_for_all_its_parameters_and_keeps_their_semantics() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.Linear(2, 2))
    model[2].bias.requires_grad_(False)
    replicas = replicate(model, CPU2)
    for replica in replicas:
        nodes = {param.grad_fn for param in replica.parameters() if param.requires_grad}
        assert len(nodes) == 1
        assert None not in nodes
        assert [param.requires_grad for param in replica.parameters()] == [
            param.requires_grad for param in model.parameters()
        ]
    x = torch.randn(6, 3)
    # Double backward (a gradient penalty) through replica 1 equals the same on the module itself.
    (penalty,) = torch.autograd.grad(replicas[1][:3](x).pow(2).sum(), replicas[1][0].weight, create_graph=True)
    penalty.square().sum().backward()
    through_replica = model[0].weight.grad.clone()
    model.zero_grad(set_to_none=True)
    (penalty,) = torch.autograd.grad(model[:3](x).pow(2).sum(), model[0].weight, create_graph=True)
    penalty.square().sum().backward()
    torch.testing.assert_close(through_replica, model[0].weight.grad, rtol=0, atol=0)
    # A parameter no replica uses gets no gradient, not a zero one.
    model.zero_grad(set_to_none=True)
    replicas = replicate(model, CPU2)
    sum(replica[:3](x).sum() for replica in replicas).backward()
    assert model[3].weight.grad is None
    assert model[3].bias.grad is None
    assert model[0].weight.grad is not None


def test_a_replica_of_a_module_with_few_parameters_keeps_an_alias_node_each() -> None:
    model = nn.Linear(3, 2)
    replicas = replicate(model, CPU2)
    for replica in replicas:
        assert len({replica.weight.grad_fn, replica.bias.grad_fn}) == 2
        assert _shares_storage(replica.weight, model.weight)
    x = torch.randn(4, 3)
    sum(replica(x).sum() for replica in replicas).backward()
    torch.testing.assert_close(model.bias.grad, torch.full((2,), 8.0))


def test_replicas_made_without_gradient_recording_are_plain_aliases() -> None:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        replicas = replicate(model, CPU2)
    for replica in replicas:
        assert all(param.grad_fn is None and _shares_storage(param, model.weight) for param in [replica.weight])


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")  # importing forward_ad
def test_forward_mode_derivatives_pass_through_a_replica_as_through_the_module() -> None:
    import torch.autograd.forward_ad as forward_ad

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))  # 4 parameters: one node per replica
    replicas = replicate(model, CPU2)
    assert replicas[1][0].weight.grad_fn is replicas[1][2].bias.grad_fn
    x, tangent = torch.randn(5, 3), torch.randn(5, 3)
    derivatives = []
    for module in (replicas[1], model):
        with forward_ad.dual_level():
            derivatives.append(forward_ad.unpack_dual(module(forward_ad.make_dual(x, tangent))).tangent)
    torch.testing.assert_close(derivatives[0], derivatives[1], rtol=0, atol=0)


def test_an_attribute_moved_to_another_name_counts_as_assigned_though_every_value_is_where_it_was() -> None:
    held = ("state", 0)
    attributes: dict[str, object] = {"training": True, "current": held}
    snapshot = replicate_module._Attributes([attributes])
    assert snapshot.unchanged()
    del attributes["current"]
    attributes["previous"] = held  # the same object, in the same place among the values
    assert not snapshot.unchanged()
    assert list(snapshot.changed()) == [(0, {"current", "previous"})]
