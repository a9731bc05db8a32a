"""The GEMM cost model: llm-speed's tile choice restated (:func:`gemm_config_choice`, the same rule as
``llm_speed.core.tile_choice``), split-K choices, weight-only dequantization, and the GEMM terms."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llm_speed.core.args import check_choice, non_negative_number, positive_int, positive_ints
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.core.intmath import cdiv
from llm_speed.core.tile_choice import choose_tile, fits_block_scaling
from llm_speed.perf._checks import check_dtype
from llm_speed.perf.kernel_costs import (
    gemm_cost,
)
from llm_speed.perf.prediction.calibration_data import GPUConstants
from llm_speed.perf.prediction.names import FITTED_DTYPES, GEMM_OP_DTYPES, check_computes_in, gemm_op_for
from llm_speed.perf.prediction.terms import (
    Terms,
    memory_time,
    no_more,
    pop_flag,
    tensor_core_efficiency,
    uniform_makespan,
)


def gemm_config_choice(m: int, n: int, k: int, tiles: Sequence[Sequence[int]], sms: int, batch: int = 1,
                       element_bytes: int = 2, decode_tiles: Sequence[Sequence[int]] = ()):  # fmt: skip
    """The tile llm-speed's launcher picks among ``tiles`` and its ``decode_tiles``
    (``llm_speed.matmul.gemm_configs.gemm_config``'s rule, :func:`llm_speed.core.tile_choice.choose_tile`)."""
    pool = [tuple(t) for t in tiles] + [tuple(t) for t in decode_tiles]
    decode_only = range(len(tiles), len(pool))
    return pool[choose_tile(m, n, k, pool, sms, batch=batch, element_bytes=element_bytes,
                            decode_only=decode_only)]  # fmt: skip


def gemm_terms(
    params: dict[str, Any],
    consts: GPUConstants,
    *,
    m: int,
    n: int,
    k: int,
    batch: int,
    peak: float,
    in_bytes: float,
    b_bytes: float,
    out_bytes: float,
    extra_bytes: float,
    tile: Sequence[int],
    split: int,
    dequant: dict[str, float] | None,
    step_s: float = 0.0,
) -> Terms:
    """One GEMM (one tile shape, split-K ``split``): the tiles' waves on the tensor cores, the DRAM and L2
    traffic, and (weight-only quantized B) the dequantization on the CUDA cores. ``step_s``: seconds a
    program spends per K step beyond its products (:func:`fp8_step_seconds`)."""
    bm, bn, bk = int(tile[0]), int(tile[1]), int(tile[2])
    warps = int(tile[3]) if len(tile) > 3 else 8
    sms = consts.spec.sm_count
    tiles = cdiv(m, bm) * cdiv(n, bn) * batch * split
    k_steps = cdiv(cdiv(k, split), bk)
    intensity = bm * bn / (bm + bn)
    eta = (
        tensor_core_efficiency(params, bm, bn, warps)
        * intensity
        / (intensity + float(params.get("tile_half", 0.0)))
    )
    per_sm = peak / sms
    tile_s = 2.0 * bm * bn * bk * (k_steps + float(params.get("tile_steps", 0.0))) / (per_sm * eta)
    tile_s += float(params.get("tile_s", 0.0)) + step_s * k_steps
    compute, programs, waves, wave_eff = uniform_makespan(tile_s, tiles, sms)
    # Traffic: A and B once, the output once (the minimum); A re-read per column of tiles, B per row of
    # tiles: what misses the L2 goes to DRAM, the rest is served by the L2.
    a_bytes = batch * m * k * in_bytes
    w_bytes = batch * k * n * b_bytes if batch > 1 else k * n * b_bytes
    minimum = a_bytes + w_bytes + batch * m * n * out_bytes + extra_bytes
    rereads = a_bytes * (cdiv(n, bn) - 1) + w_bytes * (cdiv(m, bm) - 1)
    miss = float(params.get("l2_miss", 0.0))
    dram = minimum + miss * rereads
    l2 = (1.0 - miss) * rereads
    kernels = 1
    if split > 1:  # fp32 partial tiles written and read back by a second (reduce) kernel
        partial = 2.0 * split * batch * m * n * 4
        dram += partial
        kernels = 2
    memory, rate = memory_time(params, consts, dram, l2, min(tiles, sms))
    dequant_s = 0.0
    if dequant:
        # Each tile row of B is dequantized once per row of tiles (once for a decode GEMV).
        weights = batch * k * n * cdiv(m, bm) if batch > 1 else k * n * cdiv(m, bm)
        dequant_s = weights * dequant["ops_per_weight"] / dequant["ops_per_s"]
        memory = with_dequant(memory, dequant_s, dequant["overlap"])
    latency = kernels * float(params.get("latency_s", 0.0))
    return Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=latency,
        dram_bytes=dram,
        l2_bytes=l2,
        bandwidth=rate,
        eta=eta,
        tile=(bm, bn, bk, warps),
        split_k=split,
        programs=programs,
        waves=waves,
        wave_efficiency=wave_eff,
        kernels=kernels,
        dequant_s=dequant_s,
    )


