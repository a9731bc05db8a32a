"""Every Gluon kernel's public function launched through Triton's own host path, which no other CPU test
reaches: the simulated GPU of the other tests stops at the plan, before Triton. Here (host_launch_script.py,
in a subprocess) the GPU machine's Triton 3.6 binds and specialises the arguments, the Gluon descriptors
included, and its launcher expands each descriptor into the CUtensorMap it encodes, on a stand-in sm_90 GPU
(tests/fake_gpu.py) with CPU tensors standing for CUDA ones. A Gluon kernel whose arguments that Triton
refuses would otherwise fail on its first GPU run. The attention kernels read Q, K, V (and dO) through
3-D [B H, S, D] views (a partial block reads zeros, not the next head's rows); fp8's V^T stays 2-D."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from triton_builds import GPU_BUILD_ENV, environment

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def calls():
    env = environment(GPU_BUILD_ENV)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, str(TESTS / "gluon" / "host_launch_script.py"), str(TESTS)],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["triton"] == "3.6.0"
    return {call["label"]: call for call in report["calls"]}


def _box(signature: str) -> list[int]:
    return json.loads(signature[signature.index("[") : signature.index("]") + 1])


def test_each_function_launches_its_kernel_once(calls):
    assert len(calls) == 6 + 4 + 1 + 3
    for label, call in calls.items():
        kinds = {"backward": "gluon_attention_bwd_kernel", "gemm fp8": "gluon_gemm_fp8_kernel",
                 "gemm": "gluon_gemm_kernel", "forward": "gluon_attention_fwd_kernel"}  # fmt: skip
        wanted = next(kernel for start, kernel in kinds.items() if label.startswith(start))
        assert (call["launches"], call["kernel"]) == (1, wanted), label


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_reads_3d_views_of_each_head(calls, d, causal):
    # q [2, 4, 100, d], k and v [2, 2, 90, d]: maps over [B H, S, D], boxes [1, rows, D or a 128-byte part]
    for label in (f"forward d{d} causal={causal}", f"backward d{d} causal={causal}"):
        if label not in calls:  # no backward at d = 256
            continue
        call = calls[label]
        shapes = [shape for shape, _ in call["maps"]]
        strides = [stride for _, stride in call["maps"]]
        wanted = [[8, 100, d], [4, 90, d], [4, 90, d]]  # q, k, v; the backward's dO like q
        wanted += [[8, 100, d]] if label.startswith("backward") else []
        assert shapes == wanted, label
        assert strides == [[s * d, d, 1] for _, s, _ in wanted], label
        boxes = [_box(signature) for signature in call["descriptors"].values()]
        assert all(len(box) == 3 and box[0] == 1 and box[2] == d for box in boxes), (label, boxes)
    keys = _box(calls[f"forward d{d} causal={causal}"]["descriptors"]["k_desc"])[1]
    assert keys == (128 if d == 64 or (d == 128 and not causal) else 64)


def test_fp8_reads_v_transposed_through_a_2d_view(calls):
    call = calls["forward fp8 d128"]
    (q_shape, _), (k_shape, _), (v_shape, v_strides) = call["maps"]
    assert q_shape == [8, 100, 128] and k_shape == [4, 100, 128]
    assert v_shape == [2 * 2 * 128, 100] and v_strides[1] == 1 and v_strides[0] % 16 == 0  # V^T's rows
    assert _box(call["descriptors"]["v_desc"]) == [128, 128]


def test_gemms_read_2d_operands(calls):
    assert [shape for shape, _ in calls["gemm bf16"]["maps"]] == [[256, 128], [128, 192], [256, 192]]
    assert [shape for shape, _ in calls["gemm int8"]["maps"]] == [[256, 128], [192, 128], [256, 192]]
    assert [shape for shape, _ in calls["gemm fp8"]["maps"]] == [[256, 256], [384, 256], [256, 384]]
