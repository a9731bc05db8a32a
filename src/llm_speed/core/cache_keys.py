"""Triton cache keys that do not depend on what a process hashed before, applied by
:mod:`llm_speed.core.runtime` when kernels are compiled (not under the interpreter).

A ``@triton.jit`` function's cache key (``JITFunction.cache_key``, the start of every compiled kernel's key
in Triton's file cache) hashes its source, the keys of the ``@triton.jit`` functions it calls, and the
``constexpr`` globals it and they read. Triton 3.6 (the GPU machine's) merges a callee's globals
(``DependenciesFinder._update_hash``) *before* asking for the callee's key, so the globals of a callee not
hashed yet are left out: a kernel's key then depends on whether another kernel hashed the same helper
earlier in the process. Measured on the H100's 127 kernels of ``llm-speed kernels`` (Triton 3.6, CPU,
2026-12-07): hashed in another order, 63 kernels got other keys, so a Triton cache built by one process
(another pytest worker, an earlier run, ``benchmarks/triton_cache.py``) missed in another wherever they
had launched kernels in other orders (with this change: none, and such a cache served all 127). Later
Triton (3.9) asks for the callee's key first; this does the
same in the Triton imported, for every kernel of the process (llm-speed's and any other), which only makes
each key the one its process would have made had it hashed the callees first. Nothing is changed where
the function is not the one written against (other parameters).
"""

from __future__ import annotations

import functools
import inspect


@functools.cache
def hash_callees_first() -> bool:
    """Make Triton hash a called ``@triton.jit`` function before merging its globals into the caller's
    (once a process); True where Triton's ``DependenciesFinder`` was patched (or already does this)."""
    try:
        from triton.runtime.jit import DependenciesFinder
    except ImportError:  # no Triton, or one without the class: nothing to change
        return False
    update = getattr(DependenciesFinder, "_update_hash", None)
    try:
        if tuple(inspect.signature(update).parameters) != ("self", "func"):
            return False
    except (TypeError, ValueError):
        return False
    if getattr(update, "_llm_speed_callees_first", False):
        return True

    @functools.wraps(update)
    def callee_first(self, func):
        func.cache_key  # noqa: B018 - computes (and keeps) the callee's key and its used_global_vals
        return update(self, func)

    callee_first._llm_speed_callees_first = True
    DependenciesFinder._update_hash = callee_first
    return True
