"""The op table (llm_speed.ops): well-formed rows, every work report names a row, and doctor/bench read it."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest

from llm_speed import cli, doctor, ops
from llm_speed.bench import options

SRC = Path(__file__).resolve().parents[1] / "src"


def test_rows_are_well_formed():
    assert len(set(ops.names())) == len(ops.OPS)
    for row in ops.OPS:
        assert callable(row.load()), row.name
        assert callable(row.cost) or isinstance(row.cost, str), row.name
        assert (row.bench is None) == (row.bench_name is None), row.name
        assert not row.alternatives or row.bench, row.name
    assert ops.get("gemm").load().__name__ == "gemm"


def test_unknown_op_is_a_clear_error():
    with pytest.raises(ValueError, match="no row called 'nope'.*flash_attention"):
        ops.get("nope")


def _assigns(node: ast.AST, variable: str) -> bool:
    return isinstance(node, ast.Assign) and any(getattr(t, "id", None) == variable for t in node.targets)


def _reported_names() -> set[str]:
    """Every op name passed to ``report_work`` anywhere in src/ (string constants, incl. conditionals)."""
    found: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            is_call = isinstance(node, ast.Call)
            func = node.func if is_call else None
            name = getattr(func, "attr", None) or getattr(func, "id", None)
            if is_call and name == "report_work" and node.args:
                first = node.args[0]
                if isinstance(first, ast.Name):  # a variable: the names assigned to it in this file
                    first = ast.Tuple(
                        [a.value for a in ast.walk(ast.parse(path.read_text())) if _assigns(a, first.id)]
                    )
                found.update(
                    sub.value
                    for sub in ast.walk(first)
                    if isinstance(sub, ast.Constant) and isinstance(sub.value, str)
                )
    return found


def test_every_reported_op_has_a_row():
    reported = _reported_names()
    assert {"flash_attention", "flash_attention_backward", "tiled_attention", "naive_attention"} <= reported
    assert {"gemm", "tensor_core_gemm_int8", "sdpa_attention"} <= reported
    assert reported <= set(ops.names()), reported - set(ops.names())


def test_bench_reads_its_implementations_from_the_table():
    assert options.ATTENTION_IMPLS == (
        "flash", "flash-fp8", "tiled", "naive", "sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn",
        "sdpa-math", "flash_attn",
    )  # fmt: skip
    assert options.ATTENTION_LLM_SPEED_IMPLS == ("flash", "flash-fp8", "tiled", "naive")
    assert options.GEMM_IMPLS == ("llm-speed", "torch", "torch-int-mm", "torch-scaled-mm")
    assert options.GEMM_FLOAT_IMPLS == ("llm-speed", "torch")
    assert options.GEMM_INT8_IMPLS == ("llm-speed", "torch-int-mm")
    from llm_speed.bench import attention, gemm

    assert attention.IMPLS == options.ATTENTION_IMPLS and gemm.IMPLS == options.GEMM_IMPLS


def _failing_probe(device):
    raise RuntimeError("probe broke\nsecond line")


def test_doctor_probes_come_from_the_table_and_a_failure_exits_1(monkeypatch, capsys):
    naive = ops.get("naive_attention")
    broken = dataclasses.replace(naive, name="broken_op", label="broken op", probe=_failing_probe)
    monkeypatch.setattr(ops, "probes", lambda: (naive, broken))
    assert cli.main(["doctor", "--device", "cpu", "--json"]) == 1
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    assert list(info["dispatch"]) == ["naive_attention", "broken op"]
    assert info["dispatch"]["broken op"]["runs"] == "fails: RuntimeError: probe broke"
    assert info["dispatch"]["naive_attention"]["runs"] == "PyTorch (plain ops, by design)"
    assert doctor.failed_probes(info) == ["broken op"]
    assert "failing ops: broken op" in captured.err


def test_doctor_probes_every_probed_row():
    assert [row.title for row in ops.probes()] == [
        "flash_attention (forward)",
        "flash_attention (fp8 forward)",
        "flash_attention (backward)",
        "tiled_attention",
        "naive_attention",
        "flash_attention_varlen (packed)",
        "flash_attention_with_kvcache (paged decode)",
        "rms_norm",
        "rms_norm_backward",
        "swiglu",
        "swiglu_backward",
        "apply_rotary",
        "geglu",
        "geglu_backward",
        "apply_rotary_qk",
        "apply_rotary_qk_backward",
        "cross_entropy",
        "cross_entropy_backward",
        "fused_linear_cross_entropy",
        "fused_linear_cross_entropy_backward",
        "gemm",
        "tensor_core_gemm",
        "tensor_core_gemm_int8",
        "quantize_fp8",
        "gemm_fp8",
        "grouped_gemm",
        "grouped_gemm_backward",
        "moe_route",
        "moe_route_backward",
        "moe_sort",
        "fused_moe",
        "fused_moe_backward",
    ]


def test_kvcache_flops_count_the_pairs_each_query_computes():
    """A chunk of queries appended to a cache (causal arrives as window right = 0) computes only the pairs its
    rows see: 16 queries after 0 cached tokens see 136 pairs, not 16 x 16; under a left window of 8, 4
    queries see 9 keys each (audit of 2026-12-07: +88% and +33% before). One query is as before."""
    import torch

    def flops(seq_q, cached, window):
        q, cache = torch.empty(1, seq_q, 32, 128), torch.empty(1, 128, 8, 128)
        return ops.kvcache_work(q=q, k_cache=cache, cache_seqlens=torch.tensor([cached]), seq_new=seq_q,
                                window=window).flops  # fmt: skip

    per_pair = 4 * 32 * 128
    assert flops(16, 0, (None, 0)) == per_pair * 136
    assert flops(4, 60, (8, 0)) == per_pair * 4 * 9
    assert flops(1, 20, (None, 0)) == flops(1, 20, None) == per_pair * 21


def test_grouped_gemm_reads_the_weights_of_the_groups_rows_are_expected_to_hit():
    """32 rows over 256 groups touch at most 32 of them: the forward reads those weights, not all 256
    (audit of 2026-12-07: up to 8x at decode shapes before); the backward writes every group's gradient."""
    import torch

    a, b, out = torch.empty(32, 64), torch.empty(256, 64, 96), torch.empty(32, 96)
    work = ops.grouped_gemm_work()(a=a, b=b, out=out)
    hit = 256 * (1 - (1 - 1 / 256) ** 32)
    expected = (a.numel() + b.numel() * hit / 256 + out.numel()) * 4
    assert work.bytes_moved == pytest.approx(expected) and hit < 32
    backward = ops.grouped_gemm_work(backward=True)(a=a, b=b, out=out)
    assert backward.bytes_moved == pytest.approx(expected + (a.numel() + b.numel()) * 4)


def test_the_sdpa_fallback_is_priced_at_flash_traffic():
    """SDPA on 16-bit CUDA tensors keeps no score matrix in DRAM (its flash or memory-efficient backend), as
    `predict` prices the row; it was priced as the naive path's float32 scores (65x, audit of 2026-12-07)."""
    import torch

    q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    sdpa, flash = ops.get("sdpa_attention"), ops.get("flash_attention")
    assert sdpa.work(q=q, k=q, is_causal=True).bytes_moved == flash.work(q=q, k=q, is_causal=True).bytes_moved
