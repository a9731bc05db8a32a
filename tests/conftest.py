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
