"""Run in a subprocess by test_launch.py: a plan's direct launches pass Triton's own arguments."""

import json
import sys

sys.path.insert(0, sys.argv[1])  # tests/
import fake_gpu  # noqa: E402

fake_gpu.install()

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from llm_speed.core import launch, runtime  # noqa: E402


@triton.jit
def kernel(X, Y, n, scale, stride_x, one, MODE: tl.constexpr, BLOCK: tl.constexpr, FLAG: tl.constexpr):
    pass


KERNEL = launch.Kernel(kernel, "test_kernel")


def described(args):
    return [
        ["tensor", str(a.dtype), a.data_ptr()] if isinstance(a, torch.Tensor) else [type(a).__name__, repr(a)]
        for a in args
    ]


x, y = torch.randn(64), torch.randn(64)
plan = KERNEL.plan((3, 2), num_warps=4, num_stages=2, n=64, stride_x=32, one=1, MODE="fast", BLOCK=32,
                   FLAG=True)  # fmt: skip
report = {}
plan.launch(X=x, Y=y, scale=0.5)  # Triton's own path: compiles (records) and launches
report["direct_after_first"] = plan.direct
plan.launch(X=x, Y=y, scale=0.5)  # the direct path
first, second = fake_gpu.LAUNCHES[-2], fake_gpu.LAUNCHES[-1]
report["grid"] = [list(first[:3]), list(second[:3])]
report["stream"] = [first[3], second[3]]
report["function"] = [first[4], second[4]]
report["hooks_direct"] = [repr(v) for v in second[6:9]]
report["args"] = [described(first[9:]), described(second[9:])]
compiles = len(fake_gpu.COMPILED)
unaligned = torch.randn(65)[1:]  # 4 bytes past a 16-byte boundary
plan.launch(X=unaligned, Y=y, scale=0.25)  # Triton specialised X as aligned: its own path serves this call
report["unaligned_compiled_again"] = len(fake_gpu.COMPILED) == compiles + 1
report["unaligned_args"] = described(fake_gpu.LAUNCHES[-1][9:])
report["launch_count"] = runtime.launch_count("test_kernel")
from triton import knobs  # noqa: E402

hook = lambda metadata: None  # noqa: E731
knobs.runtime.launch_enter_hook.add(hook)
plan.launch(X=x, Y=y, scale=0.5)  # a profiler's hook is installed: Triton's own path, which calls it
report["hooked_launch_passes_hooks"] = fake_gpu.LAUNCHES[-1][7] is not None
knobs.runtime.launch_enter_hook.remove(hook)
try:
    plan.launch(X=x.double(), Y=y, scale=0.5)
    report["dtype_misuse"] = "accepted"
except RuntimeError as error:
    report["dtype_misuse"] = str(error)
print(json.dumps(report))
