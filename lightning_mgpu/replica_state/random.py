"""Random numbers inside replicas: a generator of each replica's own, seeded from the step.

On the CPU every replica thread would draw from torch's one default generator (on a GPU, every replica on that GPU
from its generator), in whatever order the threads ran, so a seeded run with dropout would differ run after run.
Instead each replica draws from a generator of its own, seeded from the default generator's state at the step and
the replica's index: the same run after run, and after an exact resume, which restores that state. A step whose
replicas drew advances the default generator by one draw, so the next step's numbers differ.

Torch functions that take a ``generator`` get the replica's; dropout, which takes none, is computed as torch computes
it on the CPU (a Bernoulli mask scaled by ``1 / (1 - p)``) from the replica's generator. Anything else that draws
from the default generator (an operation that takes no generator, such as the dropout inside
``scaled_dot_product_attention``) is found after the step by the default generator's change, and warned about once.
"""

from __future__ import annotations

import hashlib
import threading
import warnings
from typing import Any

import torch
from torch.nn import functional as F

_TAKE_A_GENERATOR = frozenset(
    {
        "rand",
        "randn",
        "randint",
        "randperm",
        "rand_like",
        "randn_like",
        "randint_like",
        "bernoulli",
        "bernoulli_",
        "multinomial",
        "normal",
        "normal_",
        "poisson",
        "uniform_",
        "random_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
    }
)
"""Names of torch functions and tensor methods that draw random numbers and take ``generator=``."""

_DROPOUT = (F.dropout, torch.dropout, torch.dropout_)


_LIKE = {"rand_like": "uniform_", "randn_like": "normal_"}
"""``*_like`` functions that older torch releases give no ``generator``: drawn as the tensor method named here."""


def draws(func: Any) -> bool:
    """Whether ``func`` is a call this module gives a replica's own generator."""
    if func in _DROPOUT:
        return True
    name = getattr(func, "__name__", "")
    return name in _TAKE_A_GENERATOR and (_takes_generator(func) or name in _LIKE)


_ACCEPTS: dict[Any, bool] = {}


def _takes_generator(func: Any) -> bool:
    """Whether this torch's ``func`` takes ``generator=`` (``rand_like`` gained it in later releases)."""
    known = _ACCEPTS.get(func)
    if known is None:
        known = _ACCEPTS[func] = "generator" in (getattr(func, "__doc__", None) or "")
    return known


class StepSeed:
    """The seed of one step's replica generators: the default generator's state before the step, hashed when needed.

    Args:
        state: ``torch.random.get_rng_state()`` in the calling thread, before the replicas run.
    """

    def __init__(self, state: torch.Tensor) -> None:
        self.state = state
        self._lock = threading.Lock()
        self._digest: bytes | None = None
        self.drew = False

    def seed(self, index: int, device: torch.device) -> int:
        """Replica ``index``'s seed on ``device``; the same for the same state, whatever thread asks first."""
        with self._lock:
            if self._digest is None:
                self._digest = hashlib.blake2b(self.state.numpy().tobytes(), digest_size=16).digest()
            self.drew = True
            digest = self._digest
        mixed = hashlib.blake2b(digest + f"{index}:{device}".encode(), digest_size=8).digest()
        return int.from_bytes(mixed, "little") & ((1 << 63) - 1)


class ReplicaRandom:
    """One replica's generators for one call, one per device it draws on, seeded from ``StepSeed`` when first used."""

    def __init__(self, index: int, seed: StepSeed, generators: dict[torch.device, torch.Generator]) -> None:
        self._index = index
        self._seed = seed
        self._generators = generators
        self._seeded: set[torch.device] = set()

    def call(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Call ``func`` drawing from this replica's generator."""
        if func in _DROPOUT:
            return self._dropout(func, args, kwargs)
        if kwargs.get("generator") is not None:
            return func(*args, **kwargs)
        generator = self._generator(_device_of(args, kwargs))
        if not _takes_generator(func):  # rand_like, randn_like before torch took a generator there
            options = dict(kwargs)
            requires_grad = options.pop("requires_grad", False)
            tensor = getattr(torch.empty_like(*args, **options), _LIKE[func.__name__])(generator=generator)
            return tensor.requires_grad_(requires_grad)
        return func(*args, **kwargs, generator=generator)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device)
        if device not in self._seeded:
            generator.manual_seed(self._seed.seed(self._index, device))
            self._seeded.add(device)
        return generator

    def _dropout(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        names: tuple[str, ...]
        if func is F.dropout:
            names = ("input", "p", "training", "inplace")
            defaults: dict[str, Any] = {"p": 0.5, "training": True, "inplace": False}
        else:
            names = ("input", "p", "train")
            defaults = {}
        bound = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
        tensor, p = bound["input"], bound["p"]
        training = bound.get("training", bound.get("train"))
        inplace = bound.get("inplace", func is torch.dropout_)
        if not training or not 0 < p < 1 or tensor.numel() == 0:
            return func(*args, **kwargs)  # no random number drawn, or torch's own error for a p out of range
        noise = torch.empty_like(tensor, memory_format=torch.preserve_format)
        noise.bernoulli_(1 - p, generator=self._generator(tensor.device)).div_(1 - p)
        return tensor.mul_(noise) if inplace else tensor * noise


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    """Where a random function's result lands: ``device=``, else its first tensor's device, else the default one."""
    device = kwargs.get("device")
    if device is not None:
        return torch.device(device)
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
    return torch.get_default_device()


class DefaultGenerator:
    """The default CPU generator around each call: what seeds the replicas' generators, and who else drew from it."""

    def __init__(self) -> None:
        self._warned = False

    def begin(self) -> StepSeed:
        """The seed of a call about to start, from the default generator's state now."""
        return StepSeed(torch.random.get_rng_state())

    def settle(self, seed: StepSeed) -> None:
        """Warn once if the replicas drew from the default generator; advance it if they drew from their own."""
        if not self._warned and not torch.equal(seed.state, torch.random.get_rng_state()):
            self._warned = True
            warnings.warn(
                "Random numbers were drawn inside the replicas from torch's default generator, which every replica"
                " on the CPU shares, by an operation that takes no generator (such as the dropout of"
                " scaled_dot_product_attention or nn.MultiheadAttention, or a random function of another library),"
                " so they were drawn in whatever order the replica threads ran, and a seeded run differs from run to"
                " run. torch's random functions and dropout (nn.Dropout, F.dropout) draw from a generator of each"
                " replica's own; compute the rest with them (nn.Dropout on the attention weights instead of"
                " dropout_p) where the run must repeat exactly.",
                UserWarning,
                stacklevel=2,
            )
        if seed.drew:
            torch.empty((), dtype=torch.int64, device="cpu").random_()
