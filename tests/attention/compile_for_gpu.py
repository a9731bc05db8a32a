"""Compile every attention kernel ahead of time for a GPU architecture, with no GPU present.

Run as a script (without TRITON_INTERPRET) by test_attention_compiles.py. It compiles every configuration
of the FULL tier (the tier tables of ``attention/flash.py``: every kernel, each (dtype class, head dim) row
in one of the variants fp16/bf16/fp32 x causal/non-causal), the rows where LARGE differs from FULL and a
sample row of COMPACT, and prints one JSON line per kernel with the shared memory the compiled kernel
needs, so the test can compare it with the GPU's limit, and the registers and per-thread stack (register
spills) that ``cuobjdump -res-usage`` reports for the cubin.
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

from llm_speed.attention import flash

FP32_POINTERS = ("LSE", "DELTA", "DLSE")
INT_POINTERS = ("CU_Q", "CU_K")  # packed sequences: int32 offsets
FLOAT_ARGS = ("qk_scale_log2", "scale", "softcap")


def _signature(kernel, element, constexprs):
    signature = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.isupper():  # tensors are the upper-case parameters
            pointee = "fp32" if name in FP32_POINTERS else "i32" if name in INT_POINTERS else element
            signature[name] = f"*{pointee}"
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


# The variant compiled per (dtype class, padded head dim) of the FULL tier, so that bf16, fp16, fp32, causal
# and non-causal are all compiled without compiling every combination: (pointer element, is_causal).
FULL_VARIANTS = {
    (torch.float16, 64): ("fp16", True),
    (torch.float16, 128): ("bf16", False),
    (torch.float16, 256): ("bf16", True),
    (torch.float32, 64): ("fp32", False),
    (torch.float32, 128): ("fp32", True),
    (torch.float32, 256): ("fp32", False),
}
# COMPACT (devices under 99 KB per block) has FULL's tiles with fewer key rows and one stage, so it needs
# no more shared memory (tests/test_block_configs.py); one row is compiled as a sample.
COMPACT_SAMPLE = {(torch.float16, 128): ("fp16", True)}
# LARGE (227 KB per block) differs from FULL in its 16-bit rows at head dims 64 and 128: both compiled.
LARGE_VARIANTS = {(torch.float16, 64): ("fp16", False), (torch.float16, 128): ("bf16", True)}


def jobs():
    """(tier, element, is_causal, block_d, kernel, block_m, block_n, config, switches) for each compile."""
    tiers = (
        (flash.LARGE, LARGE_VARIANTS),
        (flash.FULL, FULL_VARIANTS),
        (flash.COMPACT, COMPACT_SAMPLE),
    )
    for tier, variants in tiers:
        for (dtype, block_d), (element, is_causal) in variants.items():
            fwd = tier.table["forward"][dtype][block_d]
            bwd = tier.table["backward"][dtype][block_d]
            kernel_jobs = [
                (flash._attention_fwd_kernel, fwd.block_m, fwd.block_n, fwd, {"TWO_PASS": False}),
                (flash._flash_bwd_dkdv_kernel, bwd.block_m, bwd.block_n, bwd, {}),
                (flash._flash_bwd_dq_kernel, bwd.block_n, bwd.block_m, bwd, {}),
            ]
            if tier is not flash.COMPACT:  # the tiled (two-pass) forward: not on COMPACT devices
                kernel_jobs.insert(
                    1, (flash._attention_fwd_kernel, fwd.block_m, fwd.block_n, fwd, {"TWO_PASS": True})
                )
            for job in kernel_jobs:
                yield (tier.name, element, is_causal, block_d, *job)


def main(arch: int) -> None:
    target = GPUTarget("cuda", arch, 32)
    for tier, element, is_causal, block_d, kernel, block_m, block_n, config, switches in jobs():
        # Causal rows compile the richest masking (a sliding window with softcap); the bf16 rows the packed
        # (varlen) variant; non-causal rows the plain kernel.
        varlen = element == "bf16"
        constexprs = dict(
            HAS_LEFT=is_causal,
            HAS_RIGHT=is_causal,
            SOFTCAP=is_causal,
            IS_VARLEN=varlen,
            BLOCK_B=16 if varlen else 1,
            RNE_BY_HAND=False,
            EVEN_M=False,
            EVEN_N=False,
            EVEN_D=False,
            DOT_IN_FP32=False,
            DOT_PRECISION="ieee" if element == "fp32" else "tf32",
            BLOCK_D=block_d,
            **switches,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
        source = ASTSource(
            fn=kernel, signature=_signature(kernel, element, constexprs), constexprs=constexprs
        )
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
        compiled = triton.compile(source, target=target, options=options)
        row = {
            "tier": tier,
            "kernel": kernel.fn.__name__ + ("_two_pass" if switches.get("TWO_PASS") else ""),
            "dtype": element,
            "causal": is_causal,
            "varlen": varlen,
            "block_d": block_d,
            "shared_bytes": compiled.metadata.shared,
            **_resource_usage(compiled.asm["cubin"]),
        }
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]))
