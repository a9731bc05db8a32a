"""A stand-in for a CUDA GPU inside Triton, for tests of the launch path on a CPU.

:func:`install` makes Triton's active driver report an sm_90 target and replaces its compiler with a recorder:
``JITFunction.run`` then binds, specialises and looks kernels up exactly as on a GPU, and every launch
(Triton's own or llm-speed's direct one) appends its arguments to :data:`LAUNCHES`. Run it in a process
without ``TRITON_INTERPRET``; it works with the installed Triton and with the GPU machine's 3.6.
"""

from __future__ import annotations

LAUNCHES: list[tuple] = []
COMPILED: list[dict] = []


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


class _Driver:
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


def install() -> None:
    """Make Triton believe it runs on an sm_90 GPU whose kernels record their launches."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_Driver())

    def _do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = _Recorder(signature, constexprs)
        self.device_caches[device][0][key] = kernel
        COMPILED.append({"name": self.__name__, "signature": dict(signature), "attrs": attrs})
        return kernel

    JITFunction._do_compile = _do_compile

    # llm-speed's launch path: CPU tensors count as tensors of CUDA device 0
    from llm_speed.core import launch

    launch._current_device = lambda: 0
    launch._cuda_device_of = lambda per_call: 0
