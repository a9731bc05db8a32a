"""Launching a Triton kernel at the cost of a lookup.

``kernel[grid](**arguments)`` makes Triton bind every argument to the kernel's signature, work out each one's
specialisation (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), build a cache key from them
and the options, look the compiled kernel up, and build launch metadata for its hooks: 13-30 us of host time
per launch before the kernel is queued (measured on a CPU with compiling and launching stubbed,
``docs/notes/launch-path.md``). Here the work is done once per problem class, in a :class:`Plan`::

    plan = KERNEL.plan(grid, num_warps=4, num_stages=2, **arguments_fixed_for_the_class)
    plan.launch(**per_call_arguments)   # the tensors, and float scalars such as a scale

An op keeps its plans in a cache keyed on what fixes them (shapes, strides, dtypes, flags, device:
:func:`plan_cache`), so a call costs one lookup. A plan's first launch goes through Triton's own path, which
compiles the kernel (or, under the interpreter, runs it); later launches hand the arguments straight to the
compiled kernel in its parameter order, as Triton's ``JITFunction.run`` does (``tests/test_launch.py`` checks
this against the installed Triton and the GPU machine's 3.6). Triton's own path still serves a launch whose
per-call tensor is not 16-byte aligned where the first one was (the compiled kernel assumed it), one made
while another CUDA device is current, and one made while a launch hook (Triton's profiler) is installed.

Plans hold no tensors; per-call arguments are tensors (whose dtypes the plan's key fixes) and floats (never
specialised by Triton). Host arithmetic here is plain Python (:func:`cdiv`, :func:`next_power_of_2`):
``triton.cdiv`` costs 1.9 us a call against 0.03 us for the same arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import runtime

# Plans an op keeps per cache (least recently used dropped): a training run sees a few shapes per op, a server
# one per batch size and sequence bucket; a plan holds no tensor, only its arguments and a compiled kernel.
PLAN_CACHE_SIZE = 1024

_plan_caches: list[Any] = []


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, b > 0."""
    return -(a // -b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def plan_cache(function: Callable[..., Plan]) -> Callable[..., Plan]:
    """Keep the plans ``function`` makes, keyed on its (hashable) arguments; :func:`clear_plans` empties
    every such cache."""
    cached = functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(function)
    _plan_caches.append(cached)
    return cached


def clear_plans() -> None:
    """Forget every plan (the next call of each op makes its plans again)."""
    for cached in _plan_caches:
        cached.cache_clear()


class Kernel:
    """A ``@triton.jit`` function with a name (launch counts use it) and its parameter order."""

    __slots__ = ("fn", "name", "params")

    def __init__(self, fn: Any, name: str):
        self.fn = fn
        self.name = name
        # JITFunction and the interpreter's InterpretedFunction both keep the Python function as ``fn``.
        self.params = tuple(inspect.signature(fn.fn).parameters)

    def plan(self, grid: tuple[int, ...], *, num_warps: int, num_stages: int, **fixed: Any) -> Plan:
        """A launch of this kernel on ``grid`` with ``fixed`` arguments; the others are given per call."""
        unknown = sorted(set(fixed) - set(self.params))
        if unknown:
            raise TypeError(f"{self.name}: no parameter called {', '.join(unknown)}")
        for name, value in fixed.items():
            if isinstance(value, torch.Tensor):
                raise TypeError(f"{self.name}: {name} is a tensor; a plan holds none, pass it per call")
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        return Plan(self, grid, fixed, num_warps, num_stages)

    def __repr__(self) -> str:
        return f"Kernel({self.name})"


class Plan:
    """One kernel, one grid, its launch options and the arguments fixed for a problem class.

    ``launch(**per_call)`` starts it; ``per_call`` names the parameters it takes (every parameter that is not
    fixed), by keyword.
    """

    __slots__ = ("kernel", "grid", "fixed", "num_warps", "num_stages", "per_call", "launch", "direct")

    def __init__(
        self, kernel: Kernel, grid: tuple[int, int, int], fixed: dict, num_warps: int, num_stages: int
    ):
        self.kernel = kernel
        self.grid = grid
        self.fixed = fixed
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.per_call = tuple(p for p in kernel.params if p not in fixed)
        self.launch: Callable[..., None] = self._first
        self.direct = False  # whether launch() now hands arguments straight to a compiled kernel

    def _triton(self, per_call: dict) -> Any:
        """Triton's own launch (compiling on first use, or interpreting), on the per-call tensors' device."""
        launcher = self.kernel.fn[self.grid]
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        device = _cuda_device_of(per_call)
        if device is not None and device != _current_device():
            with torch.cuda.device(device):
                compiled = launcher(**self.fixed, **per_call, **options)
        else:
            compiled = launcher(**self.fixed, **per_call, **options)
        runtime.record_launch(self.kernel.name)
        return compiled

    def _first(self, **per_call: Any) -> None:
        missing = set(self.per_call) - set(per_call)
        if missing or len(per_call) != len(self.per_call):
            extra = sorted(set(per_call) - set(self.per_call))
            raise TypeError(
                f"{self.kernel.name}: per-call arguments missing {sorted(missing)}, unexpected {extra}"
            )
        for name, value in per_call.items():
            if not isinstance(value, (torch.Tensor, float)) and not hasattr(value, "base"):
                # Triton specialises ints (== 1, divisible by 16): an int that varies belongs in the plan's
                # key.
                raise TypeError(
                    f"{self.kernel.name}: per-call {name} is {type(value).__name__}; per call: tensors, "
                    "floats and tensor descriptors only"
                )
        if runtime.SIMULATED_GPU:
            self._go_direct(per_call, _Stub(), None)
            self.launch(**per_call)
            return
        compiled = self._triton(per_call)
        if runtime.INTERPRETED:
            self.launch = self._interpreted
        elif compiled is not None and hasattr(compiled, "packed_metadata"):
            self._go_direct(per_call, compiled, _cuda_device_of(per_call))

    def _interpreted(self, **per_call: Any) -> None:
        self._triton(per_call)

    def _slow(self, **per_call: Any) -> None:
        self._triton(per_call)

    def _misuse(self, **per_call: Any) -> None:
        got = {n: v.dtype for n, v in per_call.items() if isinstance(v, torch.Tensor)}
        raise RuntimeError(
            f"{self!r} launched with dtypes {got}, other than its first launch's: the op's plan key must "
            "include every per-call tensor's dtype (a bug in llm-speed; please report it)"
        )

    def _go_direct(self, per_call: dict, compiled: Any, device: int | None) -> None:
        """Make ``launch`` a function that passes its arguments straight to ``compiled``."""
        names = self.per_call
        # Pointers Triton specialised as 16-byte aligned at the first launch: later ones must be too.
        tensor_names = [n for n in names if isinstance(per_call[n], torch.Tensor)]
        aligned = [n for n in tensor_names if per_call[n].data_ptr() % 16 == 0]
        constants = [self.fixed[p] for p in self.kernel.params if p in self.fixed]
        constant_names = [f"_c{i}" for i in range(len(constants))]
        it = iter(constant_names)
        arguments = ", ".join(p if p not in self.fixed else next(it) for p in self.kernel.params)
        keywords = ", ".join(f"{n}={n}" for n in names)
        dtypes = [per_call[n].dtype for n in tensor_names]
        misuse = " or ".join(f"{n}.dtype is not _dtypes[{i}]" for i, n in enumerate(tensor_names))
        guards = []
        if aligned:
            guards.append(f"({' | '.join(f'{n}.data_ptr()' for n in aligned)}) & 15")
        if device is not None:
            guards.append("_current() != _device")
            guards.append("not (_idle(_knobs.launch_enter_hook) and _idle(_knobs.launch_exit_hook))")
        g0, g1, g2 = self.grid
        lines = [
            "def _factory(_run, _function, _packed, _stream, _slow, _misuse, _dtypes, _count, _name,",
            f"    _current, _device, _knobs, _idle, {', '.join([*constant_names, '_unused=None'])}):",
            f"    def launch(*, {', '.join(names)}):",
        ]
        if misuse:  # the plan's key must fix every per-call tensor's dtype: a miss is a bug in the op
            lines += [f"        if {misuse}:", f"            return _misuse({keywords})"]
        if guards:
            lines += [f"        if {' or '.join(guards)}:", f"            return _slow({keywords})"]
        lines += [
            f"        _run({g0}, {g1}, {g2}, _stream(_device), _function, _packed, None, None, None,",
            f"             {arguments})",
            "        _count[_name] += 1",
            "    return launch",
        ]
        source = "\n".join(lines) + "\n"
        namespace: dict[str, Any] = {}
        exec(compile(source, f"<plan {self.kernel.name}>", "exec"), namespace)  # noqa: S102
        if device is None:  # simulated: no stream, no device, no hooks
            stream, current, knobs_runtime = (lambda _device: 0), (lambda: None), None
        else:
            from triton import knobs
            from triton.runtime import driver

            stream, current, knobs_runtime = driver.active.get_current_stream, _current_device, knobs.runtime
        slow = self._slow if device is not None else _count_only(self.kernel.name)
        self.launch = namespace["_factory"](
            compiled.run, compiled.function, compiled.packed_metadata, stream, slow, self._misuse, dtypes,
            runtime._launches, self.kernel.name, current, device, knobs_runtime, _idle, *constants,
        )  # fmt: skip
        self.direct = device is not None

    def __repr__(self) -> str:
        return f"Plan({self.kernel.name}, grid={self.grid}, warps={self.num_warps}, stages={self.num_stages})"


# The current CUDA device, without torch.cuda.current_device()'s initialisation check (a CUDA tensor exists).
_current_device: Callable[[], int] | None = getattr(torch._C, "_cuda_getDevice", None)


def _idle(hook: Any) -> bool:
    """A launch hook that does nothing: None, or an empty chain (Triton's ``HookChain``)."""
    return hook is None or not getattr(hook, "calls", True)


def _cuda_device_of(per_call: dict) -> int | None:
    for value in per_call.values():
        if isinstance(value, torch.Tensor):
            return value.device.index if value.device.type == "cuda" else None
    return None


def _count_only(name: str) -> Callable[..., None]:
    def launch(**_: Any) -> None:
        runtime.record_launch(name)

    return launch


class _Stub:
    """What a compiled kernel offers a launch, doing nothing (:func:`simulated_gpu`)."""

    function = 0
    packed_metadata = None

    @staticmethod
    def run(*_: Any) -> None:
        return None


@contextlib.contextmanager
def simulated_gpu() -> Iterator[None]:
    """Inside the block, CPU tensors take the code path of CUDA tensors, and each launch does nothing.

    The ops choose configurations and switches as for a compiled kernel on the stand-in GPU
    (:func:`llm_speed.core.hardware.default_hardware`), make and look up their plans, allocate their outputs
    and launch through the direct path, whose last step (queueing the kernel) is a no-op. What remains is the
    host time of a call on a GPU, minus the driver's launch: ``llm-speed bench overhead`` measures it on a
    CPU, and the tests use it to prove no op reads device data on the host.
    """
    saved = runtime.SIMULATED_GPU, runtime.INTERPRETED
    runtime.SIMULATED_GPU, runtime.INTERPRETED = True, False
    clear_plans()
    try:
        yield
    finally:
        runtime.SIMULATED_GPU, runtime.INTERPRETED = saved
        clear_plans()
