"""``llm-speed bench ops``: every fused op runs with each implementation and the JSON carries the rows."""

import json

import torch

from llm_speed import _runtime
from llm_speed.bench.ops import run_ops
from llm_speed.cli import main
from llm_speed.fused import cross_entropy, rms_norm, rotary, swiglu

TINY = {
    "rows": 3,
    "hidden": 40,
    "intermediate": 24,
    "heads": 1,
    "seq": 4,
    "head_dim": 16,
    "batch": 1,
    "vocab": 50,
}


def test_run_ops_measures_every_fused_op_with_its_kernels():
    before = _runtime.launch_counts()
    rows = run_ops(dtype="fp32", device=torch.device("cpu"), impls=("llm_speed", "eager"), warmup=0,
                   iterations=1, sizes=TINY)  # fmt: skip
    assert [(r.op, r.impl) for r in rows] == [
        (op, impl)
        for op in ("rms_norm", "swiglu", "rotary", "linear_cross_entropy")
        for impl in ("llm_speed", "eager")
    ]
    assert all(r.unavailable is None and r.median_ms > 0 for r in rows), rows
    assert rows[0].bytes_moved == 5 * 3 * 40 * 4 and rows[0].gbps > 0 and rows[-1].gbps is None
    if _runtime.INTERPRETED:
        ran = _runtime.launch_counts() - before
        kernels = (
            rms_norm.KERNEL_FORWARD,
            swiglu.KERNEL_BACKWARD,
            rotary.KERNEL,
            cross_entropy.KERNEL_BACKWARD,
        )
        assert all(ran[k] for k in kernels), ran


def test_cli_writes_json(tmp_path):
    out = tmp_path / "ops.json"
    argv = ["bench", "ops", "--device", "cpu", "--impl", "eager", "--iterations", "1", "--warmup", "0"]
    assert main([*argv, "--dtype", "fp32", "--output", str(out)]) == 1  # no llm_speed row was asked for
    payload = json.loads(out.read_text())
    assert payload["environment"]["device_type"] == "cpu"
    assert {row["op"] for row in payload["rows"]} == {"rms_norm", "swiglu", "rotary", "linear_cross_entropy"}