def _split_choices(params: dict[str, Any], m: int, n: int, k: int, batch: int, tile, sms: int) -> list[int]:
    """Split-K factors an implementation may use: 1, and (``split_k``) the powers of two that bring the
    tile count up to about the SM count while each part keeps at least ``min_split_k`` of K."""
    if not params.get("split_k"):
        return [1]
    tiles = cdiv(m, tile[0]) * cdiv(n, tile[1]) * batch
    minimum = int(params.get("min_split_k", 256))
    choices, split = [1], 2
    while split <= 32 and tiles * split <= 2 * sms and k // split >= minimum:
        choices.append(split)
        split *= 2
    return choices


# Weight-only quantized GEMMs (the B operand stored as int8/int4, dequantized to the compute dtype).
# "convert": each weight goes through an int->float conversion instruction (16 per clock per SM: the
# torch.compile / gpt-fast kernels); "lop3": Marlin's bit tricks (int4 -> fp16 with LOP3 and one fp16
# subtract/FMA per pair, ~1 full-rate CUDA-core op per weight; Frantar & Alistarh, IST-DASLab/marlin).
DEQUANT_METHODS = ("convert", "lop3")


def dequant_terms(
    consts: GPUConstants, params: dict[str, Any], method: str, weight_dtype: str
) -> dict[str, float]:
    """The dequantization of ``weight_dtype`` weights by ``method``: ``ops_per_weight``, ``ops_per_s`` (the
    units that run them) and ``overlap`` with the weight stream (:func:`with_dequant`)."""
    table = params.get("dequant", {}).get(method)
    if table is None:
        raise ValueError(f"dequant {method!r} has no parameters; accepted: {', '.join(DEQUANT_METHODS)}")
    ops = float(table.get("ops_per_weight", {}).get(weight_dtype, table.get("ops_per_weight_default", 1.0)))
    rate = consts.conversions_per_s if method == "convert" else consts.alu_per_s
    return {"ops_per_weight": ops, "ops_per_s": rate, "overlap": float(table["overlap"])}


def with_dequant(memory_s: float, dequant_s: float, overlap: float) -> float:
    """A quantized weight stream's time with its dequantization on the CUDA cores: the longer of the two,
    plus the part of the shorter that does not overlap it (``overlap`` in [0, 1])."""
    return max(memory_s, dequant_s) + (1.0 - overlap) * min(memory_s, dequant_s)


# fp8 GEMMs (gemm_fp8, torch._scaled_mm): the scaling granularities (llm_speed.bench's names: per tensor, per
# row, 1x128 / 128x128 blocks) and the operand layouts (NT: A row-major, B [N, K], both K-major as 8-bit wgmma
# reads them: nn.Linear's x @ W^T and torch._scaled_mm's layout).
FP8_SCALINGS = ("tensor", "row", "block")
FP8_LAYOUTS = ("NN", "NT", "TN", "TT")
# What a build's fp8 GEMM runs (calibration "builds": "fp8_gemm"), where its entry does not say:
# "tensor": "pipelined" (the per-row kernel with stride-0 scales, since eafec86) or "serialized" (ptxas
# serialized the wgmma of the earlier per-tensor epilogue: ``serialized_step_s`` per K step); "block":
# "serial" (each K step's product waited for and scaled on the CUDA cores before it joins the accumulator:
# ``block_step_s`` per K step) or "halves" (5c18b0d: the tile's two column halves alternate so the left
# half's scaling runs beside the right half's product in flight, the right half's still alone: the serial
# cost less ``halves_hidden`` of it, an assumption read off the schedule, not fitted; docs/fp8.md);
# "operands": "copied" (an operand that is not K-major is copied K-major first, since 6abe431) or "in_kernel"
# (read N-major by the kernel: not modelled).
FP8_GEMM_DEFAULTS = {"tensor": "pipelined", "block": "serial", "operands": "copied"}


