"""Errors raised by lightning_mgpu, each naming what went wrong and how to fix it, with its facts as attributes.

Also the ``Finding`` that the model checks, the doctor and ``ModelCheckError`` report: one problem, named once here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Finding:
    """One problem found in a model.

    Attributes:
        level: ``"error"`` stops the run; ``"warning"`` is reported and the run goes on.
        check: a short stable name for the kind of problem (``"plain-container"``, ``"unregistered-tensor"``, ...).
        where: the attribute path, for example ``"encoder.heads"``.
        message: what is wrong and how to fix it.
    """

    level: Literal["error", "warning"]
    check: str
    where: str
    message: str


class BatchSplitError(ValueError):
    """The batch cannot be split into one chunk per replica.

    Attributes:
        path: where in the batch the split fails, as a key path (``"batch['x']"``, ``"batch[1]"``; ``"batch"`` for
            the batch as a whole).
    """

    def __init__(self, message: str, path: str = "batch") -> None:
        super().__init__(message)
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.path), self.__dict__


class GatherError(TypeError):
    """The replicas returned outputs that cannot be gathered into one output.

    Attributes:
        path: the key path of the output that cannot be gathered (``"output['logits']"``; ``"output"`` for the whole).
        replica: the replica whose output differs from replica 0's or cannot be merged; ``None`` where no one replica
            is to blame (the replicas' lengths or shapes disagree).
    """

    def __init__(self, message: str, path: str = "output", replica: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.replica = replica

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.path, self.replica), self.__dict__


class ReplicaStateError(RuntimeError):
    """State that a step changed inside the replicas cannot be put back into the module as one device would have it.

    Replicas are threads, each with its own copy of what a step may change (torchmetrics metrics, plain Python lists,
    dicts and sets); after the step the copies go back into the module in batch order where that is exact, and this
    error stops the run where it is not.

    Attributes:
        path: the attribute path of the state, as written in the step (``"self.val_outputs"``,
            ``"self.metrics['acc']"``).
        step: the method the replicas ran (``"training_step"``, ``"forward"``).
        buffer: whether the state is a buffer of the module's (``register_buffer``).
    """

    def __init__(self, message: str, path: str, step: str, *, buffer: bool = False) -> None:
        super().__init__(message)
        self.path = path
        self.step = step
        self.buffer = buffer

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.path, self.step), self.__dict__


class ConfigurationError(ValueError):
    """A strategy was configured in a way that cannot work.

    Attributes:
        setting: the argument, attribute or hook to change, as ``"Owner.name"``, so that code can tell the errors
            apart without reading the message: ``name`` spelt as it is written in code, ``Owner`` the class it is
            passed to (``"Trainer.devices"``, ``"MGPUDDPStrategy.model_averaging_period"``,
            ``"MGPUDataParallel.dim"``, ``"DataLoader.sampler"``), ``LightningModule`` for the model's own attributes
            and hooks (``"LightningModule.training_step"``), or the function it is passed to
            (``"allow_plain_tensors.names"``, ``"torch.compile.fullgraph"``). It is the setting whose value the
            message refuses; where the message refuses a combination, the one its first fix changes; where the
            processes a launcher started disagree with the Trainer, the Trainer's (``num_nodes`` where only the
            nodes disagree, else ``devices``). ``None`` where the error names no setting.
    """

    def __init__(self, message: str, setting: str | None = None) -> None:
        super().__init__(message)
        self.setting = setting

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.setting), self.__dict__


class ModelCheckError(ValueError):
    """The model has a multi-GPU trap that would make training wrong; the message lists each one with its fix.

    Attributes:
        findings: the error-level findings the message lists, in its order, each with its check and attribute path.
    """

    def __init__(self, message: str, findings: Sequence[Finding] = ()) -> None:
        super().__init__(message)
        self.findings = list(findings)

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (str(self), self.findings), self.__dict__


class EpochRestartWarning(UserWarning):
    """A mid-epoch checkpoint resumes by restarting its epoch, as Lightning does; the message says why, and the fix.

    Attributes:
        loader: the class name of the training DataLoader.
        cause: why the epoch's order cannot be continued: why ``loader`` is not re-created around a
            ``ResumableSampler``, or that the checkpoint holds nothing that tells the order.
    """

    def __init__(self, message: str, loader: str, cause: str) -> None:
        super().__init__(message)
        self.loader = loader
        self.cause = cause
