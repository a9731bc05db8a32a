"""benchmarks/triton_cache.py: a Triton cache compiled on a CPU, packed, unpacked elsewhere and served from
there (issue 70, item 2). Built here with the installed Triton, whose own key it then matches; the GPU
machine's match needs its Python and Triton (``make triton-cache``), which the proof's summary reports."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "triton_cache.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=600, check=False)  # fmt: skip


def test_a_packed_cache_is_served_where_it_is_unpacked(tmp_path):
    """rms_norm's kernels for the H100 and those of one of the proof's headline lines (its decode step at
    batch 1: proof_problems.py), compiled and packed; unpacked in another directory (the group files pointed
    there), every kernel compiled again is Triton's cache hit; the manifest names each."""
    archive = tmp_path / "sm90.tar.gz"
    built = _run("build", str(archive), "--op", "rms_norm", "--workers", "1",
                 "--proof-filter", "decode_bf16_b1_")
    assert built.returncode == 0, built.stderr[-2000:]
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert any(name.endswith(".cubin") for name in names)
    assert not any(name.endswith((".ptx", ".llir", ".ttgir")) for name in names)  # binaries only
    verified = _run("verify", str(archive))
    assert verified.returncode == 0, verified.stderr[-2000:]
    counts = json.loads(verified.stdout)
    assert counts["key_matches"] is True and counts["missed"] == 0 and counts["hit"] >= 1

    cache = tmp_path / "elsewhere"
    installed = _run("install", str(archive), str(cache), "--manifest-out", str(tmp_path / "m.json"))
    assert installed.returncode == 0, installed.stderr
    manifest = json.loads((tmp_path / "m.json").read_text())
    names = [k["kernel"] for k in manifest["kernels"]]
    assert set(names) == {"rms_norm_fwd", "kvcache_attention_fwd", "kvcache_attention_combine"}, names
    assert manifest["proof_problems"] == ["proof-decode decode_bf16_b1_c4096.json"]
    assert manifest["here"]["triton_key_sha256"] == manifest["triton_key_sha256"]
    assert manifest["sources_match"] is True
    assert len(list(cache.glob("*/__grp__*.json"))) == len(manifest["kernels"])
    for group in cache.glob("*/__grp__*.json"):
        paths = json.loads(group.read_text())["child_paths"].values()
        assert paths and all(Path(p).parent == group.parent and Path(p).is_file() for p in paths)


def test_a_truncated_archive_is_said_in_the_manifest_the_summary_reads(tmp_path):
    archive = tmp_path / "cut.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"x" * 100000
        member = tarfile.TarInfo("a/b.cubin")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    archive.write_bytes(archive.read_bytes()[:200])
    done = _run("install", str(archive), str(tmp_path / "cache"), "--manifest-out", str(tmp_path / "m.json"))
    assert done.returncode == 2 and "triton_cache.py install:" in done.stderr
    assert json.loads((tmp_path / "m.json").read_text())["error"]


def test_install_refuses_an_archive_that_writes_outside_the_cache(tmp_path):
    archive = tmp_path / "bad.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = b"{}"
        member = tarfile.TarInfo("../escaped.json")
        member.size = len(data)
        tar.addfile(member, io.BytesIO(data))
    done = _run("install", str(archive), str(tmp_path / "cache"))
    assert done.returncode == 2 and "leaves the cache directory" in done.stderr
    assert not (tmp_path / "escaped.json").exists()
