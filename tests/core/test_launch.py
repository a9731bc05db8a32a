"""The launch path (llm_speed.core.launch): a plan's direct launches hand a compiled kernel exactly the
arguments Triton's own launch does, for the installed Triton and the GPU machine's 3.6; the cases Triton's own
path must serve; interpreted and simulated launches; the plan caches."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from llm_speed.core import launch, runtime
from triton_builds import BUILDS, environment

TESTS = Path(__file__).resolve().parents[1]


def _script_report(script: str, build) -> dict:
    """The JSON report of ``tests/core/<script>`` run with ``build``'s Triton, compiled (on a stand-in GPU),
    not interpreted."""
    env = environment(build)
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, str(TESTS / "core" / script), str(TESTS)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("build", BUILDS)
def test_direct_launch_passes_what_triton_passes(build):
    report = _script_report("launch_script.py", build)
    assert report["direct_after_first"]
    assert report["grid"][0] == report["grid"][1] == [3, 2, 1]
    assert report["stream"] == [777, 777] and report["function"] == [1234, 1234]
    assert report["args"][0] == report["args"][1]  # every parameter, in order, constexprs included
    assert report["hooks_direct"] == ["None", "None", "None"]  # no hook installed: no metadata to build
    assert report["unaligned_compiled_again"]  # Triton's own path, with a kernel that assumes nothing
    assert report["unaligned_args"][0][2] % 16 == 4
    assert report["launch_count"] == 3
    assert report["hooked_launch_passes_hooks"]
    assert "plan key must include every per-call tensor's dtype" in report["dtype_misuse"]


@triton.jit
def _add_kernel(X, Y, OUT, n, scale, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(OUT + o, tl.load(X + o, mask=m) + scale * tl.load(Y + o, mask=m), mask=m)


ADD = launch.Kernel(_add_kernel, "test_add")


def _plan(n: int) -> launch.Plan:
    return ADD.plan((launch.cdiv(n, 16),), num_warps=1, num_stages=1, n=n, BLOCK=16)


@pytest.mark.skipif(
    not runtime.INTERPRETED, reason="checks the interpreter's launch; kernels run compiled here (a GPU)"
)
def test_interpreted_plan_runs_the_kernel_every_time():
    x, y = torch.randn(40), torch.randn(40)
    plan = _plan(40)
    for scale in (0.5, -2.0):
        out = torch.full_like(x, float("nan"))
        before = runtime.launch_count("test_add")
        plan.launch(X=x, Y=y, OUT=out, scale=scale)
        assert runtime.launch_count("test_add") == before + 1
        torch.testing.assert_close(out, x + scale * y)
    assert not plan.direct


def test_simulated_gpu_takes_the_direct_path_and_launches_nothing():
    x, y = torch.randn(40), torch.randn(40)
    out = torch.full_like(x, float("nan"))
    with launch.simulated_gpu():
        assert runtime.triton_runs_on(torch.device("cpu")) and not runtime.INTERPRETED
        plan = _plan(40)
        before = runtime.launch_count("test_add")
        for _ in range(3):
            plan.launch(X=x, Y=y, OUT=out, scale=1.0)
        assert runtime.launch_count("test_add") == before + 3
    assert out.isnan().all()  # nothing ran


def test_plan_arguments_are_checked():
    with pytest.raises(TypeError, match="no parameter called nope"):
        ADD.plan((1,), num_warps=1, num_stages=1, n=4, BLOCK=16, nope=1)
    with pytest.raises(TypeError, match="X is a tensor; a plan holds none"):
        ADD.plan((1,), num_warps=1, num_stages=1, X=torch.zeros(4), n=4, BLOCK=16)
    x = torch.randn(4)
    with pytest.raises(TypeError, match="per-call scale is int"):
        _plan(4).launch(X=x, Y=x, OUT=x, scale=1)  # Triton would specialise an int: it belongs in the key
    with pytest.raises(TypeError, match="missing"):
        _plan(4).launch(X=x, Y=x, scale=1.0)


def test_plan_caches_are_bounded_and_cleared():
    made = []

    @launch.plan_cache
    def plan_for(n):
        made.append(n)
        return _plan(n)

    assert plan_for(8) is plan_for(8) and made == [8]
    assert plan_for.cache_info().maxsize == launch.PLAN_CACHE_SIZE
    launch.clear_plans()
    plan_for(8)
    assert made == [8, 8]


def test_host_arithmetic():
    for a in range(0, 70):
        for b in (1, 3, 16, 64):
            assert launch.cdiv(a, b) == triton.cdiv(a, b)
    assert [launch.next_power_of_2(n) for n in (0, 1, 2, 3, 16, 17, 1000)] == [1, 1, 2, 4, 16, 32, 1024]


@pytest.mark.parametrize("build", BUILDS)
def test_native_launch_passes_what_tritons_launcher_passes(build):
    """With Triton 3.6's CUDA launcher a plan calls its C function itself: the same arguments as Triton's own
    launch (pointers as addresses), each descriptor's CUtensorMap encoded once per address; other Triton
    versions keep their launcher's ``run``."""
    report = _script_report("native_launch_script.py", build)
    triton_call, direct_call, other_call = report["triton_call"], report["direct_call"], report["other_call"]
    assert report["direct"]
    if not report["triton"].startswith("3.6."):  # the launcher's own run, as before
        assert not report["native"]
        assert triton_call[:7] == direct_call[:7] and triton_call[9:] == direct_call[9:]
        return
    assert report["native"]
    # grid (3), stream, function, cooperative, pdl, 2 scratch buffers, metadata, launch metadata, 2 hooks
    base = 13
    assert triton_call[: base - 2] == direct_call[: base - 2]
    assert direct_call[base - 2 : base] == ["None", "None"]  # no hook installed: none passed
    assert triton_call[base:] == direct_call[base:]  # every argument, the descriptor expanded, in order
    x_address, other_address = report["addresses"]
    assert direct_call[base][:2] == ["CUtensorMap", x_address]
    assert other_call[base][:2] == ["CUtensorMap", other_address]
    assert other_call[base + 8] == 0.25  # after the map, shape, strides, Y, OUT and n
    assert report["encodings_direct"] == 2  # x and other_x once each, over four direct launches


@pytest.mark.skipif(not runtime.INTERPRETED, reason="kernels run compiled here (a GPU): no interpreter")
def test_an_interpreted_launch_gives_the_user_no_numpy_warning(device):
    import warnings

    import numpy

    import llm_speed

    # GELU's tanh from exp overflows to inf on large inputs, by design: numpy warned 57 times in the suite.
    x = torch.randn(32, 64, device=device) * 40
    w = torch.randn(48, 64, device=device)
    reference = torch.nn.functional.gelu(x.double() @ w.double().T, approximate="tanh")
    for _ in range(2):  # the first launch (Triton's own path) and a later one
        before = runtime.launch_counts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = llm_speed.gemm(x, w, trans_b=True, activation="gelu_tanh")
        assert runtime.launch_counts() - before, "the Triton kernel did not run"
        assert not caught, [str(warning.message) for warning in caught]
        torch.testing.assert_close(out.double(), reference, atol=2e-3, rtol=1e-4)
    with pytest.warns(RuntimeWarning, match="overflow"):  # numpy's own settings are left as they were
        numpy.exp(numpy.float32(1000.0))
