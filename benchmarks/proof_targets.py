#!/usr/bin/env python3
"""Issue 74's targets, read from one proof run's JSON: each row what is asked, what this run measured, and
whether it holds.

``run_gpu_suite.sh proof`` writes its headline rows as JSON into one folder (``benchmarks/gpu_bench.py``'s
proof sets and ``benchmarks/fused_kernel_time.py``); ``benchmarks/suite_summary.py`` puts this table at the
end of the proof's summary, and this script prints it for a committed results folder (the per-call rows
come from the suite's bench step, ``overhead.json`` of ``llm-speed bench overhead``, where the folder has
one measured on a GPU):

    python benchmarks/proof_targets.py benchmarks/results/h100-sxm/<commit>-proof            text
    python benchmarks/proof_targets.py --markdown benchmarks/results/h100-sxm/<commit>-proof a table

"holds": ``yes`` when every part of the target was measured and holds, ``no`` when a measured part does
not, ``-`` when a part was not measured (the proof does not time it, or the run did not reach it; a value that
is not a finite number counts as not measured; a file cut before its last case, ``complete: false``, is
named, and its row is never ``yes``). Ratios
are the other implementation's median time over ours (above 1: ours faster), from the same process.
The backward is not timed alone: its time is the forward + backward median minus the forward median, for
ours and cuDNN alike, its FLOPs 2.5x the forward's (FlashAttention-2's count: five matmuls to two).
Standard library only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

GUIDE_SEQS = (512, 1024, 2048, 4096, 8192)
D128_LABELS = ("full_mha", "full_gqa", "causal_mha", "causal_gqa")
GEMM_SQUARES = (512, 1024, 2048, 4096, 8192)
GEMM_TOKENS = (1, 16, 4096)
FUSED_OPS = ("rms_norm", "swiglu", "rotary")
BACKWARD_FLOPS_FACTOR = 2.5


@dataclasses.dataclass(frozen=True)
class Target:
    what: str
    target: str
    measured: str
    holds: bool | None  # None: not every part measured


def _device(raw: Path, name: str) -> str | None:
    """Where ``raw/name`` was measured (its environment's ``device_type``; None: no file, or it does not
    say). Only a GPU's rows judge a target: a CPU run of the suite (``SUITE_ALLOW_CPU=1``) writes the same
    files with CPU times and CPU-scaled sizes."""
    try:
        document = json.loads((raw / name).read_text())
        return (document.get("environment") or {}).get("device_type")
    except (OSError, ValueError, AttributeError):
        return None


def number(value: object) -> float | None:
    """``value`` as a finite float; None when it is missing, not a number (a str, a bool), NaN or infinite
    (not measured: NaN compares False both ways, so it would pass every bound). suite_summary's too."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _document(raw: Path, name: str) -> dict:
    """``raw/name`` as a JSON object ({} when it is missing, does not parse, or is not an object)."""
    try:
        document = json.loads((raw / name).read_text())
    except (OSError, ValueError):
        return {}
    return document if isinstance(document, dict) else {}


def _partial(raw: Path, name: str) -> bool:
    """Whether ``raw/name`` was cut before its last case (the bench commands write ``complete: false``
    after every case, ``true`` after the last)."""
    return _document(raw, name).get("complete") is False


def _results(raw: Path, name: str) -> list[dict]:
    """The rows of ``raw/name`` (empty when the run did not write it, it does not parse, or it was measured
    on another device than a GPU)."""
    document = _document(raw, name)
    results = document.get("results", [])
    environment = document.get("environment")
    if (environment if isinstance(environment, dict) else {}).get("device_type", "cuda") != "cuda":
        return []
    return [row for row in results if isinstance(row, dict)] if isinstance(results, list) else []


def _row(rows: list[dict], impl: str, case_end: str | None = None) -> dict | None:
    """The first measured row of ``impl`` (whose case ends with ``case_end``, when given)."""
    for row in rows:
        if row.get("impl") != impl or not row.get("available"):
            continue
        if case_end is not None and not str(row.get("case", "")).endswith(case_end):
            continue
        if _ms(row) is not None:
            return row
    return None


