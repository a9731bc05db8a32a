"""Every op of the table runs under the interpreter of the GPU machine's Triton build (3.6), not only of the
installed one: ``llm-speed doctor`` probes each op and exits 1 when one fails. Triton 3.6's interpreter once
failed every flash kernel under NumPy 2.4 (``llm_speed.core.runtime`` fixes its scalar conversion)."""

import json
import subprocess
import sys

import pytest

from triton_builds import BUILDS, GPU_BUILD_VERSION, environment


@pytest.mark.parametrize("build", BUILDS[1:])
def test_doctor_under_the_gpu_builds_interpreter(build, tmp_path):
    env = environment(build, TRITON_INTERPRET="1")
    out = tmp_path / "doctor.json"
    done = subprocess.run(
        [sys.executable, "-m", "llm_speed.cli", "doctor", "--device", "cpu", "--output", str(out)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    info = json.loads(out.read_text())
    assert info["triton_version"] == GPU_BUILD_VERSION and info["triton_interpret"]
    runs = {name: entry["runs"] for name, entry in info["dispatch"].items()}
    assert all(r == "Triton interpreter" or r.startswith("PyTorch (plain") for r in runs.values()), runs
