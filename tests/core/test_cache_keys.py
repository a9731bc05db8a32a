"""llm_speed.core.cache_keys: a kernel's Triton cache key is the same whatever its process hashed first.

Triton 3.6 (the GPU machine's) merges a called function's constexpr globals into the caller's key only if
that function was hashed before: hashing the helper first gave the kernel another key than hashing the
kernel alone. Checked in both Triton builds (3.9 already hashes callees first)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from triton_builds import BUILDS, environment

MODULE = '''
import triton
import triton.language as tl

SCALE = tl.constexpr(3)


@triton.jit
def helper(x):
    return x * SCALE


@triton.jit
def kernel(out_ptr):
    tl.store(out_ptr, helper(1))
'''

PROBE = '''
import json, sys
if sys.argv[1] == "patched":
    from llm_speed.core import cache_keys
    assert cache_keys.hash_callees_first()
import probe_kernels as m
if sys.argv[2] == "helper-first":
    m.helper.cache_key
print(json.dumps({"kernel": m.kernel.cache_key,
                  "globals": sorted(name for name, _ in m.kernel.used_global_vals)}))
'''


def _keys(tmp_path, build, patched: str, order: str) -> dict:
    (tmp_path / "probe_kernels.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    env = environment(build)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    done = subprocess.run([sys.executable, str(tmp_path / "probe.py"), patched, order], capture_output=True,
                          text=True, env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


@pytest.mark.parametrize("build", BUILDS)
def test_a_kernel_key_does_not_depend_on_what_was_hashed_first(tmp_path, build):
    alone = _keys(tmp_path, build, "patched", "kernel-alone")
    helper_first = _keys(tmp_path, build, "patched", "helper-first")
    assert alone == helper_first
    assert alone["globals"] == ["SCALE"]  # the helper's global, in the kernel's key either way


def test_triton_3_6_alone_depends_on_the_order(tmp_path):
    """Why the patch is there: without it the GPU machine's Triton gives the kernel two keys."""
    build = BUILDS[1].values[0]
    alone = _keys(tmp_path, build, "plain", "kernel-alone")
    helper_first = _keys(tmp_path, build, "plain", "helper-first")
    assert alone["kernel"] != helper_first["kernel"] and alone["globals"] == []
