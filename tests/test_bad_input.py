"""Bad input that no other test provokes: each row fails early with the cause and the fix, or warns.

One row per case: how to provoke it, what must be raised or warned, and a pattern that the message must match
(naming the cause and the fix). A case that another test already provokes and asserts is not repeated here; that test
asserts the message, or the error's attributes where a third test checks the wording of the same message.
``COVERED_ELSEWHERE`` says where each of those is, and a test checks by parsing those files (without importing them)
that the named tests still exist. Some rows stay although their error's facts are asserted elsewhere: those other
tests assert the error's attributes, and the row is the one check of the message's wording.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from models import Regressor, loader, regression_data, trainer

from lightning_mgpu import BatchSplitError, ConfigurationError, GatherError, MGPUDPStrategy
from lightning_mgpu.engine import scatter


@dataclass
class Case:
    provoke: Callable[[], Any]
    raises: type[BaseException] | None
    warns: type[Warning] | None
    pattern: str


def _fit_dp(model: L.LightningModule) -> None:
    trainer(devices=2, strategy="mgpu_dp", max_steps=2).fit(model, loader(regression_data(rows=8), 4))


def _model(**steps: Callable[..., Any]) -> L.LightningModule:
    return type("Custom", (Regressor,), steps)()


def _returns(value: Callable[[Any, Any], Any]) -> L.LightningModule:
    def training_step(self: Any, batch: Any, batch_idx: int) -> Any:
        return value(self, batch)

    def training_step_end(self: Any, output: Any) -> torch.Tensor:
        return self(torch.zeros(1, 4)).sum()

    return _model(training_step=training_step, training_step_end=training_step_end)


class _NaNLoss(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.replica_index == 1 else loss


class _Empty(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


def _fit_empty() -> None:
    trainer(devices=2, strategy="mgpu_dp", max_steps=2).fit(Regressor(), torch.utils.data.DataLoader(_Empty()))


CASES: dict[str, Case] = {
    # Path and replica asserted in tests/test_gather.py::test_replicas_with_different_keys_are_refused.
    "different keys per replica": Case(
        lambda: _fit_dp(_returns(lambda self, batch: {f"k{self.replica_index}": batch[0]})), GatherError, None,
        r"replica 1 has keys \['k1'\] but replica 0 returned \['k0'\].*same keys",
    ),
    "scalar in one replica, vector in another": Case(
        lambda: _fit_dp(_returns(lambda self, batch: batch[0][:, 0] if self.replica_index else batch[0].sum())),
        GatherError, None, r"0-dim in some replicas and not in others.*same shape",
    ),
    # Path and replica asserted in tests/test_gather.py::test_mixed_none_and_tensor_is_refused.
    "None in one replica only": Case(
        lambda: _fit_dp(_returns(lambda self, batch: None if self.replica_index else batch[0])), GatherError, None,
        r"Tensor .* in replica 0 but a NoneType .* in replica 1.*same structure",
    ),
    # Path asserted in tests/test_scatter.py::test_a_0_dim_tensor_in_the_batch_is_refused.
    "0-dim tensor in the batch": Case(
        lambda: scatter((torch.zeros(4), torch.tensor(2.0)), [torch.device("cpu")] * 2), BatchSplitError, None,
        r"batch\[1\] is a 0-dim tensor.*leading batch dimension",
    ),
    # Path asserted in tests/test_scatter.py::test_an_empty_batch_is_refused.
    "empty batch": Case(
        lambda: scatter(torch.zeros(0, 4), [torch.device("cpu")] * 2), BatchSplitError, None,
        r"batch is empty.*Drop empty batches",
    ),
    "empty dataloader": Case(_fit_empty, None, UserWarning, r"length of .*DataLoader.* is zero|no .*batches"),
    # tests/test_lightning1x.py asserts the warning with one device; here it names the replica and the fix.
    "NaN loss": Case(
        lambda: _fit_dp(_NaNLoss()), None, UserWarning,
        r"training loss is nan at step 0; replica\(s\) 1.*gradient_clip_val",
    ),
    "non-scalar logged in a replica": Case(
        lambda: _fit_dp(_model(training_step=lambda self, batch, i: (self.log("x", batch[0]), batch[0].sum())[1])),
        ValueError, None, r"the tensor must have a single element.*raised in replica \d",
    ),
    "dataloader_iter step under mgpu_dp": Case(
        lambda: _fit_dp(_model(training_step=lambda self, dataloader_iter: next(dataloader_iter)[0][0].sum())),
        ConfigurationError, None, r"takes a dataloader iterator.*\(self, batch, batch_idx\)",
    ),
    "strategy used before a Trainer set it up": Case(
        lambda: MGPUDPStrategy().root_device, ConfigurationError, None, r"no devices yet; pass it to a Trainer",
    ),
}  # fmt: skip

# The other bad-input cases: where each is provoked and asserted ("file::test").
COVERED_ELSEWHERE = {
    "string output": "tests/test_gather.py::test_a_string_leaf_names_the_key_path_replica_and_fix",
    "object output (the same check as a string)": (
        "tests/test_gather.py::test_a_string_leaf_names_the_key_path_replica_and_fix"
    ),
    "shapes differ beyond dim 0": "tests/test_gather.py::test_shapes_that_differ_beyond_dim_0_are_refused",
    "batch tensors of different lengths": "tests/test_scatter.py::test_tensors_that_disagree_on_dim_0_name_each_path",
    "batch without tensors": "tests/test_scatter.py::test_a_batch_without_tensors_is_refused",
    "batch smaller than the device count": "tests/test_cli.py::test_the_idle_devices_warning_gets_a_line_of_its_own",
    "parameters in a plain list": "tests/test_mixin.py::test_parameters_and_modules_in_plain_containers_stop_fit",
    "modules in a plain dict": "tests/test_model_checks.py::test_the_users_plain_containers_and_tensors_are_found",
    "unregistered tensor attribute": "tests/test_mixin.py::test_unregistered_tensor_attributes_warn_with_the_fix",
    "num_nodes > 1 with mgpu_dp": "tests/test_dp.py::test_num_nodes_above_one_is_refused_early",
    "missing CUDA devices (mgpu_dp)": "tests/test_dp.py::test_more_cuda_devices_than_the_machine_has_are_refused",
    "missing CUDA devices (mgpu_ddp)": (
        "tests/test_ddp.py::test_cuda_devices_the_machine_lacks_fail_before_any_process_starts"
    ),
    "a replica that raises": (
        "tests/test_torch_data_parallel.py::test_a_replicas_exception_reaches_the_caller_with_its_replica"
    ),
    "a value of a replica's rows given to a torchmetrics metric that cannot be merged": (
        "tests/test_replica_state.py::test_a_value_of_the_replicas_rows_given_to_a_metric_that_cannot_be_merged_stops_the_first_step"
    ),
    "compute() or reset() of a metric in a replica": (
        "tests/test_replica_state.py::test_compute_or_reset_inside_a_replica_is_refused_with_the_fix"
    ),
    "a count of a replica's rows appended to a list": (
        "tests/test_replica_state.py::test_appending_a_count_of_the_replicas_rows_to_a_list_is_refused_naming_the_list"
    ),
    "a count of a replica's rows assigned to an attribute": (
        "tests/test_dp.py::test_an_attribute_assigned_a_count_of_the_replicas_rows_stops_the_step_with_the_module_unchanged"
    ),
    "a parameter changed in place from a replica's rows, by one replica, or through a view": (
        "tests/test_replica_guard.py::test_a_parameter_changed_otherwise_stops_the_first_step_with_the_module_unchanged"
    ),
    "a step stored on the module as a closure that calls the module itself": (
        "tests/test_replica_state.py::test_a_stored_step_that_calls_the_module_itself_is_refused_before_the_first_step"
    ),
    "a dict key set from each replica's rows or a plain tensor changed in place in a replica": (
        "tests/test_replica_state.py::test_a_dict_key_set_from_each_replicas_rows_or_a_plain_tensor_changed_in_place_is_refused"
    ),
    "an integer 0-dim output without *_step_end": (
        "tests/test_lightning1x.py::test_an_integer_output_without_step_end_is_refused_naming_it"
    ),
    "manual_backward in a replica": "tests/test_dp.py::test_manual_backward_inside_a_replica_is_refused_with_the_fix",
    "StopIteration in a replica": "tests/test_dp.py::test_stop_iteration_in_a_step_stops_training_with_an_error",
    "register_parameters over an existing name": (
        "tests/test_mixin.py::test_register_parameters_follows_the_users_pattern"
    ),
    "to_device_of a module without tensors": (
        "tests/test_mixin.py::test_to_device_of_moves_nested_data_to_the_related_device"
    ),
    "unused parameters under DDP": "tests/test_ddp.py::test_unused_parameters_are_named_with_the_fix",
    "a rank that raises (rank 0 or 1)": "tests/test_ddp.py::test_a_failing_rank_ends_every_process_quickly",
    "a rank that exits without raising": "tests/test_ddp.py::test_a_rank_that_exits_ends_every_process_quickly",
}


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


def test_the_cases_covered_elsewhere_name_tests_that_exist() -> None:
    root = Path(__file__).resolve().parents[1]
    for case, where in COVERED_ELSEWHERE.items():
        path, test_name = where.split("::")
        tree = ast.parse((root / path).read_text())
        defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
        assert test_name in defined, f"{case}: {where} is gone"