def _ms(row: dict | None) -> float | None:
    """The row's time, when it is a positive finite number (else not measured)."""
    if row is None:
        return None
    if "wall_ms" in row:  # fused_kernel_time.py
        value = number(row["wall_ms"])
    else:
        timing = row.get("timing")
        value = number(timing.get("median_ms")) if isinstance(timing, dict) else None
    return value if value is not None and value > 0 else None


def _ratio(other: dict | None, ours: dict | None) -> float | None:
    """other's median over ours (above 1: ours faster); None unless both were measured."""
    a, b = _ms(other), _ms(ours)
    return a / b if a is not None and b is not None else None


def _all(*parts: bool | None) -> bool | None:
    """A target of several parts: False when a measured part fails, None when one was not measured."""
    if any(part is False for part in parts):
        return False
    return None if any(part is None for part in parts) else True


def _at_least(value: float | None, bound: float) -> bool | None:
    value = number(value)
    return None if value is None else value >= bound


def _fmt(value: float | None, unit: str = "x", digits: int = 2) -> str:
    value = number(value)
    return "not measured" if value is None else f"{value:.{digits}f}{unit}"


def _span(ratios: dict[str, float], expected: int, at_least: float = 1.0) -> tuple[str, bool | None]:
    """'lo-hi over n of m points (worst: name)' (or 'not measured'), and whether every point is ``at_least``:
    False as soon as a measured one is below it, None while a point is missing (or not a finite number)."""
    ratios = {name: number(ratio) for name, ratio in ratios.items() if number(ratio) is not None}
    if not ratios:
        return "not measured", None
    worst = min(ratios, key=ratios.get)
    low, high = ratios[worst], max(ratios.values())
    text = f"{low:.2f}-{high:.2f}x over {len(ratios)} of {expected} points (worst: {worst})"
    return text, False if low < at_least else (True if len(ratios) == expected else None)


def attention_forward_16k(raw: Path) -> Target:
    rows = _results(raw, "attn_d128_fwd_full_mha_s16384.json")
    ours, cudnn = _row(rows, "flash"), _row(rows, "sdpa-cudnn")
    tflops = number(ours.get("tflops")) if ours else None
    ratio = _ratio(cudnn, ours)
    return Target("attention forward, d=128, 16k tokens, non-causal", ">= 620 TFLOP/s, >= 1.0x cuDNN",
                  f"{_fmt(tflops, ' TFLOP/s', 0)}, {_fmt(ratio)} cuDNN",
                  _all(_at_least(tflops, 620), _at_least(ratio, 1.0)))  # fmt: skip


def attention_forward_points(raw: Path) -> Target:
    names = [f"attn_d64_fwd_s{seq}.json" for seq in GUIDE_SEQS]
    names += [f"attn_d128_fwd_{label}_s16384.json" for label in D128_LABELS]
    ratios = {}
    for name in names:
        row = _row(_results(raw, name), "flash")
        if row is not None and row.get("speedup_vs_fastest_other") is not None:
            ratios[name.removesuffix(".json")] = row["speedup_vs_fastest_other"]
    text, holds = _span(ratios, len(names))
    return Target("attention forward, every point (d 64/128, seq 512-16k, causal or not, MHA/GQA)",
                  ">= 1.0x fastest SDPA backend", text, holds)  # fmt: skip


def attention_backward_16k(raw: Path) -> Target:
    forward = _results(raw, "attn_d128_fwd_full_mha_s16384.json")
    both = _results(raw, "attn_d128_fwd_bwd_full_mha_s16384.json")

    def backward_ms(impl: str) -> float | None:
        f, fb = _ms(_row(forward, impl)), _ms(_row(both, impl))
        return fb - f if f and fb and fb > f else None

    ours, cudnn = backward_ms("flash"), backward_ms("sdpa-cudnn")
    flash = _row(forward, "flash")
    tflops = None
    if ours and flash and number(flash.get("tflops")):
        tflops = BACKWARD_FLOPS_FACTOR * flash["tflops"] * _ms(flash) / ours
    ratio = cudnn / ours if ours and cudnn else None
    measured = f"{_fmt(tflops, ' TFLOP/s', 0)}, {_fmt(ratio)} cuDNN (fwd+bwd - fwd)"
    return Target("attention backward, d=128, 16k", ">= 540 TFLOP/s, >= 1.0x cuDNN", measured,
                  _all(_at_least(tflops, 540), _at_least(ratio, 1.0)))  # fmt: skip


