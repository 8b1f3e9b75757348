"""Deferred `@triton.jit`: kernels are defined at import time but compiled on first launch.

Why not decorate with `triton.jit` directly:
- triton is an optional extra; the torch references living in the same files must import without it;
- importing triton costs time the CPU path and the router never need;
- `triton.jit` reads TRITON_INTERPRET when it decorates, so a module imported before a test's
  conftest sets the variable would be stuck in compiled mode. Deferring the decoration to the first
  launch reads the variable when it matters.

Usage in a kernel module (annotations stay strings under `from __future__ import annotations`,
which triton normalises, so `tl` is only needed once the kernel is compiled):

    if TYPE_CHECKING:
        import triton.language as tl

    @lazy_jit
    def _my_kernel(x_ptr, N: tl.constexpr): ...

    _my_kernel[grid](x, N=n)     # first launch: imports triton, binds `tl`, jits the whole module

On the first launch every `LazyJit` in the kernel's module is replaced, in the module's globals, by
its jitted function, so kernels can call `@lazy_jit` helpers like ordinary `@triton.jit` ones.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_lock = threading.RLock()  # guards the one-shot rebinding of module globals (re-entered for helpers)


class LazyJit:
    """A kernel (or device helper) that becomes `triton.jit(fn, **jit_kwargs)` on first use."""

    def __init__(self, fn: Callable[..., Any], jit_kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.jit_kwargs = jit_kwargs
        self._jitted: Any = None
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def jitted(self) -> Any:
        if self._jitted is None:
            _materialize(self.fn.__globals__)
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable[..., Any] | None = None, **jit_kwargs: Any) -> Any:
    """`@lazy_jit` or `@lazy_jit(do_not_specialize=[...])`, same keywords as `triton.jit`."""
    if fn is None:
        return lambda f: LazyJit(f, jit_kwargs)
    return LazyJit(fn, jit_kwargs)


def _materialize(module_globals: dict[str, Any]) -> None:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        raise ImportError("the Triton kernels need triton (pip install 'pdcluster[triton]'); "
                          "the *_torch references and backend 'torch' work without it") from e

    with _lock:
        module_globals.setdefault("tl", tl)
        module_globals.setdefault("triton", triton)
        for name, obj in list(module_globals.items()):
            if isinstance(obj, LazyJit):
                if obj.fn.__globals__ is not module_globals:
                    _materialize(obj.fn.__globals__)  # a helper imported from another kernel module
                elif obj._jitted is None:
                    obj._jitted = triton.jit(obj.fn, **obj.jit_kwargs)
                module_globals[name] = obj._jitted


def is_interpreted(kernel: Any) -> bool:
    """True when `kernel` (a LazyJit or what it became) runs in Triton's CPU interpreter.

    Launchers use it to steer around interpreter-only numeric gaps (bfloat16 tl.dot operates on
    the raw bits there), never to change what a GPU runs."""
    jitted = kernel.jitted() if isinstance(kernel, LazyJit) else kernel
    return type(jitted).__name__ == "InterpretedFunction"
