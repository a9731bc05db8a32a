"""benchmarks/predict_targets.py: the model tables of docs/guides/attention-hopper.md and gemm.md."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "predict_targets.py"
GUIDES = {
    part: REPO / "docs" / "guides" / name
    for part, name in (("attention", "attention-hopper.md"), ("gemm", "gemm.md"))
}


@pytest.fixture(scope="module")
def predict():
    spec = importlib.util.spec_from_file_location("predict_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _output(predict, *argv: str) -> str:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert predict.main(list(argv)) == 0
    return buffer.getvalue()


def test_guides_hold_the_exact_output(predict):
    """The guides' model tables must be regenerated whenever the model or the grid changes."""
    for part, guide in GUIDES.items():
        assert _output(predict, part) in guide.read_text(), (
            f"docs/guides/{guide.name}: {part} tables are stale"
        )


def test_command_lines_parse_and_cover_the_grid(predict, tmp_path):
    from llm_speed.cli import build_parser

    parser = build_parser()
    attention = _output(predict, "commands", "attention", "--out", str(tmp_path)).splitlines()
    # 2 dtypes x 2 modes x 2 head dims x 2 masks x MHA/GQA x 6 sequence lengths.
    assert len(attention) == 192
    args = parser.parse_args(attention[-1].split())
    assert (args.batch_size * args.seq_lengths[0], args.num_heads * args.head_dim) == (16384, 2048)
    assert args.num_heads == 8 * args.num_kv_heads and args.causal and args.mode == "bwd"
    gemm = _output(predict, "commands", "gemm", "--dtypes", "bf16").splitlines()
    assert len(gemm) == 1 + 2 * 5
    assert parser.parse_args(gemm[-1].split()).tokens == 8192
    assert len({line.split("--output ")[1] for line in attention}) == len(attention)


def test_summarize_reads_benchmark_json(predict, tmp_path):
    row = {
        "impl": "flash",
        "case": "seq=512",
        "tflops": 123.4,
        "reason": None,
        "fastest_other": "sdpa-cudnn",
        "speedup_vs_fastest_other": 0.9,
        "measured_over_predicted": 1.7,
    }
    other = {**row, "impl": "sdpa-cudnn"}
    (tmp_path / "attn_x.json").write_text(json.dumps({"results": [row, other]}))
    lines = _output(predict, "summarize", str(tmp_path)).splitlines()
    # A file without settings or a GPU gives no prediction: the prediction cells read "-".
    assert lines[2] == "| attn_x | seq=512 | - | 123.4 | - | - | - | sdpa-cudnn | - | - | - | 0.90 | 1.70 |"
    assert len(lines) == 3


def test_attention_point_matches_hand_count(predict):
    # seq 16k, head_dim 128, 16 heads, batch 1, non-causal: 4 * 16 * 128 * 16384^2 FLOPs forward.
    point = predict.attention_point(128, 16384, False, "fwd", gqa=False)
    assert point.flops == 4 * 16 * 128 * 16384**2
    assert point.bound == "compute"
    assert point.time_floor_s == pytest.approx(point.flops / 989.4e12)
    # seq 512 causal: half the pairs, the same bytes -> memory-bound at the 295 FLOP/B ridge.
    assert predict.attention_point(64, 512, True, "fwd", gqa=False).bound == "memory"
    # GQA 8:1 reads an eighth of K and V, never more bytes than MHA.
    mha = predict.attention_point(64, 512, False, "bwd", gqa=False)
    gqa = predict.attention_point(64, 512, False, "bwd", gqa=True)
    assert gqa.flops == mha.flops and gqa.bytes_moved < mha.bytes_moved


def test_gemm_point_and_parts(predict):
    decode = predict.gemm_point(1, 4096, 4096)
    assert decode.bound == "memory"
    assert decode.bytes_moved == 2 * (4096 + 4096 * 4096 + 4096)
    assert predict.gemm_point(8192, 8192, 8192).bound == "compute"
    attention_only = _output(predict, "attention")
    gemm_only = _output(predict, "gemm")
    assert "llama-3-70b" not in attention_only and "llama-3-70b" in gemm_only
    assert "| 128 | full | 16384 | 1 x 16 | 2,199.0 |" in attention_only
    with pytest.raises(SystemExit):
        predict.main(["matmul"])


def test_h100_results_page_is_the_summary_of_its_json(predict):
    """docs/h100-results.md holds the exact output of its command over the committed measurements."""
    results = REPO / "benchmarks" / "results" / "h100-sxm" / "af147ec-baseline"
    table = _output(predict, "summarize", str(results))
    assert table.count("\n") == 2 + 48 + 55  # 48 attention points, 55 GEMM shapes
    assert table in (REPO / "docs" / "h100-results.md").read_text()
