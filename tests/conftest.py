"""Test set-up: without a GPU, Triton kernels run on CPU tensors through the interpreter.

The variable must be set before any llm_speed module defines its kernels, hence here, before test modules
are imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist workers share the machine's cores: give each its share of CPU threads for the float64
# references (8 workers x all cores each oversubscribed a 16-core GPU machine), unless the user chose.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1 and "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """``--dist loadgroup`` (``make test``) sends the tests marked ``xdist_group`` to one worker by a
    "@group" suffix pytest-xdist adds to their node ids; under pytest 9.2 its ``item._nodeid`` no longer
    reaches the id (now ``item._id``), so the group's tests spread over both workers and one waited on the
    kernel report's compile lock (~60 s). Add the suffix where it is missing."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})  # fmt: skip
        if names and "@" not in item.nodeid and hasattr(item, "_id"):
            item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(names)}")
    # The groups first (xdist hands out work in collection order): the kernel report's group is a fifth of
    # the suite's CPU time in one unit; started midway, it could leave the other worker idle at the end.
    items.sort(key=_group_rank)


def _group_rank(item) -> int:
    for rank, group in enumerate(LONGEST_GROUPS_FIRST):
        if item.nodeid.endswith(f"@{group}"):
            return rank
    return len(LONGEST_GROUPS_FIRST)


# The xdist groups, longest first (CPU seconds under `make test`: ~250 and ~20).
LONGEST_GROUPS_FIRST = ("kernel_report", "package")


@pytest.fixture
def device() -> torch.device:
    """The device the kernels are tested on: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def nan_poisoned(monkeypatch):
    """Every attention and GEMM kernel output starts as NaN (``accuracy_rule.nan_poisoned_outputs``).

    Autouse in tests/attention and tests/matmul."""
    from accuracy_rule import nan_poisoned_outputs

    nan_poisoned_outputs(monkeypatch)


@pytest.fixture(autouse=True)
def quiet_cpu(monkeypatch):
    """The load yardstick of CPU benchmark runs (llm_speed.bench.cpu_load.probe) reads as an idle core: what
    a test checks must not depend on how busy the test machine is. Tests of a busy machine put their own
    yardstick in its place; tests of the yardstick call cpu_load.measure_yardstick."""
    from llm_speed.bench import cpu_load

    monkeypatch.setattr(cpu_load, "probe", lambda: cpu_load.Yardstick(wall_ms=5.0, cpu_share=1.0, rounds=7))
