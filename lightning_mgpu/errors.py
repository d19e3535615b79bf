"""Errors raised by lightning_mgpu, each naming what went wrong and how to fix it."""


class BatchSplitError(ValueError):
    """The batch cannot be split into one chunk per replica."""


class GatherError(TypeError):
    """The replicas returned outputs that cannot be gathered into one output."""


class ConfigurationError(ValueError):
    """A strategy was configured in a way that cannot work."""


class ModelCheckError(ValueError):
    """The model has a multi-GPU trap that would make training wrong; the message lists each one with its fix."""