def attention_forward_backward_guide(raw: Path) -> Target:
    ratios = {}
    for seq in GUIDE_SEQS:
        row = _row(_results(raw, f"attn_d64_fwd_bwd_s{seq}.json"), "flash")
        if row is not None and row.get("speedup_vs_fastest_other") is not None:
            ratios[f"seq {seq}"] = row["speedup_vs_fastest_other"]
    text, holds = _span(ratios, len(GUIDE_SEQS))
    return Target("attention forward + backward, guide's points (b2 h8 d64 fp16)", ">= 1.0x", text, holds)


def gemm_bf16(raw: Path) -> Target:
    names = [f"gemm_bf16_{size}.json" for size in GEMM_SQUARES]
    names += [f"gemm_bf16_llama3_8b_m{tokens}.json" for tokens in GEMM_TOKENS]
    ratios, missing = {}, []
    for name in names:
        rows = _results(raw, name)
        cases = list(dict.fromkeys(row.get("case") for row in rows if row.get("impl") == "llm-speed"))
        found = False
        for case in cases:
            ratio = _ratio(_row(rows, "torch", case), _row(rows, "llm-speed", case))
            if ratio is not None:
                ratios[f"{name.removesuffix('.json')} {case}"] = ratio
                found = True
        if not found:
            missing.append(name)
    if not ratios:
        return Target("bf16 GEMM, squares 512-8192 and Llama-3-8B shapes at M = 1, 16, 4096",
                      "geomean >= 0.95x cuBLAS, none < 0.85x", "not measured", None)  # fmt: skip
    geomean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    worst = min(ratios, key=ratios.get)
    text = f"geomean {geomean:.2f}x, lowest {ratios[worst]:.2f}x ({worst}), {len(ratios)} shapes"
    if missing:
        text += f"; not measured: {', '.join(missing)}"
    # a shape below 0.85x fails the row; the geomean is judged over every shape only
    lowest_holds = False if ratios[worst] < 0.85 else (None if missing else True)
    holds = _all(None if missing else geomean >= 0.95, lowest_holds)
    return Target("bf16 GEMM, squares 512-8192 and Llama-3-8B shapes at M = 1, 16, 4096",
                  "geomean >= 0.95x cuBLAS, none < 0.85x", text, holds)  # fmt: skip


def gemm_fp8_scaled(raw: Path) -> Target:
    rows = _results(raw, "gemm_fp8_4096.json")
    tensor = _ratio(_row(rows, "torch-scaled-mm", " tensor"), _row(rows, "llm-speed", " tensor"))
    row = _ratio(_row(rows, "torch-scaled-mm", " row"), _row(rows, "llm-speed", " row"))
    measured = f"4096^3: per tensor {_fmt(tensor)}, per row {_fmt(row)}; 8192x8192x4096 not in the proof"
    return Target("fp8 GEMM per tensor / per row, 4096^3 and 8192x8192x4096",
                  ">= 1.0x torch._scaled_mm (fast accumulation)", measured,
                  _all(_at_least(tensor, 1.0), _at_least(row, 1.0), None))  # fmt: skip


