"""benchmarks/proof_problems.py: the proof's headline and A/B calls as kernel-report problems, whose kernels
the carried Triton cache holds. Each headline line must mean here what it means on the GPU (its sizes),
reach its kernels through the benchmark's own loop, and say so when a row does not."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def pp():
    spec = importlib.util.spec_from_file_location("proof_problems", BENCHMARKS / "proof_problems.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path: gpu_bench, attention_ab
    return module


def _kernels(pp, problems) -> list[str]:
    from llm_speed.kernel_report import build, capture

    hardware = build.target_of("h100-sxm").hardware
    return [launch.plan.kernel.name for launch in capture.capture(problems, hardware)]


def test_every_headline_set_is_captured(pp):
    import gpu_bench

    assert set(pp.HEADLINE_SETS) == set(gpu_bench.PROOF_SETS)
    labels = [p.label for p in pp.proof_problems()]
    assert sum(pp.HEAVY[0] in label for label in labels) == 1  # the fused ops' problem
    assert sum(label.startswith(pp.HEAVY[1]) for label in labels) == 1  # the train step's


def test_each_headline_line_names_the_sizes_it_runs_at(pp):
    """Parsed here (a CPU), a line's defaults would be the CPU's: attention and GEMM lines name every size,
    decode and ops take the GPU's defaults explicitly (pp._settings), so the problem is the GPU's."""
    import gpu_bench

    from llm_speed import cli

    sized = {"attention": ("seq_lengths", "batch_size", "num_heads", "head_dim", "dtype"),
             "gemm": ("dtype",)}  # fmt: skip
    lines = [line for name in pp.HEADLINE_SETS for line in gpu_bench.proof_lines(name, "OUT")]
    assert lines
    for line in lines:
        args = cli.build_parser().parse_args(shlex.split(line))
        for field in sized.get(args.benchmark, ()):
            assert getattr(args, field) is not None, f"{line}: --{field.replace('_', '-')} left to the device"
        if args.benchmark == "gemm":
            assert args.sizes or (args.model and args.tokens), line
        kind, settings = pp._settings(line)
        assert settings.device == "cpu" and settings.impls
    decode = [pp._settings(line)[1] for line in lines if " decode " in f" {line} "]
    assert decode and all((s.num_heads, s.num_kv_heads, s.head_dim) == (32, 8, 128) for s in decode)


def test_a_decode_line_records_the_kernels_of_its_rows(pp):
    """batch 1 x 4k, dense and 16-token pages: a split step (attention + combine) for each cache."""
    problem = next(p for p in pp.proof_problems() if "decode_bf16_b1_" in p.label)
    kernels = _kernels(pp, [problem])
    assert kernels.count("kvcache_attention_fwd") == 2 and "kvcache_attention_combine" in kernels


def test_an_ab_candidate_is_captured_under_its_own_policy(pp):
    """decode-append: the shipped step appends in its own kernel, the candidate's in the attention kernel."""
    labels = ("A/B shipped at decode-append", "A/B decode-append")
    shipped, candidate = (p for p in pp.ab_problems() if p.label.startswith(labels))
    assert "kvcache_append" in _kernels(pp, [shipped])
    assert "kvcache_append" not in _kernels(pp, [candidate])


def test_a_row_that_does_not_reach_its_kernels_is_said(pp, monkeypatch):
    import llm_speed.attention as attention

    def refuse(*args, **kwargs):
        raise ValueError("k_cache: refused here")

    monkeypatch.setattr(attention, "flash_attention_with_kvcache", refuse)
    problem = next(p for p in pp.proof_problems() if "decode_bf16_b1_" in p.label)
    with pytest.raises(pp.NotCaptured, match="kvcache-paged: ValueError: k_cache: refused here"):
        _kernels(pp, [problem])


def test_shape_only_matmuls_give_the_products_shape_and_restore_torch(pp):
    a, b, out = torch.ones(3, 5), torch.ones(5, 7), torch.empty(3, 7)
    with pp.shape_only_matmuls():
        assert torch.mm(a, b).shape == (3, 7) and torch.mm(a, b, out=out) is out
        assert torch.addmm(torch.zeros(7), a, b).shape == (3, 7)
        summed = torch.zeros(5, 5)
        assert summed.addmm_(a.t(), a) is summed and not summed.any()  # nothing computed
    assert torch.equal(torch.mm(a, b), torch.full((3, 7), 5.0))
    assert torch.zeros(5, 5).addmm_(a.t(), a).eq(3).all()



def test_shape_only_linear_gives_shapes_forward_and_backward_and_restores_torch(pp):
    x = torch.ones(2, 3, 4, requires_grad=True)
    weight, bias = torch.ones(5, 4, requires_grad=True), torch.ones(5, requires_grad=True)
    with pp.shape_only_linear():
        out = torch.nn.Linear(4, 5)(x)
        assert out.shape == (2, 3, 5)
        out = torch.nn.functional.linear(x, weight, bias)
        out.sum().backward()
    assert x.grad.shape == x.shape and weight.grad.shape == weight.shape and bias.grad.shape == bias.shape
    assert torch.equal(torch.nn.functional.linear(x, weight, bias), torch.full((2, 3, 5), 5.0))