def fp8_kernel(build: dict[str, Any]) -> dict[str, str]:
    """The fp8 GEMM kernel a build runs (:data:`FP8_GEMM_DEFAULTS` completed by its ``fp8_gemm``; a build
    whose entry has none, one older than the measured fp8 kernels, is priced as the defaults and labelled
    uncalibrated: ``described`` "no")."""
    described = "yes" if "fp8_gemm" in build else "no"
    return {**FP8_GEMM_DEFAULTS, "described": described, **build.get("fp8_gemm", {})}


def fp8_step_seconds(params: dict[str, Any], kernel: dict[str, str], scaling: str) -> float:
    """Seconds per K step per program an fp8 GEMM spends beyond its products: block scaling's wait and rescale
    (``block_step_s``), or a per-tensor kernel whose wgmma ptxas serialized (``serialized_step_s``)."""
    if scaling == "block":
        hidden = float(params.get("halves_hidden", 0.0)) if kernel["block"] == "halves" else 0.0
        return float(params.get("block_step_s", 0.0)) * (1.0 - hidden)
    if scaling == "tensor" and kernel["tensor"] == "serialized":
        return float(params.get("serialized_step_s", 0.0))
    return 0.0


def fp8_uncalibrated(kernel: dict[str, str], scaling: str, layout: str) -> str | None:
    """Why an llm-speed fp8 GEMM's prediction is not calibrated for this build, scaling and layout (None:
    it is)."""
    if kernel["described"] == "no":
        return ("the build's entry does not say which fp8 GEMM kernels it ran (none measured: priced as "
                "today's)")  # fmt: skip
    if layout != "NT" and kernel["operands"] == "in_kernel":
        return ("the build reads an operand that is not K-major in the kernel (8-bit wgmma reads K-major "
                "only): not modelled")  # fmt: skip
    if scaling == "block" and kernel["block"] == "halves":
        return ("the block-scaled kernel with alternating column halves (5c18b0d) has not run on a GPU: "
                "priced as the measured serial one with half its rescale hidden, as its schedule "
                "reads")  # fmt: skip
    return None


def k_major_copies(m: int, n: int, k: int, batch: int, layout: str) -> float:
    """Bytes an fp8 GEMM's copies of non-K-major operands read and write (A column-major: layout T.; B [K, N]
    row-major: layout .N), one byte per element, each read once and written once."""
    a = batch * m * k if layout[0] == "T" else 0
    b = k * n * (batch if batch > 1 else 1) if layout[1] == "N" else 0
    return 2.0 * (a + b)


