"""docs/profiler.md: its snippet runs as written, and every path of an op reports its work to the profiler."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import llm_speed
from llm_speed import ops
from llm_speed.core import runtime
from llm_speed.profiler import CUDAProfiler

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "profiler.md"


def docs_snippet() -> str:
    """The first python block of docs/profiler.md (the one the docs say runs everywhere)."""
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    assert blocks, "docs/profiler.md has no python snippet"
    return blocks[0]


def test_profiler_docs_snippet_runs_on_cpu():
    # A fresh interpreter without TRITON_INTERPRET: flash_attention takes its plain-PyTorch CPU path, whose
    # work went unreported (tflops None, then a TypeError in the f-string). The interpreter's path is
    # checked in-process below.
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO / "src")}
    result = subprocess.run(
        [sys.executable, "-c", docs_snippet()],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TFLOP/s" in result.stdout and "vs PyTorch" in result.stdout


def _flops_in_block(call) -> float | None:
    profiler = CUDAProfiler("cpu")
    with profiler.profile("block"):
        call()
    return profiler.get_metrics().flops


def _attention_inputs(requires_grad: bool = False):
    return [torch.randn(1, 2, 8, 16, requires_grad=requires_grad) for _ in range(3)]


def _expected(row: str, *problem: torch.Tensor, **flags) -> float:
    names = ("op_a", "op_b", "out") if "gemm" in row else ("q", "k")
    return ops.get(row).work(**dict(zip(names, problem, strict=True)), **flags).flops


@pytest.mark.parametrize("triton_path", [True, False], ids=["triton", "pytorch-fallback"])
def test_every_path_reports_its_work_once(monkeypatch, triton_path):
    if not triton_path:  # what a CPU without the interpreter runs
        monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    q, k, v = _attention_inputs()
    flash = _expected("flash_attention", q, k, is_causal=True)
    assert _flops_in_block(lambda: llm_speed.flash_attention(q, k, v, is_causal=True)) == flash
    tiled = _expected("tiled_attention", q, k, is_causal=False)
    assert _flops_in_block(lambda: llm_speed.tiled_attention(q, k, v)) == tiled

    qg, kg, vg = _attention_inputs(requires_grad=True)
    out = llm_speed.flash_attention(qg, kg, vg, is_causal=True)
    backward = _expected("flash_attention_backward", qg, kg, is_causal=True)
    assert _flops_in_block(lambda: out.sum().backward()) == backward

    a, b = torch.randn(8, 16), torch.randn(16, 4)
    out_ab = torch.empty(8, 4)
    assert _flops_in_block(lambda: llm_speed.gemm(a, b)) == _expected("gemm", a, b, out_ab)
    a8, b8 = (torch.randint(-128, 128, (8, 8), dtype=torch.int8) for _ in range(2))
    out8 = torch.empty(8, 8, dtype=torch.int32)
    int8 = _expected("tensor_core_gemm_int8", a8, b8, out8)
    assert _flops_in_block(lambda: llm_speed.tensor_core_gemm_int8(a8, b8)) == int8


def test_plain_pytorch_ops_and_wrappers_report_once():
    import cuda_llm_ops

    q, k, v = _attention_inputs()
    naive = _expected("naive_attention", q, k, is_causal=False)
    assert _flops_in_block(lambda: llm_speed.naive_attention(q, k, v)) == naive
    assert _flops_in_block(lambda: cuda_llm_ops.naive_attention(q, k, v)) == naive  # the wrapper adds nothing
    assert _flops_in_block(lambda: llm_speed.optimal_attention(q, k, v)) == naive  # short: the naive branch
    from llm_speed.helpers import sdpa_attention

    sdpa = _expected("sdpa_attention", q, k, is_causal=False)
    assert _flops_in_block(lambda: sdpa_attention(q, k, v)) == sdpa


def test_empty_problems_cost_nothing():
    empty = torch.randn(1, 2, 0, 16)
    assert _flops_in_block(lambda: llm_speed.naive_attention(empty, empty, empty)) is None


def test_work_reports_do_not_break_torch_compile_fullgraph():
    # naive_attention reports from plain Python: while torch.compile traces, the report is skipped (no
    # graph break); flash_attention's report runs in its torch.library op body, so it still counts.
    q, k, v = _attention_inputs()
    naive = torch.compile(llm_speed.naive_attention, fullgraph=True, backend="eager")
    torch.testing.assert_close(naive(q, k, v), llm_speed.naive_attention(q, k, v))
    flash = torch.compile(llm_speed.flash_attention, fullgraph=True, backend="eager")
    flash(q, k, v)
    assert _flops_in_block(lambda: flash(q, k, v)) == _expected("flash_attention", q, k, is_causal=False)