def gemm_fp8_blocks(raw: Path) -> Target:
    rows = _results(raw, "gemm_fp8_4096.json")
    ours = _row(rows, "llm-speed", " block")
    scaled = _ratio(_row(rows, "torch-scaled-mm", " block"), ours)
    if scaled is not None:
        measured, holds = f"4096^3: {scaled:.2f}x torch._scaled_mm", scaled >= 0.8
    else:
        bf16 = _ratio(_row(rows, "torch", " block"), ours)
        measured = f"4096^3: torch._scaled_mm not run with blocks; {_fmt(bf16)} bf16 torch.matmul"
        holds = None
    return Target("fp8 GEMM, 1x128 / 128x128 blocks", ">= 0.8x torch._scaled_mm", measured, holds)


COPY_SHARE = 0.85  # issue 74: memory-bound kernels at >= 85% of the measured copy bandwidth


def _copy(raw: Path) -> dict:
    """The copy bandwidth the proof measured (``fused_kernel_time.py``'s ``copy``: ``wall_gbps`` and
    ``kernel_gbps``, read + written bytes), on a GPU; {} when it was not."""
    try:
        document = json.loads((raw / "fused_kernel_time.json").read_text())
    except (OSError, ValueError):
        return {}
    environment = document.get("environment") if isinstance(document, dict) else None
    if not isinstance(environment, dict) or environment.get("device_type") != "cuda":
        return {}
    copy = document.get("copy")
    return copy if isinstance(copy, dict) else {}


def _share_of_copy(gbps: float | None, copy_gbps: float | None) -> tuple[str, bool | None]:
    """'2900 GB/s, 97% of copy' ('not measured'; no share without the copy) and whether the share is
    >= COPY_SHARE (None: either figure missing)."""
    gbps, copy_gbps = number(gbps), number(copy_gbps)
    if gbps is None:
        return "not measured", None
    if not copy_gbps:
        return f"{gbps:.0f} GB/s", None
    return f"{gbps:.0f} GB/s, {gbps / copy_gbps:.0%} of copy", gbps / copy_gbps >= COPY_SHARE


def decode_large_batch(raw: Path) -> Target:
    rows = _results(raw, "decode_bf16_b64_c4096.json")
    copy = _copy(raw).get("wall_gbps")  # decode's GB/s are bytes over its median wall time: the copy's too
    parts, holds = [], []
    for impl in ("kvcache", "kvcache-paged"):
        text, holds_ = _share_of_copy((_row(rows, impl) or {}).get("bandwidth_gb_s"), copy)
        parts.append(f"{impl} {text}")
        holds.append(holds_)
    measured = "; ".join(parts) + f" (batch 64; copy {_fmt(copy, ' GB/s', 0)})"
    return Target("decode, bf16, batch >= 64 x 4k, dense and 16-token pages",
                  ">= 85% of measured copy bandwidth", measured, _all(*holds))  # fmt: skip


def decode_small_batch(raw: Path) -> Target:
    ratios, graphs = {}, []
    for batch in (1, 8):
        rows = _results(raw, f"decode_bf16_b{batch}_c4096.json")
        sdpa = _row(rows, "sdpa")
        for impl in ("kvcache", "kvcache-paged"):
            ours = _row(rows, impl)
            ratio = _ratio(sdpa, ours)
            if ratio is not None:
                ratios[f"b{batch} {impl}"] = ratio
            if ours is not None and number(ours.get("graph_ms")):
                graphs.append(f"b{batch} {impl} {ours['graph_ms'] * 1e3:.1f} us")
    text, faster = _span(ratios, 4)
    text += "; CUDA graph step: " + (", ".join(graphs) if graphs else "not measured")
    holds = _all(faster, True if len(graphs) == 4 else None)
    return Target("decode, batch 1-8", ">= 1.0x SDPA; CUDA-graph step time reported", text, holds)


