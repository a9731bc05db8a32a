"""The GPU path cannot run here, but it can be compiled: every kernel, at every block configuration an H100
gets (and a sample of the smaller tier), in fp16, bf16 and fp32, causal and not, must compile for sm_90, fit
its shared memory and not spill registers wholesale. Catches API misuse the interpreter tolerates and tiles
too big for the chip."""

import json
import pathlib
import subprocess
import sys

import pytest

from llm_speed.core.gpus import get_gpu
from triton_builds import BUILDS, environment

SCRIPT = pathlib.Path(__file__).with_name("compile_for_gpu.py")
# Per-thread stack (register spills) allowed. The block sizes in use spill at most about 2 KB (float32,
# head_dim 256, whose IEEE dots run on FMA units); tiles too big for the register file spilled 11-17 KB.
MAX_SPILL_BYTES = 4096


@pytest.mark.parametrize("build", BUILDS)
def test_kernels_compile_for_h100_and_fit_shared_memory(tmp_path, build):
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    h100 = get_gpu("h100-sxm")
    major, minor = h100.compute_capability
    # compile for real (not from a cache, not interpreted)
    env = environment(build, TRITON_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(major * 10 + minor)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # FULL: dtype classes x head dims x 4 kernels; LARGE's two 16-bit rows x 4; the COMPACT sample: 3 kernels
    assert len(rows) == 2 * 3 * 4 + 2 * 4 + 3
    assert {row["dtype"] for row in rows} == {"fp16", "bf16", "fp32"}
    assert {row["causal"] for row in rows} == {True, False}
    limit = (h100.smem_per_sm_kb - 1) * 1024  # opt-in maximum per block: 1 KB less than the SM's carve-out
    too_big = [row for row in rows if row["shared_bytes"] > limit]
    assert not too_big, too_big
    spilling = [row for row in rows if row["stack_bytes"] > MAX_SPILL_BYTES]
    assert not spilling, spilling
