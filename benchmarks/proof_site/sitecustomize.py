"""Counts Triton's compiles in every Python process of a ``run_gpu_suite.sh proof`` run (this folder joins
PYTHONPATH there, so Python imports this file at start in each process, pytest workers included).

With LLM_SPEED_COMPILE_LOG=<file>, Triton's compilation listener (``triton.knobs.compilation.listener``,
Triton >= 3.4) appends one JSON line per kernel Triton builds or loads from its file cache: the kernel's name,
its cache key (``metadata["hash"]``), whether the cache served it, and the compiler's own microseconds.
Kernels served from the in-memory cache of a process never reach the listener. Without the variable,
nothing is imported.
"""

import os

_LOG = os.environ.get("LLM_SPEED_COMPILE_LOG")


def _listen(path: str) -> None:
    import json

    try:
        from triton import knobs
    except ImportError:  # no Triton, or one older than the listener: the summary says no compile was seen
        return

    def listener(*, src, metadata, metadata_group, times, cache_hit):
        line = json.dumps({
            "kernel": getattr(src, "name", "?"),
            "hash": metadata.get("hash"),
            "cache_hit": bool(cache_hit),
            "compile_us": int(times.total),
            "pid": os.getpid(),
        })  # fmt: skip
        with open(path, "a") as log:  # one short line per write: appends from many processes stay whole
            log.write(line + "\n")

    knobs.compilation.listener = listener


if _LOG:
    _listen(_LOG)
