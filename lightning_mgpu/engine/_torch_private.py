"""The one place the engine touches private torch API, each use explained and covered by tests/test_replicate.py.

A replica must behave like the module it copies, and torch gives no public way to copy three kinds of module state:
a module's own replication hook (RNNs keep caches of their weights), the forward that ``torch.compile(module)``
binds to the module it wraps, and the call that ``module.compile()`` binds to the module itself. Nor does it say
which attributes its forward pre-hooks rewrite (``weight_norm``'s ``weight``), or cheaply whether a thread has any
torch function mode active (``parallel_apply`` asks every step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:  # torch.compile's module wrapper; absent where dynamo is not built in
    from torch._dynamo.eval_frame import OptimizedModule
except ImportError:  # pragma: no cover - every supported torch has it
    OptimizedModule = None  # type: ignore[assignment,misc]


def has_own_replication(module: nn.Module) -> bool:
    """Whether ``module``'s class overrides ``nn.Module._replicate_for_data_parallel`` (RNNs do, for their caches)."""
    return type(module)._replicate_for_data_parallel is not nn.Module._replicate_for_data_parallel


def own_replica(module: nn.Module) -> nn.Module:
    """``module``'s own DataParallel replica: a shallow copy with the class's private caches copied too.

    ``_replicate_for_data_parallel`` is the hook torch's ``replicate`` calls; only classes that override it (checked
    by ``has_own_replication``) get here, because nn.Module's own version writes through ``__setattr__``, which
    classes such as torch.compile's wrapper redirect into the module they wrap.
    """
    return module._replicate_for_data_parallel()


def is_compiled_wrapper(module: nn.Module) -> bool:
    """Whether ``module`` is the wrapper that ``torch.compile(module)`` returns."""
    return OptimizedModule is not None and isinstance(module, OptimizedModule)


def bind_compiled_wrapper(shell: nn.Module) -> None:
    """Point a replica of ``torch.compile(module)``'s wrapper at the replica of the wrapped module.

    The wrapper keeps a ``forward`` bound to the module it wrapped; ``_initialize`` is what binds it, in the wrapper's
    constructor and after unpickling, so calling it again on the replica binds the replica's own copy.
    """
    shell._initialize()  # type: ignore[operator]


def compiled_call(module: nn.Module) -> Callable[..., Any] | None:
    """The compiled call that ``module.compile()`` installed, or ``None`` for a module compiled in no such way."""
    return module.__dict__.get("_compiled_call_impl")


def recompile_call(compiled: Callable[..., Any], shell: nn.Module) -> Callable[..., Any] | None:
    """``compiled`` (from ``module.compile(...)``) applied to ``shell`` with the same compiler settings.

    ``torch.compile(fn, ...)`` returns a wrapper whose closure holds the compile context (backend, mode, options)
    as ``self``; applying that context to the replica's own ``_call_impl`` is what ``shell.compile(...)`` with the
    original arguments would do. Returns ``None`` when the context cannot be found (a torch that builds the wrapper
    differently), so the caller can fall back to running the replica uncompiled.
    """
    code = getattr(compiled, "__code__", None)
    closure = getattr(compiled, "__closure__", None)
    if code is None or closure is None or "self" not in code.co_freevars:
        return None
    context = closure[code.co_freevars.index("self")].cell_contents
    if not callable(context):
        return None
    rebound = context(shell._call_impl)
    return rebound if callable(rebound) else None


def names_rewritten_by_hooks(module: nn.Module, owned: Callable[[type], bool]) -> set[str]:
    """Attributes that forward pre-hooks of classes accepted by ``owned`` rewrite before every forward.

    ``weight_norm``, ``spectral_norm`` and ``torch.nn.utils.prune`` replace a parameter by a plain tensor attribute
    that their hook object recomputes from registered state; the hook object names that attribute in one of its
    string fields (``name``, ``_tensor_name``). The hooks live in the private ``_forward_pre_hooks``.
    """
    names: set[str] = set()
    for hook in module._forward_pre_hooks.values():
        owner = getattr(hook, "__self__", hook)
        if owned(type(owner)) and hasattr(owner, "__dict__"):
            names.update(value for value in vars(owner).values() if isinstance(value, str))
    return names


def is_torch_class(cls: type) -> bool:
    """Whether ``cls`` is defined by torch itself."""
    return str(getattr(cls, "__module__", "")).partition(".")[0] == "torch"


_len_torch_function_stack: Callable[[], int] | None = getattr(torch._C, "_len_torch_function_stack", None)


def function_mode_depth() -> int | None:
    """How many torch function modes are active on this thread, or ``None`` where torch does not say."""
    return None if _len_torch_function_stack is None else _len_torch_function_stack()