def predict_gemm(op, spec, consts, impl, params, build, problem) -> tuple[Terms, float, float, dict]:
    m = positive_int("m", problem.pop("m"))
    n = positive_int("n", problem.pop("n"))
    k = positive_int("k", problem.pop("k"))
    batch = positive_int("batch", problem.pop("batch", 1))
    default_dtype = {"tensor_core_gemm_int8": "int8", "gemm_fp8": "fp8"}.get(op, "bf16")
    dtype = normalize_dtype(problem.pop("dtype", default_dtype))
    accepted = GEMM_OP_DTYPES[op] + (("fp64",) if op == "gemm" and impl == "cublas" else ())
    other = gemm_op_for(dtype)
    hint = f"; {dtype} is {other}'s" if dtype in GEMM_OP_DTYPES[other] else ""
    check_computes_in(op, impl, dtype, accepted, hint)
    out_dtype = problem.pop("out_dtype", None)
    out_dtype = None if out_dtype is None else check_dtype("out_dtype", out_dtype)
    if dtype == "int8" and out_dtype is None:
        out_dtype = "fp32"  # int32 results: 4 bytes
    if dtype == "fp8" and out_dtype is None:
        out_dtype = "bf16"  # scaled fp8 GEMMs return bf16 by default
    with_bias, with_c = pop_flag(problem, "with_bias"), pop_flag(problem, "with_c")
    weight_dtype = problem.pop("weight_dtype", None)
    weight_dtype = None if weight_dtype is None else check_dtype("weight_dtype", weight_dtype)
    group_size = problem.pop("group_size", None)
    scale_bytes = non_negative_number("scale_bytes", problem.pop("scale_bytes", 2.0))
    dequant_method = problem.pop("dequant", None)
    tile_override = problem.pop("tile", None)
    if tile_override is not None:
        tile_override = positive_ints("tile", tile_override, lengths=(3, 4), what="BM, BN, BK[, warps]")
    scaling, layout, kernel = None, "NT", None
    if op == "gemm_fp8":
        scaling = check_choice("scaling", problem.pop("scaling", "tensor"), FP8_SCALINGS)
        layout = check_choice("layout", problem.pop("layout", "NT"), FP8_LAYOUTS)
        kernel = fp8_kernel(build)
    no_more(problem, op)
    cost = gemm_cost(
        m, n, k, dtype=dtype, batch=batch, out_dtype=out_dtype, with_c=with_c, with_bias=with_bias
    )
    in_bytes = dtype_bytes(dtype)
    out_bytes = in_bytes if out_dtype is None else dtype_bytes(out_dtype)
    b_bytes, dequant = in_bytes, None
    if weight_dtype is not None and normalize_dtype(weight_dtype) != dtype:
        weight_dtype = normalize_dtype(weight_dtype)
        b_bytes = dtype_bytes(weight_dtype) + (
            scale_bytes / positive_int("group_size", group_size) if group_size is not None else 0.0
        )
        method = dequant_method or params.get("dequant_default", "convert")
        dequant = dequant_terms(consts, params, method, weight_dtype)
        cost_bytes = cost.bytes_moved - k * n * in_bytes * (batch if batch > 1 else 1) + k * n * b_bytes
        cost = type(cost)(cost.flops, cost_bytes)
    extra = 0.0
    if with_bias:
        extra += n * out_bytes
    if with_c:
        extra += batch * m * n * out_bytes
    peak = spec.peak_flops(dtype)
    sms = spec.sm_count
    candidates = [tuple(t) for t in params["tiles"]]
    if scaling == "block" and impl == "llm-speed":  # the launcher's rule: two fp32 tiles live
        fits = [t for t in candidates if fits_block_scaling(t[0], t[1], t[3] if len(t) > 3 else 8)]
        candidates = fits or candidates
    step_s = fp8_step_seconds(params, kernel, scaling) if kernel else 0.0
    rule = build.get("gemm_tile_rule", params.get("tile_rule", "best"))
    if tile_override is not None:
        candidates = [tile_override]
    elif rule == "gemm_config":
        candidates = [
            gemm_config_choice(
                m,
                n,
                k,
                candidates,
                sms,
                batch,
                element_bytes=in_bytes,
                decode_tiles=params.get("decode_tiles", ()),
            )
        ]
    best = None
    for tile in candidates:
        for split in _split_choices(params, m, n, k, batch, tile, sms):
            terms = gemm_terms(
                params,
                consts,
                m=m,
                n=n,
                k=k,
                batch=batch,
                peak=peak,
                in_bytes=in_bytes,
                b_bytes=b_bytes,
                out_bytes=out_bytes,
                extra_bytes=extra,
                tile=tile,
                split=split,
                dequant=dequant,
                step_s=step_s,
            )
            total = terms.device
            if best is None or total < best[0]:
                best = (total, terms)
    terms, info = best[1], {"dtype": dtype}
    if op in ("gemm", "tensor_core_gemm") and dtype not in FITTED_DTYPES:
        info["uncalibrated"] = (f"the GEMM fit uses fp16 and bf16 points only: {dtype} priced at its peak "
                                "with their parameters")  # fmt: skip
    if kernel is not None:
        copies = k_major_copies(m, n, k, batch, layout)
        if copies and kernel["operands"] == "copied":  # one more kernel before the GEMM, at the copy rate
            copy_s = copies / (consts.copy_bytes_per_s * float(params.get("bandwidth_efficiency", 1.0)))
            notes = (*terms.notes, f"{copies / 1e6:.1f} MB of K-major operand copies: {copy_s * 1e6:.1f} us")
            latency = terms.latency_s + copy_s + float(params.get("latency_s", 0.0))
            terms = replace(terms, latency_s=latency, dram_bytes=terms.dram_bytes + copies,
                            kernels=terms.kernels + 1, notes=notes)  # fmt: skip
        info["uncalibrated"] = fp8_uncalibrated(kernel, scaling, layout) if impl == "llm-speed" else None
    return terms, cost.flops, cost.bytes_moved, info
