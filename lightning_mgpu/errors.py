"""Errors raised by lightning_mgpu, each naming what went wrong and how to fix it, with its facts as attributes."""

from __future__ import annotations

from typing import Any


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


class ConfigurationError(ValueError):
    """A strategy was configured in a way that cannot work."""


class ModelCheckError(ValueError):
    """The model has a multi-GPU trap that would make training wrong; the message lists each one with its fix."""
