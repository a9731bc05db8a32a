"""Run in a subprocess by test_launch.py: with Triton 3.6's CUDA launcher, a plan's native launches hand the
launcher's C function what Triton's own launch hands it, descriptors encoded once per address."""

import json
import sys

sys.path.insert(0, sys.argv[1])  # tests/
import fake_gpu  # noqa: E402

fake_gpu.install(native=True)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llm_speed.core import launch  # noqa: E402


@triton.jit
def kernel(X_desc, Y, OUT, n, scale, stride, BLOCK: tl.constexpr):
    pass


KERNEL = launch.Kernel(kernel, "test_native_kernel")


def described(value):
    """A launch argument with each pointer as its address (the C side reads a tensor's ``data_ptr()``)."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, (tuple, list)):
        return [described(v) for v in value]
    if hasattr(value, "block_shape"):  # a TensorDescriptor (the launcher of a Triton other than 3.6's)
        return ["descriptor", value.base.data_ptr(), *(list(x) for x in (value.shape, value.strides))]
    return value if isinstance(value, (int, float, str)) and not isinstance(value, bool) else repr(value)


layout = launch.Descriptor((32, 16), (16, 1), (16, 16))
x, y, out = torch.randn(32, 16).half(), torch.randn(64), torch.empty(64)
other_x = torch.randn(32, 16).half()
plan = KERNEL.plan((3, 2), num_warps=4, num_stages=2, X_desc=layout, n=64, stride=48, BLOCK=32)
report = {"triton": triton.__version__}
plan.launch(X_desc=x, Y=y, OUT=out, scale=0.5)  # Triton's own path (CudaLauncher.__call__ and its wrapper)
report["native"] = plan.native
report["direct"] = plan.direct
encoded_by_triton = len(fake_gpu.ENCODED)
plan.launch(X_desc=x, Y=y, OUT=out, scale=0.5)
report["triton_call"] = described(fake_gpu.LAUNCHES[-2])
report["direct_call"] = described(fake_gpu.LAUNCHES[-1])
plan.launch(X_desc=other_x, Y=y, OUT=out, scale=0.25)  # another address: encoded once more
plan.launch(X_desc=x, Y=y, OUT=out, scale=0.5)  # the first address again: encoded already
plan.launch(X_desc=other_x, Y=y, OUT=out, scale=0.25)
report["other_call"] = described(fake_gpu.LAUNCHES[-1])
report["encodings_direct"] = len(fake_gpu.ENCODED) - encoded_by_triton
report["encoded_addresses"] = [e[1] for e in fake_gpu.ENCODED]
report["addresses"] = [x.data_ptr(), other_x.data_ptr()]
report["launches"] = len(fake_gpu.LAUNCHES)
print(json.dumps(report))
