"""Where a Triton kernel can run, decided without touching the GPU at import time.

Triton's ``@triton.jit`` reads ``TRITON_INTERPRET`` when a kernel is *decorated*, i.e. when the module that
defines it is imported. ``INTERPRETED`` is read when this module is first imported, which happens together
with the kernels on the first use of an llm-speed op (``import llm_speed`` itself loads neither): set the
variable before using any op, and the answer here matches what the kernels really are.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Callable
from typing import Any

import torch

INTERPRETED: bool = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

launch_counter: collections.Counter[str] = collections.Counter()


if INTERPRETED:  # a fix and four launch costs of Triton's interpreter (llm_speed.core.interpreter_patches)
    from llm_speed.core import interpreter_patches

    interpreter_patches.apply()
else:  # compiled kernels: cache keys that do not depend on the order they were hashed in (core.cache_keys)
    from llm_speed.core import cache_keys

    cache_keys.hash_callees_first()


# Set by llm_speed.core.launch.simulated_gpu(): CPU tensors then take the code path of CUDA ones (the compiled
# kernels' configurations and switches, the direct launch), with compiling and launching replaced by no-ops.
SIMULATED_GPU: bool = False


def triton_runs_on(device: torch.device) -> bool:
    """True when a Triton kernel can run on tensors of ``device``.

    CUDA tensors always run compiled kernels (or interpreted ones under ``TRITON_INTERPRET=1``);
    CPU tensors run Triton kernels only through the interpreter (or, launches stubbed, under
    :func:`llm_speed.core.launch.simulated_gpu`).
    """
    if device.type == "cuda":
        return True
    return (INTERPRETED or SIMULATED_GPU) and device.type == "cpu"


# --- checks that read tensor values ----------------------------------------------------------------------

# LLM_SPEED_CHECK_INPUTS: "1" checks the values of index tensors (cu_seqlens, cache_seqlens, block tables,
# targets) on the host before any work, for every device; "0" never does; unset: CPU tensors only, whose
# values cost nothing to read. A CUDA tensor read on the host waits for the GPU and makes the call impossible
# to capture in a CUDA graph; the kernels instead turn the rows an invalid entry touches into NaN.
_CHECK_SETTING = os.environ.get("LLM_SPEED_CHECK_INPUTS", "").strip()
if _CHECK_SETTING not in ("", "0", "1"):
    raise ValueError(
        f"LLM_SPEED_CHECK_INPUTS={_CHECK_SETTING!r}; accepted: 1 (always check the values of index tensors "
        "on the host), 0 (never), or unset (CPU tensors only)"
    )
CHECK_INPUTS: bool | None = {"1": True, "0": False}.get(_CHECK_SETTING)
_is_compiling = torch.compiler.is_compiling


def check_values(device: torch.device) -> bool:
    """Whether an op reads index tensors on ``device`` to check their values before any work (see
    ``CHECK_INPUTS``). Never while torch.compile traces the call: a host read there would end the graph
    (``fullgraph=True`` fails), so a compiled call is unchecked as a CUDA one is, invalid entries giving NaN
    rows; checks inside an op's own body (opaque to the compiler) still run."""
    if _is_compiling():
        return False
    if CHECK_INPUTS is not None:
        return CHECK_INPUTS
    return device.type == "cpu" and not SIMULATED_GPU  # simulated: CPU tensors stand for CUDA ones


def check_finite(name: str, t: torch.Tensor, why: str = "") -> None:
    """ValueError naming ``name`` and its first non-finite element unless every element of ``t`` is finite
    (``why``: what a non-finite one would break). A host read: call it only where :func:`check_values`."""
    flat = t.reshape(-1)
    bad = ~torch.isfinite(flat)
    if bool(bad.any()):
        raise ValueError(f"{name} must be finite{why}, got {flat[bad][0].item()}")


def on_device_of(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Triton launches on the *current* CUDA device: make it ``tensor``'s for the launch (a tensor on cuda:1
    while cuda:0 is current would otherwise be read by a kernel on the wrong GPU). No-op off CUDA."""
    if tensor.device.type == "cuda":
        return torch.cuda.device(tensor.device)
    return contextlib.nullcontext()


def record_launch(kernel_name: str) -> None:
    """Count one launch of ``kernel_name``; tests use the count to prove which implementation ran."""
    launch_counter[kernel_name] += 1


def launch_count(kernel_name: str) -> int:
    """How many times ``kernel_name`` was launched in this process."""
    return launch_counter[kernel_name]


def launch_counts() -> collections.Counter[str]:
    """A copy of every kernel's launch count; subtract two copies to see what ran in between."""
    return collections.Counter(launch_counter)


# Who wants to hear about the work each op is asked to do (the profiler registers one, see
# llm_speed.profiler); ops call report_work once per call, which costs a loop over an empty list when nobody
# listens.
_work_observers: list[Callable[[str, dict[str, Any]], None]] = []


def add_work_observer(observer: Callable[[str, dict[str, Any]], None]) -> None:
    """Call ``observer(op, problem)`` for every :func:`report_work` from now on (added once at most)."""
    if observer not in _work_observers:
        _work_observers.append(observer)


def observed() -> bool:
    """Whether anyone listens to :func:`report_work` (an op may skip building what only a report needs)."""
    return bool(_work_observers)


def report_work(op: str, **problem: Any) -> None:
    """Tell the observers that the op ``op`` (a row name of :mod:`llm_speed.ops`, e.g. "flash_attention",
    "gemm") runs on ``problem`` (its tensors and flags, as the row's cost function reads them), so a profiler
    can count FLOPs and bytes. Every path of an op (Triton or plain PyTorch) calls it once per call.

    Skipped while ``torch.compile`` traces (a constant there, so the graph holds no report and no break):
    compiled code is opaque to the profiler, apart from the ops registered with ``torch.library``, whose
    bodies run (and report) eagerly."""
    if not _work_observers or _is_compiling():
        return
    for observer in _work_observers:
        observer(op, problem)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device to run on: the given one, else the current CUDA device when there is one, else the CPU.

    ``cuda`` without an index is pinned to the current CUDA device (what Triton launches on). Asking for
    CUDA where none is visible raises ValueError naming the device argument.
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            # A library caller's words; the command line's main turns device='cpu' into "--device cpu".
            raise ValueError("device: cuda was requested but no CUDA device is visible; use device='cpu'")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device
