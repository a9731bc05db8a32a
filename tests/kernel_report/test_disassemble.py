"""The kernel report's disassembly (``build.disassemble_all``): many cubins' SASS from one ``nvdisasm`` run
over their code laid end to end, put back kernel by kernel, must read exactly as ``cuobjdump -sass`` of each
cubin reads: the same addresses, instructions (branch, call and reconvergence targets made the kernel's own
again), encodings and function name. Three small kernels compiled for sm_90a give a loop (a branch back), a
subroutine call and return (IEEE division's slow path) and a reconvergence point (``BSSY``), each also placed
after another kernel so that its addresses start past 0 in the batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from triton_builds import BUILDS, environment

pytest.importorskip(
    "triton.backends.nvidia", reason="compiles for sm_90a: this Triton build has no NVIDIA backend"
)

SCRIPT = r"""
import json, re, subprocess, tempfile
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_speed.kernel_report import analysis, build


@triton.jit
def loop(x_ptr, n, BLOCK: tl.constexpr):
    total = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):
        total += tl.load(x_ptr + start + tl.arange(0, BLOCK), mask=start + tl.arange(0, BLOCK) < n)
    tl.store(x_ptr + tl.arange(0, BLOCK), total)


@triton.jit
def divide(x_ptr, y_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.math.div_rn(tl.load(x_ptr + offsets), tl.load(y_ptr + offsets)))


@triton.jit
def count(x_ptr, counts_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(x_ptr + offsets, mask=offsets < n, other=0)
    tl.atomic_add(counts_ptr + values, 1, mask=(offsets < n) & (values > 0))


def compiled(fn, **signature):
    source = ASTSource(fn, dict(signature, BLOCK="constexpr"), {"BLOCK": 128})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


cubins = [
    compiled(loop, x_ptr="*fp32", n="i32"),
    compiled(divide, x_ptr="*fp32", y_ptr="*fp32"),
    compiled(count, x_ptr="*i32", counts_ptr="*i32", n="i32"),
]
cubins = cubins + cubins[:1]  # the loop kernel again, last: its branch targets far from 0 in the batch
run_tool, tools = build._run_tool, []


def recorded(name, *args):
    tools.append(f"{name} {args[0]}")
    return run_tool(name, *args)


build._run_tool = recorded
batched = build.disassemble_all(cubins, "sm_90a")
build._run_tool = run_tool
rows = []
for cubin, (sass, usage) in zip(cubins, batched, strict=True):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        reference = subprocess.run([build._tool("cuobjdump"), "-sass", file.name], capture_output=True,
                                   text=True, check=True).stdout
    rows.append({
        "same": analysis.Sass.parse(sass) == analysis.Sass.parse(reference),
        "encodings": re.findall(r"/\* (0x[0-9a-f]{16}) \*/", sass)
        == re.findall(r"/\* (0x[0-9a-f]{16}) \*/", reference),
        "functions": re.findall(r"Function : (\S+)", sass),
        "reference_functions": re.findall(r"Function : (\S+)", reference),
        "opcodes": sorted(set(analysis.Sass.parse(sass).opcodes())),
        "loops": analysis.Sass.parse(sass).loops(),
        "registers": analysis.resource_usage(usage).get("REG"),
    })
print(json.dumps({"rows": rows, "tools": tools}))
"""


@pytest.mark.parametrize("build", BUILDS)
def test_one_nvdisasm_run_reads_as_cuobjdump_reads_each_cubin(build, tmp_path):
    env = environment(build, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path))
    script = tmp_path / "disassemble_three.py"  # Triton reads a kernel's source from its file
    script.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # One nvdisasm run for the four (cuobjdump only for each one's resource usage, ~2 ms a cubin).
    assert result["tools"] == ["nvdisasm -hex"] + ["cuobjdump -res-usage"] * 4, result["tools"]
    loop, divide, count, loop_again = result["rows"]
    for row in (loop, divide, count, loop_again):
        assert row["same"] and row["encodings"], row
        assert row["functions"] == row["reference_functions"] and len(row["functions"]) == 1, row
        assert row["registers"] > 0, row
    # What the rebasing is for: a loop found (its branch back), a call and its return, a reconvergence point.
    assert loop["loops"] and loop_again["loops"] == loop["loops"]
    assert {"CALL", "RET"} <= set(divide["opcodes"]), divide["opcodes"]
    assert "BSSY" in count["opcodes"] or "WARPSYNC" in count["opcodes"], count["opcodes"]


def test_a_cubin_nvdisasm_cannot_take_is_read_by_cuobjdump(monkeypatch):
    """Where the batch fails (here: refused) or a cubin is not one function, each cubin is read on its own by
    ``cuobjdump -sass``; the bytes of something that is not an ELF image are not taken for one."""
    from llm_speed.kernel_report import build

    assert build._function_code(b"not an ELF image") is None
    calls = []

    def refuse(codes, arch):
        raise ValueError("refused")

    def run_tool(name, *args):
        calls.append((name, args[0]))
        return {
            "-sass": "\tcode for sm_90a\n        /*0000*/                   EXIT ;\n",
            "-res-usage": "REG:8",
        }[args[0]]

    monkeypatch.setattr(build, "_nvdisasm_raw", refuse)
    monkeypatch.setattr(build, "_run_tool", run_tool)
    got = build.disassemble_all([b"one", b"two"], "sm_90a")
    assert [sass.count("EXIT") for sass, _ in got] == [1, 1] and all(usage == "REG:8" for _, usage in got)
    assert [arg for _, arg in calls] == ["-sass", "-res-usage"] * 2


def test_the_report_keeps_each_kernels_listings(tmp_path):
    """``llm-speed kernels --sass DIR``: each kernel's PTX, TTGIR and SASS, the SASS as the row read it."""
    from llm_speed.kernel_report import analysis, report

    result = report.run_report(gpu="h100-sxm", ops=["rms_norm"], workers=1, build=report.gpu_build(),
                               sass_dir=str(tmp_path), timeout=300)  # fmt: skip
    (row,) = result["rows"]
    assert row["error"] is None, row["error"]
    stem = tmp_path / f"000_{row['kernel']}"
    sass = (tmp_path / f"{stem.name}.sass").read_text()
    assert f"Function : _{row['kernel']}_kernel" in sass
    assert analysis.Sass.parse(sass).instructions and row["spill_instructions"] == 0
    assert ".visible .entry" in (tmp_path / f"{stem.name}.ptx").read_text()
    assert "tt.func" in (tmp_path / f"{stem.name}.ttgir").read_text()
