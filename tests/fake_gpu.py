"""A stand-in for a CUDA GPU inside Triton, for tests of the launch path on a CPU.

:func:`install` makes Triton's active driver report an sm_90 target and replaces its compiler with a recorder:
``JITFunction.run`` then binds, specialises and looks kernels up exactly as on a GPU, and every launch
(Triton's own or llm-speed's direct one) appends its arguments to :data:`LAUNCHES`. Run it in a process
without ``TRITON_INTERPRET``; it works with the installed Triton and with the GPU machine's 3.6.

``install(native=True)`` goes one level further down where the Triton build has 3.6's CUDA launcher: a
compiled kernel's ``run`` is that build's own ``CudaLauncher`` (its Python ``__call__`` and descriptor
expansion, built without compiling), and what is recorded is the call of its C function, with each
descriptor's CUtensorMap encoding recorded in :data:`ENCODED` and returned as a tuple of its inputs.
"""

from __future__ import annotations

LAUNCHES: list[tuple] = []
COMPILED: list[dict] = []
ENCODED: list[tuple] = []


class _Recorder:
    """What a compiled kernel offers a launch; ``run`` records the launch."""

    def __init__(self, signature, constexprs):
        self.function = 1234
        self.packed_metadata = ("packed",)
        self.signature = signature
        self.constexprs = constexprs

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        LAUNCHES.append(args)


def _record(*args):
    LAUNCHES.append(args)


class _Utils:
    @staticmethod
    def fill_tma_descriptor(*inputs):
        encoded = ("CUtensorMap", *(tuple(x) if isinstance(x, list) else x for x in inputs))
        ENCODED.append(encoded)
        return encoded


def _cuda_launcher(signature):
    """The build's own CudaLauncher over ``signature`` with :func:`_record` as its C function (3.6's
    layout), or None where the build's launcher is another."""
    from triton.backends.nvidia import driver as nvidia

    if getattr(nvidia, "_BASE_ARGS_FORMAT", None) is None:
        return None
    launcher = object.__new__(nvidia.CudaLauncher)
    launcher.num_ctas = 1
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, False
    descriptors = [t for t in signature.values() if isinstance(t, str) and t.startswith("tensordesc")]
    meta = [{"swizzle": 3, "elem_size": 2, "elem_type": 6, "block_size": [16, 16], "fp4_padded": False}
            for _ in descriptors]  # fmt: skip
    launcher.launch = nvidia.wrap_handle_tensordesc(_record, signature, meta)
    return launcher


class _Driver:
    utils = _Utils()

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 777

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")


def install(native: bool = False) -> None:
    """Make Triton believe it runs on an sm_90 GPU whose kernels record their launches (``native``: see the
    module's docstring)."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Driver())

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _Recorder(signature, constexprs)
        if native and (launcher := _cuda_launcher(dict(signature))) is not None:
            kernel.run = launcher
        self.device_caches[device][0][key] = kernel
        COMPILED.append({"name": self.__name__, "signature": dict(signature), "attrs": attrs})
        return kernel

    JITFunction._do_compile = _do_compile

    # llm-speed's launch path: CPU tensors count as tensors of CUDA device 0
    from llm_speed.core import launch

    launch._current_device = lambda: 0
    launch._cuda_device_of = lambda per_call: 0
