"""Wrong models, batches, outputs and configurations: each fails early with the cause and the fix, or warns.

One row per case: how to provoke it, what must be raised or warned, and a pattern that the message must match
(naming the cause and the fix). Cases that need several processes live in tests/test_ddp.py and are listed at the
bottom of this file so the table stays complete.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning as L
import pytest
import torch
import torchmetrics
from models import Portable, Regressor, loader, regression_data, trainer
from torch import nn

from lightning_mgpu import (
    BatchSplitError,
    ConfigurationError,
    GatherError,
    MGPUDDPStrategy,
    MGPUDPStrategy,
    ModelCheckError,
    register_parameters,
    to_device_of,
)
from lightning_mgpu.engine import gather, scatter


@dataclass
class Case:
    provoke: Callable[[], Any]
    raises: type[BaseException] | None
    warns: type[Warning] | None
    pattern: str


def _fit_dp(model: L.LightningModule, batch_size: int = 4, rows: int = 8, **kwargs: Any) -> None:
    settings = {"devices": 2, "strategy": "mgpu_dp", "max_steps": 2, **kwargs}
    trainer(**settings).fit(model, loader(regression_data(rows=rows), batch_size))


def _model(**steps: Callable[..., Any]) -> L.LightningModule:
    return type("Custom", (Regressor,), steps)()


def _returns(value: Callable[[Any, Any], Any]) -> L.LightningModule:
    def training_step(self: Any, batch: Any, batch_idx: int) -> Any:
        return value(self, batch)

    def training_step_end(self: Any, output: Any) -> torch.Tensor:
        return self(torch.zeros(1, 4)).sum()

    return _model(training_step=training_step, training_step_end=training_step_end)


class _Mismatched(Regressor):
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        return batch[0], batch[1][:-1]


class _PlainList(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.extra = [nn.Parameter(torch.ones(1))]


class _PlainDictOfModules(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.heads = {"a": nn.Linear(4, 1)}


class _Unregistered(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.ones(1)


class _NaNLoss(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.replica_index == 1 else loss


class _MetricInReplica(Regressor):
    def __init__(self) -> None:
        super().__init__()
        self.mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("mse", self.mse)
        return super().training_step(batch, batch_idx)


class _Empty(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


def _fit_empty() -> None:
    trainer(devices=2, strategy="mgpu_dp", max_steps=2).fit(Regressor(), torch.utils.data.DataLoader(_Empty()))


def _missing_cuda(strategy: type) -> Callable[[], Any]:
    def provoke() -> None:
        original = torch.cuda.is_available
        torch.cuda.is_available = lambda: False  # type: ignore[assignment]
        try:
            strategy(parallel_devices=[torch.device("cuda", 0), torch.device("cuda", 1)])
        finally:
            torch.cuda.is_available = original  # type: ignore[assignment]

    return provoke


def _register_twice() -> None:
    module = Portable()
    register_parameters(module, "H", [torch.ones(1)])
    register_parameters(module, "H", [torch.ones(1)])


def _raise_in_replica(self: Any, batch: Any, batch_idx: int) -> Any:
    if self.replica_index == 1:
        raise KeyError("feature 'age' missing")
    return Regressor.training_step(self, batch, batch_idx)


CASES: dict[str, Case] = {
    "string output": Case(
        lambda: _fit_dp(_returns(lambda self, batch: {"tag": "x"})), GatherError, None,
        r"output\['tag'\] in replica 0 is a str.*Return only tensors",
    ),
    "dataclass output": Case(
        lambda: gather([object(), object()], torch.device("cpu")), GatherError, None,
        r"replica 0 is a object.*Return only tensors",
    ),
    "different keys per replica": Case(
        lambda: _fit_dp(_returns(lambda self, batch: {f"k{self.replica_index}": batch[0]})), GatherError, None,
        r"replica 1 has keys \['k1'\] but replica 0 returned \['k0'\].*same keys",
    ),
    "shapes differ beyond dim 0": Case(
        lambda: _fit_dp(_returns(lambda self, batch: batch[0][:, : 1 + self.replica_index])), GatherError, None,
        r"shapes \[\(2, 1\), \(2, 2\)\].*Pad them",
    ),
    "scalar in one replica, vector in another": Case(
        lambda: _fit_dp(_returns(lambda self, batch: batch[0][:, 0] if self.replica_index else batch[0].sum())),
        GatherError, None, r"0-dim in some replicas and not in others.*same shape",
    ),
    "None in one replica only": Case(
        lambda: _fit_dp(_returns(lambda self, batch: None if self.replica_index else batch[0])), GatherError, None,
        r"Tensor .* in replica 0 but a NoneType .* in replica 1.*same structure",
    ),
    "batch tensors of different lengths": Case(
        lambda: _fit_dp(_Mismatched()), BatchSplitError, None, r"batch\[0\]: 4, batch\[1\]: 3.*one row per sample",
    ),
    "0-dim tensor in the batch": Case(
        lambda: scatter((torch.zeros(4), torch.tensor(2.0)), [torch.device("cpu")] * 2), BatchSplitError, None,
        r"batch\[1\] is a 0-dim tensor.*leading batch dimension",
    ),
    "batch without tensors": Case(
        lambda: scatter({"ids": [1, 2]}, [torch.device("cpu")] * 2), BatchSplitError, None,
        r"holds no tensor with a batch dimension.*DataLoader",
    ),
    "empty batch": Case(
        lambda: scatter(torch.zeros(0, 4), [torch.device("cpu")] * 2), BatchSplitError, None,
        r"batch is empty.*Drop empty batches",
    ),
    "empty dataloader": Case(_fit_empty, None, UserWarning, r"length of .*DataLoader.* is zero|no .*batches"),
    "batch smaller than the device count": Case(
        lambda: _fit_dp(Regressor(), batch_size=1, rows=2), None, UserWarning,
        r"batch of 1 row\(s\) was split across 1 of 2 devices.*batch size of at least the device count",
    ),
    "parameters in a plain list": Case(
        lambda: _fit_dp(_PlainList()), ModelCheckError, None, r"`extra` is a plain Python list.*ParameterList",
    ),
    "modules in a plain dict": Case(
        lambda: _fit_dp(_PlainDictOfModules()), ModelCheckError, None, r"`heads` is a plain Python dict.*ModuleDict",
    ),
    "unregistered tensor attribute": Case(
        lambda: _fit_dp(_Unregistered()), None, UserWarning, r"`scale` is a tensor but neither.*register_buffer",
    ),
    "num_nodes > 1 with mgpu_dp": Case(
        lambda: trainer(devices=2, strategy="mgpu_dp", num_nodes=2), ConfigurationError, None,
        r"num_nodes=2.*Use strategy='mgpu_ddp'",
    ),
    "missing CUDA devices (mgpu_dp)": Case(
        _missing_cuda(MGPUDPStrategy), ConfigurationError, None, r"has 0 CUDA device\(s\).*accelerator='cpu'",
    ),
    "missing CUDA devices (mgpu_ddp)": Case(
        _missing_cuda(MGPUDDPStrategy), ConfigurationError, None, r"mgpu_ddp was asked.*accelerator='cpu'",
    ),
    "a replica that raises": Case(
        lambda: _fit_dp(_model(training_step=_raise_in_replica)), KeyError, None,
        r"feature 'age' missing[\s\S]*raised in replica 1 of 2 on cpu",
    ),
    "NaN loss": Case(
        lambda: _fit_dp(_NaNLoss()), None, UserWarning,
        r"training loss is nan at step 0; replica\(s\) 1.*gradient_clip_val",
    ),
    "torchmetrics Metric logged in a replica": Case(
        lambda: _fit_dp(_MetricInReplica()),
        TypeError, None, r"inside replica \d.*Update and log the metric in the matching \*_step_end",
    ),
    "non-scalar logged in a replica": Case(
        lambda: _fit_dp(_model(training_step=lambda self, batch, i: (self.log("x", batch[0]), batch[0].sum())[1])),
        ValueError, None, r"tensor of shape \(2, 4\) in replica \d.*log a scalar",
    ),
    "manual_backward in a replica": Case(
        lambda: _fit_dp(
            _model(
                __init__=lambda self: (Regressor.__init__(self), setattr(self, "automatic_optimization", False))[0],
                training_step=lambda self, batch, i: self.manual_backward(Regressor.training_step(self, batch, i)),
            )
        ),
        RuntimeError, None, r"manual_backward\(\) was called inside a replica.*training_step_end",
    ),
    "StopIteration in a replica": Case(
        lambda: _fit_dp(_model(training_step=lambda self, batch, i: next(iter(nn.Identity().parameters())))),
        RuntimeError, None, r"StopIteration was raised inside replica 0 on cpu.*next\(\)",
    ),
    "dataloader_iter step under mgpu_dp": Case(
        lambda: _fit_dp(_model(training_step=lambda self, dataloader_iter: next(dataloader_iter)[0][0].sum())),
        ConfigurationError, None, r"takes a dataloader iterator.*\(self, batch, batch_idx\)",
    ),
    "strategy used before a Trainer set it up": Case(
        lambda: MGPUDPStrategy().root_device, ConfigurationError, None, r"no devices yet; pass it to a Trainer",
    ),
    "register_parameters over an existing name": Case(
        lambda: _register_twice(), ConfigurationError, None, r"already has an attribute 'H_0'; choose another prefix",
    ),
    "to_device_of a module without tensors": Case(
        lambda: to_device_of(torch.ones(1), nn.ReLU()), ConfigurationError, None,
        r"holds no parameter.*to_device_of\(obj, x\)",
    ),
}  # fmt: skip

# Multi-process cases, each tested in tests/test_ddp.py (they start real processes):
MULTI_PROCESS_CASES = {
    "unused parameters under DDP": "test_unused_parameters_are_named_with_the_fix",
    "a rank that raises (rank 0 or 1)": "test_a_failing_rank_ends_every_process_quickly",
    "a rank that exits without raising": "test_a_rank_that_exits_ends_every_process_quickly",
}


def test_the_table_covers_at_least_25_cases() -> None:
    assert len(CASES) + len(MULTI_PROCESS_CASES) >= 25


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_fails_with_cause_and_fix(name: str) -> None:
    case = CASES[name]
    if case.raises is not None:
        with pytest.raises(case.raises) as caught:
            case.provoke()
        text = str(caught.value) + "\n" + "\n".join(getattr(caught.value, "__notes__", []))
        assert re.search(case.pattern, text, re.DOTALL), text
    else:
        assert case.warns is not None
        with pytest.warns(case.warns) as recorded:
            case.provoke()
        messages = [str(warning.message) for warning in recorded]
        assert any(re.search(case.pattern, message, re.DOTALL) for message in messages), messages


def test_multi_process_cases_exist() -> None:
    import test_ddp

    for test_name in MULTI_PROCESS_CASES.values():
        assert callable(getattr(test_ddp, test_name)), test_name
