"""Compile every attention kernel ahead of time for a GPU architecture, with no GPU present.

Run as a script (without TRITON_INTERPRET) by test_attention_compiles.py. For each dtype and padded head_dim
it compiles the launchers' block configurations and prints one JSON line per kernel with the shared memory
the compiled kernel needs, so the test can compare it with the GPU's limit, and the registers and per-thread
stack (register spills) that ``cuobjdump -res-usage`` reports for the cubin.
"""

import inspect
import json
import pathlib
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llm_speed.attention import kernels, launch

# bfloat16 tiles have the same sizes as float16 ones; float32 ones are twice as big.
POINTER_TYPES = {torch.float16: "fp16", torch.float32: "fp32"}
FP32_POINTERS = ("LSE", "DELTA", "DLSE")
FLOAT_ARGS = ("qk_scale_log2", "scale")


def _signature(kernel, element, constexprs):
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.isupper():  # tensors are the upper-case parameters
            signature[name] = "*fp32" if name in FP32_POINTERS else f"*{element}"
        else:
            signature[name] = "fp32" if name in FLOAT_ARGS else "i32"
    return signature


def _resource_usage(cubin: bytes) -> dict:
    """Registers and stack bytes per thread of a cubin, read with the cuobjdump that ships with Triton."""
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        report = subprocess.run([str(cuobjdump), "-res-usage", file.name], capture_output=True, text=True)
    usage = dict(re.findall(r"\b(REG|STACK):(\d+)", report.stdout))
    return {"registers": int(usage["REG"]), "stack_bytes": int(usage["STACK"])}


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for dtype, element in POINTER_TYPES.items():
        for block_d in (64, 128, 256):
            common = dict(
                IS_CAUSAL=True,
                EVEN_M=False,
                EVEN_N=False,
                EVEN_D=False,
                DOT_IN_FP32=False,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32",
                BLOCK_D=block_d,
            )
            fwd, bwd = launch.forward_config(block_d, dtype), launch.backward_config(block_d, dtype)
            jobs = [
                (kernels._attention_fwd_kernel, fwd.block_m, fwd.block_n, fwd, {"TWO_PASS": False}),
                (kernels._attention_fwd_kernel, fwd.block_m, fwd.block_n, fwd, {"TWO_PASS": True}),
                (kernels._flash_bwd_dkdv_kernel, bwd.block_m, bwd.block_n, bwd, {}),
                (kernels._flash_bwd_dq_kernel, bwd.block_n, bwd.block_m, bwd, {}),
            ]
            for kernel, block_m, block_n, config, switches in jobs:
                constexprs = dict(common, **switches, BLOCK_M=block_m, BLOCK_N=block_n)
                source = ASTSource(
                    fn=kernel, signature=_signature(kernel, element, constexprs), constexprs=constexprs
                )
                options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
                compiled = triton.compile(source, target=target, options=options)
                print(
                    json.dumps(
                        {
                            "kernel": kernel.fn.__name__ + ("_two_pass" if switches.get("TWO_PASS") else ""),
                            "dtype": element,
                            "block_d": block_d,
                            "shared_bytes": compiled.metadata.shared,
                            **_resource_usage(compiled.asm["cubin"]),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main(int(sys.argv[1]))
