"""The Triton builds the compile checks run with: the installed one, and the GPU machine's (Triton 3.6,
torch 2.11's pin) when ``make test`` has unpacked it into the directory named by ``LLM_SPEED_TRITON_GPU``.

The first H100 run found two faults that only that build shows: a kernel Triton 3.9 compiles and 3.6 refuses,
and 3.6's interpreter failing under NumPy 2.4. Both are checked here, without a GPU, on every ``make test``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GPU_BUILD_ENV = "LLM_SPEED_TRITON_GPU"
GPU_BUILD_VERSION = "3.6.0"

BUILDS = [
    pytest.param(None, id="installed"),
    pytest.param(GPU_BUILD_ENV, id=f"triton-{GPU_BUILD_VERSION}"),
]


def environment(build: str | None, **extra: str) -> dict[str, str]:
    """The environment of a subprocess that imports ``build`` (None: the installed Triton), checked to import
    it; skips the test when the GPU build was not provided (``make test`` provides it; a bare ``pytest`` run
    does not)."""
    env = dict(os.environ, **extra)
    if build is None:
        return env
    directory = os.environ.get(build)
    if not directory or not os.path.isdir(os.path.join(directory, "triton")):
        pytest.skip(f"Triton {GPU_BUILD_VERSION} not unpacked ({build} unset): `make test` provides it")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (directory, env.get("PYTHONPATH")) if p)
    assert version_of(env) == GPU_BUILD_VERSION, f"{directory} does not hold Triton {GPU_BUILD_VERSION}"
    return env


def version_of(env: dict[str, str]) -> str:
    """The Triton version a subprocess with ``env`` imports."""
    done = subprocess.run(
        [sys.executable, "-c", "import triton; print(triton.__version__)"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    return done.stdout.strip()