def fused_ops(raw: Path) -> Target:
    rows = _results(raw, "fused_kernel_time.json")
    copy = _copy(raw).get("kernel_gbps")  # the ops' GB/s are over the profiler's kernel time: the copy's too
    parts, faster = [], []
    for op in FUSED_OPS:
        mine = [row for row in rows if row.get("op") == op]
        ours = _row(mine, "llm_speed")
        if ours is None:
            parts.append(f"{op} not measured")
            faster.append(None)
            continue
        share, holds = _share_of_copy(ours.get("kernel_gbps"), copy)
        text = f"{op} {share} (kernel)"
        faster.append(holds)
        for other in ("torch.compile", "liger"):
            ratio = _ratio(_row(mine, other), ours)
            text += f", {_fmt(ratio)} {other}"
            faster.append(_at_least(ratio, 1.0))
        parts.append(text)
    measured = "; ".join(parts) + f" (copy {_fmt(copy, ' GB/s', 0)}, kernel time)"
    return Target("rms_norm, rotary, swiglu fwd+bwd at kernel-dominated sizes",
                  ">= 85% of copy bandwidth; faster than Liger and torch.compile", measured,
                  _all(*faster))  # fmt: skip


def linear_cross_entropy(raw: Path) -> Target:
    rows = _results(raw, "linear_cross_entropy.json")
    ours = _row(rows, "llm_speed")
    ratio = _ratio(_row(rows, "torch.compile"), ours)
    eager = _row(rows, "eager")
    peak = None
    if ours and eager and number(ours.get("peak_memory_bytes")) and number(eager.get("peak_memory_bytes")):
        peak = ours["peak_memory_bytes"] / eager["peak_memory_bytes"]
    return Target("linear cross-entropy, V 128256, N 8192, H 4096",
                  "time <= torch.compile's; peak <= 1/4 of unfused",
                  f"{_fmt(ratio)} torch.compile; peak {_fmt(peak, '', 3)} of eager's",
                  _all(_at_least(ratio, 1.0), None if peak is None else peak <= 0.25))  # fmt: skip


def train_step(raw: Path) -> Target:
    rows = _results(raw, "train_step_llama3_8b_2layers.json")
    ours, base, liger = _row(rows, "llm_speed"), _row(rows, "transformers"), _row(rows, "liger")
    speed, vs_liger = _ratio(base, ours), _ratio(liger, ours)
    peak = None
    if ours and base and number(ours.get("peak_memory_bytes")) and number(base.get("peak_memory_bytes")):
        peak = ours["peak_memory_bytes"] / base["peak_memory_bytes"]
    measured = f"{_fmt(speed)} transformers, {_fmt(vs_liger)} Liger, peak {_fmt(peak)}"
    return Target("train step, llama-3-8b 2 layers", ">= 1.3x unpatched transformers, >= Liger; peak <= 0.6x",
                  measured, _all(_at_least(speed, 1.3), _at_least(vs_liger, 1.0),
                                 None if peak is None else peak <= 0.6))  # fmt: skip


WRAPPERS = ("flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache")


def _overhead(raw: Path) -> tuple[list[dict], str | None]:
    """``overhead.json`` of the suite's bench step (``llm-speed bench overhead``): its rows, and why they
    judge no GPU target (None when they do: measured on a GPU)."""
    document = _document(raw, "overhead.json")
    if not document:
        return [], "not measured by the proof (`llm-speed bench overhead`, the suite's bench step)"
    environment = document.get("environment")
    device = (environment if isinstance(environment, dict) else {}).get("device_type")
    results = document.get("results")
    rows = [row for row in results if isinstance(row, dict)] if isinstance(results, list) else []
    return rows, None if device == "cuda" else f"overhead.json was measured on {device}, not a GPU"


def per_call(raw: Path) -> Target:
    what, target = "per call, tiny problems (inference / autograd / training)", "<= 1.3x PyTorch's equivalent"
    rows, refused = _overhead(raw)
    if refused:
        return Target(what, target, refused, None)
    parts, holds = [], []
    for mode in ("inference", "autograd", "training"):
        judged = [row for row in rows if row.get("mode") == mode and row.get("meets_target") is not None
                  and row.get("case") not in WRAPPERS]  # fmt: skip
        if judged:
            met = sum(bool(row["meets_target"]) for row in judged)
            parts.append(f"{mode} {met}/{len(judged)} rows")
            holds.append(met == len(judged))
    return Target(what, target, ", ".join(parts) + " meet it" if parts else "no row with a target",
                  _all(*holds) if holds else None)  # fmt: skip


