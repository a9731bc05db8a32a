"""Launching a Triton kernel at the cost of a lookup.

``kernel[grid](**arguments)`` makes Triton bind every argument to the kernel's signature, work out each one's
specialisation (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), build a cache key from them
and the options, look the compiled kernel up, and build launch metadata for its hooks: 13-30 us of host time
per launch before the kernel is queued (measured on a CPU with compiling and launching stubbed,
``docs/guides/host-path.md``). Here the work is done once per problem class, in a :class:`Plan`::

    plan = KERNEL.plan(grid, num_warps=4, num_stages=2, **arguments_fixed_for_the_class)
    plan.launch(**per_call_arguments)   # the tensors, and float scalars such as a scale

An op keeps its plans in a cache keyed on what fixes them (shapes, strides, dtypes, flags, device:
:func:`plan_cache`), so a call costs one lookup. A plan's first launch goes through Triton's own path, which
compiles the kernel (or, under the interpreter, runs it); later launches hand the arguments straight to the
compiled kernel in its parameter order, as Triton's ``JITFunction.run`` does (``tests/core/test_launch.py``
checks this against the installed Triton and the GPU machine's 3.6). Triton's own path still serves a launch
whose per-call tensor is not 16-byte aligned where the first one was (the compiled kernel assumed it), one
made while another CUDA device is current, and one made while a launch hook (Triton's profiler) is
installed.

Plans hold no tensors; per-call arguments are tensors (whose dtypes the plan's key fixes) and floats (never
specialised by Triton). A tensor-descriptor parameter (Hopper's TMA) has its layout fixed in the plan
(:class:`Descriptor`) and takes its tensor per call.

With Triton 3.6's CUDA launcher (the GPU machine's, torch 2.11's pin) a direct launch goes one step further
down: it calls the launcher's compiled C function itself, with the tensors' addresses as ints (the C side
then neither calls ``data_ptr`` nor asks the driver about each pointer) and each descriptor's CUtensorMap
made once per plan and address, not once per call. Triton's Python wrapper around that function costs 0.7 us
a call on the development CPU and its per-call descriptors 3 us more, before the two driver encodings
(``docs/guides/host-path.md``). Other Triton versions get their launcher's own ``run``.

Host arithmetic here is plain Python (:func:`cdiv`, :func:`next_power_of_2`): ``triton.cdiv`` costs 1.9 us
a call against 0.03 us for the same arithmetic.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from . import runtime
from .intmath import cdiv, next_power_of_2  # noqa: F401 (the launchers' grid helpers, imported from here)

try:  # host-side tensor descriptors (TMA) exist from Triton 3.4 on
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - an older Triton: no op plans a descriptor (gemm checks this)
    TensorDescriptor = None

# Plans an op keeps per cache (least recently used dropped): a training run sees a few shapes per op, a server
# one per batch size and sequence bucket; a plan holds no tensor, only its arguments and a compiled kernel.
PLAN_CACHE_SIZE = 1024

_plan_caches: list[Any] = []


class Descriptor(NamedTuple):
    """The layout of a tensor-descriptor parameter, fixed in a plan: each call passes the tensor it describes
    (2-D or more, last stride 1, base and other strides 16-byte aligned, as TMA requires: Triton checks that
    on a plan's first launch and on any launch whose tensor is not 16-byte aligned)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_shape: tuple[int, ...]

    def over(self, base: torch.Tensor) -> Any:
        """Triton's ``TensorDescriptor`` of ``base`` with this layout."""
        return TensorDescriptor(base, list(self.shape), list(self.strides), list(self.block_shape))


# TMA reads from 16-byte aligned base addresses, with 16-byte aligned strides (a descriptor's layout).
TMA_ALIGN_BYTES = 16


def tma_aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether both tensors' base addresses are :data:`TMA_ALIGN_BYTES` aligned (a tensor descriptor may read
    them; an op's plan key holds this per call)."""
    return not (a.data_ptr() | b.data_ptr()) % TMA_ALIGN_BYTES


# CUtensorMaps a plan keeps per descriptor parameter, by tensor address (then it starts again): a caching
# allocator hands the same few addresses to a loop's tensors, and each map is 128 bytes.
DESCRIPTORS_PER_PLAN = 64


def plan_cache(function: Callable[..., Plan]) -> Callable[..., Plan]:
    """Keep the plans ``function`` makes, keyed on its (hashable) arguments; :func:`clear_plans` empties
    every such cache."""
    cached = functools.lru_cache(maxsize=PLAN_CACHE_SIZE)(function)
    _plan_caches.append(cached)
    return cached


class CallCache(dict):
    """An op's calls that passed every check before, by the metadata those checks read (types, shapes,
    strides, dtypes, devices, flags): what a repeated call still does (allocate, launch) without checking
    again. Holds plans, so :func:`clear_plans` empties it too; at most ``maxsize`` entries (then it starts
    again). Only metadata may go into a key: the checks read nothing else."""

    def __init__(self, maxsize: int = PLAN_CACHE_SIZE):
        super().__init__()
        self.maxsize = maxsize
        _plan_caches.append(self)

    def put(self, key: Any, value: Any) -> None:
        if len(self) >= self.maxsize:
            self.clear()
        self[key] = value

    def cache_clear(self) -> None:
        self.clear()


def clear_plans() -> None:
    """Forget every plan, and every :class:`CallCache` entry (the next call of each op makes its plans
    again)."""
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
        """A launch of this kernel on ``grid`` with ``fixed`` arguments (a :class:`Descriptor` fixes a
        descriptor parameter's layout); the others are given per call."""
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


def _interpreter_arithmetic() -> contextlib.AbstractContextManager:
    """Under the interpreter numpy evaluates the kernel's arithmetic, and reports an exp that overflows to
    inf (GELU's tanh from exp does, by design) as a RuntimeWarning the user never asked for; a GPU does that
    arithmetic silently. So numpy's floating-point warnings are off during an interpreted launch, and only
    then."""
    if not runtime.INTERPRETED:
        return contextlib.nullcontext()
    import numpy

    return numpy.errstate(all="ignore")


class Plan:
    """One kernel, one grid, its launch options, the arguments fixed for a problem class (``fixed``) and the
    layouts of its tensor-descriptor parameters (``descriptors``).

    ``launch(**per_call)`` starts it; ``per_call`` names the parameters it takes (every parameter that is not
    fixed, descriptor parameters included: they take the tensor), by keyword.
    """

    __slots__ = (
        "kernel", "grid", "fixed", "descriptors", "num_warps", "num_stages", "per_call", "launch", "direct",
        "native",
    )  # fmt: skip

    def __init__(
        self, kernel: Kernel, grid: tuple[int, int, int], fixed: dict, num_warps: int, num_stages: int
    ):
        self.kernel = kernel
        self.grid = grid
        self.descriptors = {n: v for n, v in fixed.items() if isinstance(v, Descriptor)}
        self.fixed = {n: v for n, v in fixed.items() if n not in self.descriptors}
        self.num_warps = num_warps
        self.num_stages = num_stages
        self.per_call = tuple(p for p in kernel.params if p not in self.fixed)
        self.launch: Callable[..., None] = self._first
        self.direct = False  # whether launch() now hands arguments straight to a compiled kernel
        self.native = False  # ... to its launcher's C function (Triton 3.6), or under simulation to a stub

    def arguments(self, per_call: dict) -> dict:
        """Every argument of a launch as Triton's own launch takes them: the fixed ones, and the per-call ones
        with each descriptor parameter's tensor in a ``TensorDescriptor`` of the plan's layout."""
        arguments = dict(self.fixed)
        for name, value in per_call.items():
            layout = self.descriptors.get(name)
            arguments[name] = value if layout is None else layout.over(value)
        return arguments

    def _triton(self, per_call: dict) -> Any:
        """Triton's own launch (compiling on first use, or interpreting), on the per-call tensors' device."""
        launcher = self.kernel.fn[self.grid]
        arguments = self.arguments(per_call)
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        device = _cuda_device_of(per_call)
        with _interpreter_arithmetic():
            if device is not None and device != _current_device():
                with torch.cuda.device(device):
                    compiled = launcher(**arguments, **options)
            else:
                compiled = launcher(**arguments, **options)
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
            tensor = isinstance(value, torch.Tensor)
            if not tensor and (name in self.descriptors or not isinstance(value, float)):
                # Triton specialises ints (== 1, divisible by 16): an int that varies belongs in the plan's
                # key.
                raise TypeError(
                    f"{self.kernel.name}: per-call {name} is {type(value).__name__}; per call: tensors "
                    "(descriptor parameters too) and floats only"
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

    def _simulated_slow(self, **per_call: Any) -> None:
        """The slow path under :func:`simulated_gpu` (a call whose tensors lost the first launch's 16-byte
        alignment): counted only, where a GPU would compile the call's own specialisation
        (``kernel_report.capture`` records it as such)."""
        runtime.record_launch(self.kernel.name)

    def _misuse(self, **per_call: Any) -> None:
        got = {n: v.dtype for n, v in per_call.items() if isinstance(v, torch.Tensor)}
        raise RuntimeError(
            f"{self!r} launched with dtypes {got}, other than its first launch's: the op's plan key must "
            "include every per-call tensor's dtype (a bug in llm-speed; please report it)"
        )

    def _go_direct(self, per_call: dict, compiled: Any, device: int | None) -> None:
        """Make ``launch`` a function that passes its arguments straight to ``compiled``: to its launcher's C
        function where :func:`_native_launcher` finds one, else to its ``run``."""
        names = self.per_call
        params = self.kernel.params
        tensor_names = [n for n in names if isinstance(per_call[n], torch.Tensor)]
        # Pointers Triton specialised as 16-byte aligned at the first launch: later ones must be too.
        aligned = [n for n in tensor_names if per_call[n].data_ptr() % 16 == 0]
        native = _native_launcher(compiled.run, [params.index(n) for n in self.descriptors])
        constants = [self.fixed[p] for p in params if p in self.fixed]
        constant_names = iter(f"_c{i}" for i in range(len(constants)))
        passed = []  # what each parameter is passed as, in order
        for p in params:
            if p in self.fixed:
                passed.append(next(constant_names))
            elif p in self.descriptors:  # natively: Triton's expansion (CUtensorMap, shape, strides)
                passed.append(f"*_d_{p}(_p_{p}, {p})" if native else f"_d_{p}({p})")
            else:
                passed.append(f"_p_{p}" if native and p in tensor_names else p)
        keywords = ", ".join(f"{n}={n}" for n in names)
        dtypes = [per_call[n].dtype for n in tensor_names]
        misuse = " or ".join(f"{n}.dtype is not _dtypes[{i}]" for i, n in enumerate(tensor_names))
        address = (lambda n: f"_p_{n}") if native else (lambda n: f"{n}.data_ptr()")
        guards = []
        if aligned:
            guards.append(f"({' | '.join(address(n) for n in aligned)}) & 15")
        if device is not None:
            guards.append("_current() != _device")
            guards.append("not (_idle(_knobs.launch_enter_hook) and _idle(_knobs.launch_exit_hook))")
        g0, g1, g2 = self.grid
        lines = [
            "def _factory(_run, _function, _packed, _stream, _slow, _misuse, _dtypes, _count, _name,",
            "    _current, _device, _knobs, _idle, _coop, _pdl, _descs, *_constants):",
            f"    {', '.join([f'_c{i}' for i in range(len(constants))] + ['_'])} = (*_constants, None)",
        ]
        if self.descriptors:
            lines.append(f"    {', '.join(f'_d_{p}' for p in self.descriptors)}, _ = (*_descs, None)")
        lines.append(f"    def launch(*, {', '.join(names)}):")
        if misuse:  # the plan's key must fix every per-call tensor's dtype: a miss is a bug in the op
            lines += [f"        if {misuse}:", f"            return _misuse({keywords})"]
        if native:
            lines += [f"        _p_{n} = {n}.data_ptr()" for n in tensor_names]
        if guards:
            lines += [f"        if {' or '.join(guards)}:", f"            return _slow({keywords})"]
        base = "_coop, _pdl, None, None, _packed, None, None, None" if native else "_packed, None, None, None"
        lines += [
            f"        _run({g0}, {g1}, {g2}, _stream(_device), _function, {base},",
            f"             {', '.join(passed)})",
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
        if native:
            run, cooperative, pdl = native.call, native.cooperative, native.pdl
            descriptors = [
                _native_descriptor(layout, meta, native.expand)
                for layout, meta in zip(self.descriptors.values(), native.metas, strict=True)
            ]  # fmt: skip
        else:
            run, cooperative, pdl = compiled.run, None, None
            descriptors = [_descriptor_maker(layout) for layout in self.descriptors.values()]
        slow = self._slow if device is not None else self._simulated_slow
        self.launch = namespace["_factory"](
            run, compiled.function, compiled.packed_metadata, stream, slow, self._misuse, dtypes,
            runtime.launch_counter, self.kernel.name, current, device, knobs_runtime, _idle, cooperative, pdl,
            descriptors, *constants,
        )  # fmt: skip
        self.direct = device is not None
        self.native = native is not None

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


class _Native(NamedTuple):
    """A compiled kernel's launcher seen from below: its C function, the two launch flags its Python wrapper
    passes, Triton's own expansion of a descriptor argument, and each descriptor parameter's metadata."""

    call: Callable[..., Any]
    cooperative: Any
    pdl: Any
    expand: Callable[[Any, Any], list]
    metas: tuple


# Triton 3.6's launcher (triton/backends/nvidia/driver.py): ``CudaLauncher.__call__(self, gridX, gridY, gridZ,
# stream, function, *args)`` calls ``self.launch(gridX, gridY, gridZ, stream, function, cooperative, pdl,
# global_scratch, profile_scratch, *args)``, the C function of this base format (descriptor arguments first
# expanded by ``make_tensordesc_arg`` in a wrapper). tests/core/test_launch.py compares the two on 3.6.
_NATIVE_BASE_FORMAT = "iiiKKppOOOOOO"
_DESCRIPTOR_WRAPPER = "wrap_handle_tensordesc.<locals>.inner"


def _native_launcher(run: Any, descriptor_positions: list[int]) -> _Native | None:
    """The :class:`_Native` view of ``run`` (a compiled kernel's launcher) when it is Triton 3.6's CUDA
    launcher needing no scratch memory (or, simulated, the stub), else None."""
    if isinstance(run, _Stub):
        return _Native(_Stub.call, False, False, _Stub.expand, (None,) * len(descriptor_positions))
    cls = type(run)
    module = sys.modules.get(cls.__module__)
    if (
        cls.__name__ != "CudaLauncher"
        or getattr(module, "_BASE_ARGS_FORMAT", None) != _NATIVE_BASE_FORMAT
        or not hasattr(module, "make_tensordesc_arg")
        or getattr(cls.__call__, "__code__", None) is None
        or cls.__call__.__code__.co_argcount != 6
        or getattr(run, "global_scratch_size", 1)
        or getattr(run, "profile_scratch_size", 1)
    ):
        return None
    call, metas = run.launch, ()
    if getattr(call, "__qualname__", "") == _DESCRIPTOR_WRAPPER:
        cells = dict(zip(call.__code__.co_freevars, (c.cell_contents for c in call.__closure__), strict=True))
        if sorted(cells.get("tensordesc_indices", ())) != sorted(descriptor_positions):
            return None
        metas = tuple(cells["tensordesc_meta"])
        call = cells["launcher"]
    elif descriptor_positions:
        return None
    return _Native(call, run.launch_cooperative_grid, run.launch_pdl, module.make_tensordesc_arg, metas)


def _native_descriptor(layout: Descriptor, meta: Any, expand: Callable) -> Callable[[int, Any], tuple]:
    """``(address, tensor) -> arguments``: the launcher's C arguments for a descriptor of ``layout`` over the
    tensor, made by Triton's ``expand`` once per address (a CUtensorMap encodes the address and the plan's
    layout, nothing else)."""
    made: dict[int, tuple] = {}

    def arguments(address: int, base: torch.Tensor) -> tuple:
        hit = made.get(address)
        if hit is None:
            if len(made) >= DESCRIPTORS_PER_PLAN:
                made.clear()
            expanded = list(expand(layout.over(base), meta))
            if expanded and expanded[0] is base:  # base, shape, strides: the base by address (keep no tensor)
                expanded[0] = address
            hit = made[address] = tuple(expanded)
        return hit

    return arguments


def _descriptor_maker(layout: Descriptor) -> Callable[[torch.Tensor], Any]:
    """``tensor -> TensorDescriptor`` of ``layout`` without its per-instance checks (a plan's first launch
    made them) where this Triton's descriptor is a plain dataclass: about 1 us a descriptor less."""
    if not dataclasses.is_dataclass(TensorDescriptor) or hasattr(TensorDescriptor, "__slots__"):
        return layout.over
    fields = {
        f.name: f.default
        for f in dataclasses.fields(TensorDescriptor)
        if f.default is not dataclasses.MISSING and f.name != "base"
    }
    fields.update(
        shape=list(layout.shape), strides=list(layout.strides), block_shape=list(layout.block_shape)
    )
    new = object.__new__

    def make(base: torch.Tensor) -> Any:
        descriptor = new(TensorDescriptor)
        descriptor.__dict__.update(fields)
        descriptor.base = base
        return descriptor

    return make


class _Stub:
    """What a compiled kernel offers a launch, doing nothing (:func:`simulated_gpu`): a launcher whose C
    function and descriptor expansion cost what a call of them costs in Python."""

    function = 0
    packed_metadata = None

    @property
    def run(self) -> _Stub:
        return self

    @staticmethod
    def call(*_: Any) -> None:
        return None

    @staticmethod
    def expand(descriptor: Any, meta: Any) -> list:
        return [object(), *descriptor.shape, *descriptor.strides]


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
