"""docs/architecture.md's walkthrough, run: a new elementwise op (SiLU) is one file plus one row of the op
table, and the profiler, ``llm-speed doctor`` and ``llm-speed bench op`` pick it up with no other change.

The "one file" is the block between the markers below (docs/architecture.md shows the same code as
``src/llm_speed/silu.py``); the row is added to ``llm_speed.ops.OPS`` by the fixture.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from llm_speed import cli, ops
from llm_speed.core import runtime, tensors
from llm_speed.core.config import KernelConfig
from llm_speed.core.dispatch import Op
from llm_speed.core.kernel_math import cast, rne_by_hand
from llm_speed.core.launch import Kernel, Plan, cdiv, plan_cache
from llm_speed.core.tensors import check_tensor
from llm_speed.profiler import CUDAProfiler

# --- the one file: src/llm_speed/silu.py (its imports are the block above, less the test's own) ---------

# --- kernels


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_x = tl.load(x_ptr + o, mask=m).to(tl.float32)
    b_y = b_x / (1.0 + tl.exp(-b_x))  # silu(x) = x * sigmoid(x), in fp32
    tl.store(out_ptr + o, cast(b_y, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


# --- launcher

FORWARD = Kernel(_silu_kernel, "silu")


def config(n: int) -> KernelConfig:
    """1024 elements per program, 4 warps: an elementwise op needs nothing of the hardware."""
    return KernelConfig(1, 1024, num_warps=4, num_stages=1)


@plan_cache
def _plan(n: int, dtype: torch.dtype, device: torch.device) -> Plan:
    cfg = config(n)
    return FORWARD.plan(
        (cdiv(n, cfg.block_n),), n=n, BLOCK=cfg.block_n, RNE_BY_HAND=rne_by_hand(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    """The spec: ``x * sigmoid(x)`` in plain PyTorch (what tests compare with, and the CPU fallback)."""
    return torch.nn.functional.silu(x.float()).to(x.dtype)


def forward(x: torch.Tensor) -> torch.Tensor:
    runtime.report_work("silu", x=x)  # every path reports its work once, for the profiler
    if x.numel() == 0 or not runtime.triton_runs_on(x.device):
        return silu_reference(x)
    out = tensors.new_output(x.shape, x.dtype, x.device)
    _plan(x.numel(), x.dtype, x.device).launch(x_ptr=x, out_ptr=out)
    return out


# --- op registration (an op with a gradient adds an autograd section: see llm_speed/fused/rms_norm.py)


@torch.library.custom_op("llm_speed::walkthrough_silu", mutates_args=())
def _silu_op(x: torch.Tensor) -> torch.Tensor:
    return forward(x)


@_silu_op.register_fake
def _silu_fake(x):
    return torch.empty_like(x)


_silu_call = Op(_silu_op, forward)


# --- public function


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (Elfwing et al., 2018, arXiv:1702.03118) of any float tensor, in one Triton kernel."""
    check_tensor("x", x)
    return _silu_call(x.contiguous())


# --- end of the file --------------------------------------------------------------------------------------

# --- its row's cost and example, in src/llm_speed/ops.py ----------------------------------------------------


def silu_work(*, x: torch.Tensor) -> ops.Work | None:
    """4 FLOPs per element (negate, exp, add, divide); reads x once and writes the output once."""
    if x.numel() == 0:
        return None
    return ops.Work(4.0 * x.numel(), 2.0 * x.numel() * x.element_size(), x.dtype, x.device)


def silu_example(device, dtype, size: int):
    return (torch.randn(size, size, device=device, dtype=ops.default_dtype(device, dtype)),), {}


# The one row; in src/llm_speed/ops.py the function is "llm_speed.silu:silu" instead of this test module's.
ROW = ops.Op(
    "silu",
    f"{__name__}:silu",
    cost=silu_work,
    example=silu_example,
    baseline="torch.nn.functional:silu",
)


@pytest.fixture
def with_row(monkeypatch):
    monkeypatch.setattr(ops, "OPS", (*ops.OPS, ROW))


def test_kernel_matches_the_reference_within_the_accuracy_rule(device):
    x = torch.randn(3, 1000, device=device, dtype=torch.bfloat16) * 4
    before = runtime.launch_count(FORWARD.name)
    out = silu(x)
    assert runtime.launch_count(FORWARD.name) == before + 1  # the Triton kernel ran, not the fallback
    truth = torch.nn.functional.silu(x.double())
    ours = (out.double() - truth).abs().max()
    torch_same_precision = (silu_reference(x).double() - truth).abs().max()
    assert ours <= 2 * torch_same_precision + 1e-6


def test_the_profiler_costs_it_from_the_row(with_row):
    x = torch.randn(64, 64)
    profiler = CUDAProfiler("cpu")
    with profiler.profile("silu"):
        silu(x)
    metrics = profiler.get_metrics()
    assert metrics.flops == 4 * x.numel() and metrics.bytes_moved == 2 * x.numel() * 4
    assert metrics.tflops is not None


def test_doctor_probes_it(device, monkeypatch, capsys):
    monkeypatch.setattr(ops, "OPS", (ROW,))  # only the new row: the others are probed in tests/test_ops.py
    assert cli.main(["doctor", "--device", device.type, "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)["dispatch"]["silu"]
    assert entry["kernels"] == [FORWARD.name] and entry["runs"].startswith("Triton")


def test_bench_op_times_it_against_its_baseline(with_row, capsys):
    argv = ["bench", "op", "silu", "--size", "32", "--device", "cpu", "--warmup", "0", "--iterations", "1"]
    assert cli.main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [row["impl"] for row in results] == ["llm-speed", "torch.nn.functional:silu"]
    assert all(row["flops"] == 4 * 32 * 32 and row["median_ms"] > 0 for row in results)


def test_bad_and_empty_input():
    with pytest.raises(TypeError, match="x has dtype torch.int32; accepted: float16, bfloat16, float32"):
        silu(torch.zeros(3, dtype=torch.int32))
    assert silu(torch.empty(0, 5)).shape == (0, 5)


def test_docs_show_this_code():
    """docs/architecture.md's walkthrough shows the code tested here, line for line."""
    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", docs, flags=re.S)
    tested = Path(__file__).read_text()
    op_file = tested[tested.index("# --- kernels") : tested.index("# --- end of the file")]
    row_cost = tested[tested.index("def silu_work") : tested.index("# The one row")]
    assert any(op_file.strip() in block for block in blocks), "the op file's code is not shown as tested"
    assert any(row_cost.strip() in block for block in blocks), "the row's cost is not shown as tested"
