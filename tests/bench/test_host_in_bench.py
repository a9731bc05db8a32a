"""benchmarks/host_in_bench.py (a GPU measurement): its calls are well formed, checked on the CPU with the
launches stubbed and the problems made small, so a lent GPU's minutes are not lost to a typo."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from llm_speed.core import launch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "host_in_bench.py"


def test_every_call_runs(monkeypatch):
    spec = importlib.util.spec_from_file_location("host_in_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "SIZES", (32,))
    monkeypatch.setattr(module, "DECODE", ((2, 512),))
    monkeypatch.setattr(module, "HEADS", 4)
    monkeypatch.setattr(module, "HEADS_KV", 2)
    monkeypatch.setattr(module, "HEAD_DIM", 32)
    cpu = torch.device("cpu")
    calls = [*module.gemm_calls(cpu), *module.decode_calls(cpu)]
    assert [(size, impl) for size, impl, _ in calls] == [
        (32, "llm-speed"), (32, "torch"), ("2x512", "kvcache"), ("2x512", "kvcache-paged"), ("2x512", "sdpa")
    ]  # fmt: skip
    with torch.no_grad(), launch.simulated_gpu():
        outputs = [call() for _, _, call in calls]
    assert [tuple(out.shape) for out in outputs] == [(32, 32)] * 2 + [(2, 1, 4, 32)] * 2 + [(2, 4, 1, 32)]
