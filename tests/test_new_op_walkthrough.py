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
from llm_speed.core import runtime
from llm_speed.core.kernel_math import cast, rne_by_hand
from llm_speed.profiler import CUDAProfiler

# --- the one file: src/llm_speed/silu.py (imports: torch, triton, tl, runtime, ops, cast, rne_by_hand) ---

KERNEL = "silu"
BLOCK = 1024


@triton.jit
def _silu_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, RNE_BY_HAND: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = x / (1.0 + tl.exp(-x))  # silu(x) = x * sigmoid(x), in fp32
    tl.store(out_ptr + offsets, cast(y, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=mask)


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    """The spec: ``x * sigmoid(x)`` in plain PyTorch (what tests compare with, and the CPU fallback)."""
    return torch.nn.functional.silu(x.float()).to(x.dtype)


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU (Elfwing et al., 2018, arXiv:1702.03118) of any float tensor, in one Triton kernel."""
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"x must be a float16/bfloat16/float32 tensor, got {getattr(x, 'dtype', type(x))}")
    x = x.contiguous()
    runtime.report_work("silu", x=x)  # every path reports its work once, for the profiler
    if x.numel() == 0 or not runtime.triton_runs_on(x.device):
        return silu_reference(x)
    out = torch.empty_like(x)
    with runtime.on_device_of(x):
        _silu_kernel[(triton.cdiv(x.numel(), BLOCK),)](
            x_ptr=x, out_ptr=out, n=x.numel(), BLOCK=BLOCK, RNE_BY_HAND=rne_by_hand(x.dtype)
        )
    runtime.record_launch(KERNEL)
    return out


def silu_work(*, x: torch.Tensor) -> ops.Work | None:
    """4 FLOPs per element (negate, exp, add, divide); reads x once and writes the output once."""
    if x.numel() == 0:
        return None
    return ops.Work(4.0 * x.numel(), 2.0 * x.numel() * x.element_size(), x.dtype, x.device)


def silu_example(device, dtype, size: int):
    return (torch.randn(size, size, device=device, dtype=ops.default_dtype(device, dtype)),), {}


# --- end of the file --------------------------------------------------------------------------------------

# The one row; in src/llm_speed/ops.py the module is "llm_speed.silu" instead of this test module.
ROW = ops.Op(
    "silu",
    f"{__name__}:silu",
    cost=f"{__name__}:silu_work",
    example=f"{__name__}:silu_example",
    baseline="torch.nn.functional:silu",
)


@pytest.fixture
def with_row(monkeypatch):
    monkeypatch.setattr(ops, "OPS", (*ops.OPS, ROW))


def test_kernel_matches_the_reference_within_the_accuracy_rule(device):
    x = torch.randn(3, 1000, device=device, dtype=torch.bfloat16) * 4
    before = runtime.launch_count(KERNEL)
    out = silu(x)
    assert runtime.launch_count(KERNEL) == before + 1  # the Triton kernel ran, not the fallback
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
    assert entry["kernels"] == [KERNEL] and entry["runs"].startswith("Triton")


def test_bench_op_times_it_against_its_baseline(with_row, capsys):
    argv = ["bench", "op", "silu", "--size", "32", "--device", "cpu", "--warmup", "0", "--iterations", "1"]
    assert cli.main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]
    assert [row["impl"] for row in results] == ["llm-speed", "torch.nn.functional:silu"]
    assert all(row["flops"] == 4 * 32 * 32 and row["median_ms"] > 0 for row in results)


def test_bad_and_empty_input():
    with pytest.raises(TypeError, match="x must be"):
        silu(torch.zeros(3, dtype=torch.int32))
    assert silu(torch.empty(0, 5)).shape == (0, 5)


def test_docs_show_this_code():
    """docs/architecture.md's walkthrough shows the code tested here, line for line."""
    root = Path(__file__).resolve().parents[1]
    docs = (root / "docs" / "architecture.md").read_text()
    shown = re.findall(r"```python\n(import torch\n.*?)```", docs, flags=re.S)[0]
    tested = Path(__file__).read_text()
    tested = tested[tested.index('KERNEL = "silu"') : tested.index("# --- end of the file")]
    assert shown[shown.index('KERNEL = "silu"') :].strip() == tested.strip()
