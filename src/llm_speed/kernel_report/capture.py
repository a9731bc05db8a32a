"""What the ops launch, read from their own launchers: the plans a problem makes under
:func:`llm_speed.core.launch.simulated_gpu`, with the per-call arguments of their first launch, and of any
later launch that takes the plan's slow path (its tensors lost the first launch's 16-byte alignment: on a GPU
Triton compiles that call's own specialisation).

A plan's first launch (``Plan._first``) is where it meets its per-call tensors; recording it there gives the
plan (kernel, grid, fixed arguments, ``num_warps``, ``num_stages``) and the tensors and floats of the call,
whose dtypes and 16-byte alignment Triton specialises on. A Gluon kernel's launch
(:class:`llm_speed.gluon.launch.GluonPlan`) is recorded the same way, through the observer its plans call.
The launchers see the stand-in GPU given here (its shared memory picks their tier), exactly as they would
see a real one of that kind.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

from llm_speed.core import hardware as hardware_module
from llm_speed.core import launch
from llm_speed.core.hardware import Hardware
from llm_speed.gluon import launch as gluon_launch
from llm_speed.kernel_report.problems import Problem


@dataclasses.dataclass
class Launch:
    """One plan's first launch in a problem."""

    op: str
    problem: str
    plan: Any  # launch.Plan, or a Gluon kernel's GluonPlan
    per_call: dict[str, Any]


@contextlib.contextmanager
def stand_in(hardware: Hardware) -> Iterator[None]:
    """Inside the block, ops on CPU tensors (which stand for CUDA ones under ``simulated_gpu``) choose their
    configurations for ``hardware``."""
    saved = hardware_module.default_hardware
    hardware_module.default_hardware = lambda: hardware
    try:
        yield
    finally:
        hardware_module.default_hardware = saved


def capture(problems: list[Problem], hardware: Hardware) -> list[Launch]:
    """The first launch of every plan each problem makes, and its slow-path launches, in order, with
    ``hardware`` standing in."""
    import torch

    launches: list[Launch] = []
    current: list[Problem] = []
    on = [False]
    original, original_slow = launch.Plan._first, launch.Plan._simulated_slow

    def record(plan, per_call: dict) -> None:  # also the Gluon plans' observer: they launch through their own
        if on[0]:
            problem = current[-1]
            launches.append(Launch(problem.op, problem.label, plan, dict(per_call)))

    def first(plan: launch.Plan, **per_call: Any) -> None:
        record(plan, per_call)
        return original(plan, **per_call)

    def slow(plan: launch.Plan, **per_call: Any) -> None:
        record(plan, per_call)
        return original_slow(plan, **per_call)

    @contextlib.contextmanager
    def recording() -> Iterator[None]:
        on[0] = True
        try:
            yield
        finally:
            on[0] = False

    launch.Plan._first = first
    launch.Plan._simulated_slow = slow
    remove_gluon = gluon_launch.add_observer(record)
    try:
        with stand_in(hardware), launch.simulated_gpu(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            for problem in problems:
                launch.clear_plans()  # every problem makes (and so records) its own plans
                current.append(problem)
                problem.run(recording)
    finally:
        launch.Plan._first = original
        launch.Plan._simulated_slow = original_slow
        remove_gluon()
    return launches
