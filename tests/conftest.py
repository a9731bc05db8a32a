"""Test set-up: without a GPU, Triton kernels run on CPU tensors through the interpreter.

The variable must be set before any llm_speed module defines its kernels, hence here, before test modules
are imported.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    """The device the kernels are tested on: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
