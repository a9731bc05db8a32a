"""benchmarks/proof_site/sitecustomize.py: every process of a proof run logs Triton's compiles, with the GPU
machine's Triton (3.6) as with the installed one, so the proof's summary can give its cold compile cost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from triton_builds import BUILDS, environment

REPO = Path(__file__).resolve().parents[2]

# A kernel built for an H100 on this CPU (as the kernel report builds them): Triton's own compile path, which
# the listener sees exactly as on the GPU.
KERNEL = textwrap.dedent("""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    @triton.jit
    def add_one(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n) + 1.0, mask=i < n)

    signature = {"x_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    source = triton.compiler.ASTSource(add_one, signature=signature, constexprs={"BLOCK": 128})
    triton.compile(source, target=GPUTarget("cuda", 90, 32))
""")


@pytest.mark.parametrize("build", BUILDS)
def test_each_compile_and_cache_load_is_logged(build, tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    log = tmp_path / "compiles.jsonl"
    env = environment(build, LLM_SPEED_COMPILE_LOG=str(log), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("TRITON_INTERPRET", None)
    site = str(REPO / "benchmarks" / "proof_site")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, env.get("PYTHONPATH")) if p)
    for _ in range(2):  # cold, then served from the file cache the first process filled
        done = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
    cold, warm = (json.loads(line) for line in log.read_text().splitlines())
    assert cold["kernel"] == warm["kernel"] == "add_one" and cold["hash"] == warm["hash"]
    assert (cold["cache_hit"], warm["cache_hit"]) == (False, True)
    # Both are Triton's own timing of the call. Not compared: a cache hit still computes the key (ptxas's
    # version among it), 350 ms here against 420-460 for the cold compile, so a busy machine can invert them.
    assert cold["compile_us"] > 0 and warm["compile_us"] >= 0


def test_without_the_variable_nothing_is_logged_or_imported(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO / "benchmarks" / "proof_site"))
    env.pop("LLM_SPEED_COMPILE_LOG", None)
    done = subprocess.run([sys.executable, "-c", "import sys; print('triton' in sys.modules)"], env=env,
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("build", BUILDS)
def test_triton_key_read_from_the_files_is_the_one_triton_computes(build):
    """benchmarks/triton_key.py (the key of a wheel another Python loads) agrees with ``triton_key()``."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from triton_key import triton_key_sha256

    code = (
        "import hashlib, pathlib, triton\nfrom triton.runtime.cache import triton_key\n"
        "print(pathlib.Path(triton.__file__).parents[1])\n"
        "print(hashlib.sha256(triton_key().encode()).hexdigest())"
    )
    env = environment(build)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    root, imported = done.stdout.split()
    assert triton_key_sha256(Path(root)) == imported