# issue 37's head dims, each against the next multiple of 16 above it (the proof's attention set times all
# four at the same shape: benchmarks/gpu_bench.py HEAD_DIMS)
HEAD_DIM_PAIRS = ((80, 96), (96, 112), (111, 112))


def _hdim_name(head_dim: int) -> str:
    return f"attn_hdim{head_dim}_fwd_s4096.json"


def head_dims(raw: Path) -> tuple[str, bool | None]:
    """'d80 1.02x, ...' (the next multiple's median time over this head dim's: above 1, ours faster) and
    whether each head dim is not slower: its median no higher than the next multiple's 80th percentile (the
    spread of that one run), None while a pair is missing."""
    parts, holds = [], []
    for head_dim, other in HEAD_DIM_PAIRS:
        ours, theirs = (_row(_results(raw, _hdim_name(d)), "flash") for d in (head_dim, other))
        ratio = _ratio(theirs, ours)
        if ratio is None:
            parts.append(f"d{head_dim} not measured")
            holds.append(None)
            continue
        timing = theirs.get("timing") if isinstance(theirs.get("timing"), dict) else {}
        spread = number(timing.get("p80_ms")) or _ms(theirs)
        parts.append(f"d{head_dim} {ratio:.2f}x d{other}")
        holds.append(_ms(ours) <= spread)
    return ", ".join(parts), _all(*holds)


def wrappers(raw: Path) -> Target:
    what = "flash-attn interface wrappers; head dims 80/96/111"
    target = "within 1.1x of llm-speed's entry points; no slower than the next multiple of 16"
    dims, dims_hold = head_dims(raw)
    rows, refused = _overhead(raw)
    if refused:
        return Target(what, target, f"wrappers {refused}; head dims {dims}", _all(None, dims_hold))
    ratios = {f"{row['case']} {row.get('mode')}": number(row.get("vs_baseline")) for row in rows
              if row.get("case") in WRAPPERS and number(row.get("vs_baseline")) is not None}  # fmt: skip
    text, _ = _span(ratios, len(ratios))
    high = max(ratios.values()) if ratios else None
    return Target(what, target, f"per call {text}; head dims {dims}",
                  _all(None if high is None else high <= 1.1, dims_hold))  # fmt: skip


def attention_fp8(raw: Path) -> Target:
    """The fp8 forward's ``vs_flash`` (our bf16 forward's median over its own, same process)."""
    fp8 = _row(_results(raw, "attn_d128_fp8_fwd_full_mha_s16384.json"), "flash-fp8")
    ratio = None if fp8 is None else number(fp8.get("vs_flash"))
    tflops = None if fp8 is None else number(fp8.get("tflops"))
    return Target("fp8 attention forward, d=128 16k", ">= 1.4x our bf16 forward",
                  f"{_fmt(ratio)} our bf16 forward ({_fmt(tflops, ' TFLOP/s', 0)})",
                  _at_least(ratio, 1.4))  # fmt: skip


def decode_fp8_cache(raw: Path) -> Target:
    """Each fp8-cache row's ``vs_16bit_cache`` (the 16-bit cache's median over its own, same layout and
    process: at one batch, its tokens/s ratio)."""
    rows = _results(raw, "decode_fp8_cache_b64_c4096.json")
    parts, holds = [], []
    for impl in ("kvcache-fp8", "kvcache-paged-fp8"):
        row = _row(rows, impl)
        ratio = None if row is None else number(row.get("vs_16bit_cache"))
        parts.append(f"{impl} {_fmt(ratio)}")
        holds.append(_at_least(ratio, 1.7))
    return Target("fp8-cache decode, batch >= 64 x 4k", ">= 1.7x tokens/s of the 16-bit cache",
                  ", ".join(parts) + " the 16-bit cache (batch 64)", _all(*holds))  # fmt: skip


def _not_in_proof(what: str, target: str, where: str) -> Target:
    return Target(what, target, f"not measured by the proof ({where})", None)


