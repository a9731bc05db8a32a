"""What the Gluon attention tests share: the GPU tests' marks and shapes, and one kernel-report row compiled
for an H100 by the GPU machine's Triton 3.6 (the build tests)."""

from __future__ import annotations

import pytest
import torch

from llm_speed.kernel_report import report

HOPPER_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
        reason="needs a compute capability 9.0 GPU (H100, H200)",
    ),
]

# (batch, heads, heads_kv, seq_q, seq_kv): MHA and GQA, ragged lengths both ways, one token; causal query
# tiles that see no key (400 - 50 >= 128: the forward's no-key-block item); 12 (batch x head) pairs, so the
# longest-first order ends in a partial section of 8
SHAPES = [(2, 16, 16, 4096, 4096), (1, 32, 8, 1024, 1024), (3, 8, 1, 113, 127), (2, 4, 2, 129, 17),
          (1, 4, 4, 1, 1), (1, 8, 2, 300, 2000), (1, 4, 2, 400, 50), (3, 4, 2, 700, 700)]  # fmt: skip


def compiled_rows(op: str, head_dim: int, causal: tuple[bool, ...], dtype: str) -> dict[bool, dict]:
    """The kernel report's row for Gluon kernel ``op`` at each of those variants (4096 tokens, 16 heads),
    by causal flag, compiled for an H100 with Triton 3.6 in one report; skips where that Triton is not
    unpacked (outside ``make test``)."""
    build = report.gpu_build()
    if build is None:
        pytest.skip(f"the GPU machine's Triton is not unpacked ({report.GPU_BUILD_ENV} unset): `make test`")
    options = {"head_dims": [head_dim], "causal": list(causal), "dtypes": [dtype]}
    result = report.run_report(gpu="h100-sxm", ops=[op], options=options, workers=1, build=build,
                               timeout=600)  # fmt: skip
    assert result["triton"] == "3.6.0"
    rows = {"IS_CAUSAL" in row["variant"].split(): row for row in result["rows"]}
    assert sorted(rows) == sorted(causal), [row["variant"] for row in result["rows"]]
    return rows


def compiled_row(op: str, head_dim: int, is_causal: bool, dtype: str) -> dict:
    """:func:`compiled_rows` of one variant."""
    return compiled_rows(op, head_dim, (is_causal,), dtype)[is_causal]
