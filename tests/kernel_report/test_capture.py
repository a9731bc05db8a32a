"""kernel_report.capture: what it records of a problem's launches. A plan's first launch, and any later one
that takes the plan's slow path: its tensors lost the first launch's 16-byte alignment, which a GPU compiles
as another specialisation (and a cache built from the capture must hold)."""

from __future__ import annotations

import torch

import llm_speed
from llm_speed.kernel_report import build, capture
from llm_speed.kernel_report.problems import Problem


def test_a_later_launch_that_loses_its_alignment_is_recorded_as_another_kernel():
    def run(recording):
        base = torch.randn(4 * 256 + 8, dtype=torch.bfloat16)
        weight = torch.randn(256, dtype=torch.bfloat16)
        with recording():
            llm_speed.rms_norm(base[:1024].view(4, 256), weight)
            llm_speed.rms_norm(base[:1024].view(4, 256), weight)  # the plan's fast path: not recorded
            llm_speed.rms_norm(base[1:1025].view(4, 256), weight)  # 2 bytes in: not 16-byte aligned

    target = build.target_of("h100-sxm")
    launches = capture.capture([Problem("rms_norm", "aligned, then not", run)], target.hardware)
    assert [launch.plan.kernel.name for launch in launches] == ["rms_norm_fwd", "rms_norm_fwd"]
    assert launches[0].plan is launches[1].plan

    def misaligned(launch) -> set[str]:
        return {name for name, value in launch.per_call.items()
                if isinstance(value, torch.Tensor) and value.data_ptr() % 16}  # fmt: skip

    assert misaligned(launches[0]) == set() and misaligned(launches[1])  # the input's own specialisation