def _files() -> dict:
    """The JSON files each measured row reads (a row none of whose files the run wrote says so)."""
    guide = tuple(f"attn_d64_fwd_s{seq}.json" for seq in GUIDE_SEQS)
    d128 = tuple(f"attn_d128_fwd_{label}_s16384.json" for label in D128_LABELS)
    gemm = tuple(f"gemm_bf16_{size}.json" for size in GEMM_SQUARES)
    gemm += tuple(f"gemm_bf16_llama3_8b_m{tokens}.json" for tokens in GEMM_TOKENS)
    return {
        attention_forward_16k: ("attn_d128_fwd_full_mha_s16384.json",),
        attention_forward_points: guide + d128,
        attention_backward_16k: (d128[0], "attn_d128_fwd_bwd_full_mha_s16384.json"),
        attention_forward_backward_guide: tuple(f"attn_d64_fwd_bwd_s{seq}.json" for seq in GUIDE_SEQS),
        gemm_bf16: gemm,
        gemm_fp8_scaled: ("gemm_fp8_4096.json",),
        gemm_fp8_blocks: ("gemm_fp8_4096.json",),
        attention_fp8: ("attn_d128_fp8_fwd_full_mha_s16384.json",),
        decode_large_batch: ("decode_bf16_b64_c4096.json",),
        decode_small_batch: ("decode_bf16_b1_c4096.json", "decode_bf16_b8_c4096.json"),
        decode_fp8_cache: ("decode_fp8_cache_b64_c4096.json",),
        fused_ops: ("fused_kernel_time.json",),
        linear_cross_entropy: ("linear_cross_entropy.json",),
        train_step: ("train_step_llama3_8b_2layers.json",),
    }


def files_read() -> set[str]:
    """Every JSON file name the table reads (a test holds them to what the proof writes)."""
    heads = {_hdim_name(d) for pair in HEAD_DIM_PAIRS for d in pair}
    return heads | {name for names in _files().values() for name in names}


def table(raw: Path) -> list[Target]:
    """Every row of issue 74's target table, from the JSON in ``raw``."""
    measured = []
    for row, names in _files().items():
        found = row(raw)
        shown = names[0] if len(names) == 1 else f"{names[0]} ... ({len(names)} files)"
        devices = {_device(raw, name) for name in names if (raw / name).is_file()}
        if not devices:
            found = dataclasses.replace(found, measured=f"not measured (no {shown})", holds=None)
        elif "cuda" not in devices and None not in devices:
            where = ", ".join(sorted(devices))
            found = dataclasses.replace(found, measured=f"{shown} measured on {where}, not a GPU", holds=None)
        partial = [name for name in names if _partial(raw, name)]
        if partial:  # judged on the cases it has: a failing one still fails, but "yes" needs every case
            text = f"{found.measured}; partial file: cut before its last case ({', '.join(partial)})"
            found = dataclasses.replace(found, measured=text, holds=False if found.holds is False else None)
        measured.append(found)
    return [
        *measured,
        _not_in_proof("fused MoE fwd+bwd, 8k tokens", ">= 0.9x torch._grouped_mm code; >= 15x the HF loop",
                      "`llm-speed bench moe`, the suite's fused step"),
        per_call(raw),
        wrappers(raw),
    ]  # fmt: skip


HOLDS = {True: "yes", False: "no", None: "-"}


def text_lines(rows: list[Target]) -> list[str]:
    return [f"  {HOLDS[row.holds]:<3} {row.what}: {row.measured} (target {row.target})" for row in rows]


def markdown(rows: list[Target]) -> str:
    lines = ["| what | target | measured | holds |", "| --- | --- | --- | --- |"]
    lines += [f"| {row.what} | {row.target} | {row.measured} | {HOLDS[row.holds]} |" for row in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path, help="a proof's results folder (its JSON files, flat)")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args(argv)
    if not args.folder.is_dir():
        parser.error(f"folder: {args.folder} is not a directory")
    rows = table(args.folder)
    print(markdown(rows) if args.markdown else "\n".join(text_lines(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
