"""``llm-speed bench decode``: a CPU dry run with tiny sizes, its flags and its refusals."""

import json

import pytest

from llm_speed.bench import decode as decode_bench
from llm_speed.cli import build_parser, main


def test_dry_run_measures_every_impl(device, capsys, tmp_path):
    out = tmp_path / "decode.json"
    argv = (
        f"bench decode --device {device.type} --batch-sizes 2 --contexts 20 --num-heads 4 --num-kv-heads 2 "
        "--head-dim 16"
    )
    argv = [*argv.split(), *"--warmup 0 --iterations 1 --no-progress --json --output".split(), str(out)]
    assert main(argv) == 0
    document = json.loads(capsys.readouterr().out)
    assert document == json.loads(out.read_text())
    rows = document["results"]
    assert [r["impl"] for r in rows] == list(decode_bench.IMPLS)
    assert all(r["batch"] == 2 and r["context"] == 20 for r in rows)
    assert all(r["bytes_moved"] > 0 and r["flops"] > 0 for r in rows)
    assert all(r["available"] for r in rows), [r["reason"] for r in rows]  # Triton runs on CPU in the tests
    assert all(r["bandwidth_gb_s"] > 0 for r in rows)
    # a GPU's HBM peak comes from the spec table; a CPU has none
    assert all((r["hbm_peak_fraction"] is None) == (device.type == "cpu") for r in rows)


def test_defaults_and_flags():
    args = build_parser().parse_args(["bench", "decode", "--device", "cpu", "--page-size", "32"])
    settings = decode_bench.decode_settings(args, decode_bench.torch.device("cpu"))
    assert settings.page_size == 32 and settings.batch_sizes == decode_bench.CPU_DEFAULTS["batch_sizes"]
    assert settings.impls == decode_bench.IMPLS


@pytest.mark.parametrize(
    "flags, match",
    [(["--page-size", "24"], "page_size"), (["--num-heads", "4", "--num-kv-heads", "3"], "num_kv_heads")],
)
def test_bad_settings_are_refused(flags, match):
    args = build_parser().parse_args(["bench", "decode", "--device", "cpu", *flags])
    with pytest.raises(ValueError, match=match):
        decode_bench.decode_settings(args, decode_bench.torch.device("cpu"))
