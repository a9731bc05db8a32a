"""Calibrated predictions: what a kernel will take on a GPU, which resource bounds it, and why.

The roofline (:mod:`llm_speed.perf.roofline`) gives floors: datasheet peaks, every byte read once. A floor
does not say what a kernel takes. :func:`predict` does, for every row of the op table (``llm_speed.ops``)
and a few operations outside it (``all_reduce``), for llm-speed's implementation and the vendor's (cuBLAS,
each SDPA backend, eager PyTorch). Its time is built from four terms, each a piece of hardware:

* **achievable compute**: the work of each program (a GEMM output tile, an attention query block) on one
  SM's tensor cores at an efficiency that depends on the tile: ``eta * N / (N + n_half)`` for a tensor-core
  instruction of width N (narrower when Triton splits N across warpgroups of fewer than 64 rows each),
  times ``sync`` below 64 rows (Hopper's wgmma needs 64; narrower tiles run mma.sync); where the
  calibration has the kernel compiled (``compiled``: registers, spills, occupancy from the sm_90a build),
  ``spill_s`` per register spill instruction in its loop and the compiler's programs per SM; plus, for
  attention, the exponentials on
  the SM's special-function units (16 per clock per SM, CUDA C++ Programming Guide, arithmetic instruction
  throughput: 3.9 TFLOP/s on an H100 SXM beside 989 of tensor cores, FlashAttention-3 paper, section 3)
  with its CUDA-core bookkeeping (``alu_per_score``), of which the part not overlapped with the matmuls
  (``overlap_single`` with one warpgroup per SM, ``overlap_multi`` with more: :func:`occupancy`) adds;
  each block waits at least for its prefetched tile loads (``load_s`` over the pipeline depth); plus a
  fixed cost per block iteration and per program. Programs are spread over the SMs in waves
  (:func:`makespan`: the last wave's idle SMs count, the wave quantization of
  :mod:`llm_speed.perf.gemm_tiling`); attention's programs of unequal length (causal masks) in their
  launch order, each SM taking the next as it frees (:func:`list_schedule`, :func:`launch_order`).
* **achievable bandwidth**: DRAM traffic (the minimum bytes of :mod:`llm_speed.perf.kernel_costs`, plus
  the tile re-reads that miss the L2: ``l2_miss``) at the *measured* copy bandwidth times
  ``bandwidth_efficiency``, capped by what the SMs that have a program can pull (``sm_bandwidth`` each);
  plus a ramp ``memory_latency_s``. Tile re-reads that hit the L2 still cross it: ``l2_bytes_per_s`` bounds
  them.
* **fixed per-call cost**: ``latency_s`` (launch and the kernel's own start and end on the device) and the
  host path ``host_s`` (Python, argument checks, the driver call). Under ``llm-speed bench`` timing (an L2
  flush runs before each timed call, ``context="bench"``) the host path overlaps the flush and the device
  time: the call takes ``max(device, host - flush)``; back to back (``context="stream"``) ``max(device,
  host)``; alone (``context="isolated"``) their sum; replayed from a CUDA graph (``context="graph"``) the
  device time alone.
* whichever term is largest names the **bound**: "compute", "memory" or "latency".

The parameters are per (GPU, implementation) in one data file, ``calibration.json`` next to this module,
with the measurements that set each one (:mod:`llm_speed.perf.calibrate` fits them from a results
directory: ``llm-speed predict --calibrate benchmarks/results/h100-sxm``). A GPU without its own entry gets
the H100's efficiencies applied to its own datasheet figures, and the prediction says so
(``calibrated=False``). Nothing here imports torch.

This module holds the entry points (:func:`predict`, :func:`predict_call`, :func:`predict_work`); the parts
they use are in :mod:`llm_speed.perf.prediction` by role: the names and result types (``names``), the
calibration data (``calibration_data``), the shared building blocks (``terms``) and one cost model per op
family (``gemm``, ``attention``, ``elementwise``, ``moe``, ``collectives``), their public names re-exported
here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from llm_speed.core.args import type_name
from llm_speed.core.gpus import GPUSpec, get_gpu, normalize_dtype
from llm_speed.perf.prediction.attention import (
    BACKWARD_FACTOR,
    EAGER_SOFTMAX_PASSES,
    LPT_MIN_ROWS,
    AttentionShape,
    compiled_key,
    key_blocks,
    launch_order,
    lpt_section,
    predict_attention,
    query_blocks,
)
from llm_speed.perf.prediction.calibration_data import (
    CALIBRATION_ENV,
    CALIBRATION_FILE,
    CONVERSIONS_PER_CLOCK_PER_SM,
    REFERENCE_GPU,
    SFU_OPS_PER_CLOCK_PER_SM,
    THREADS_PER_WARP,
    WARPS_PER_WARPGROUP,
    WGMMA_ROWS,
    GPUConstants,
    build_entry,
    gpu_constants,
    host_table,
    load_calibration,
    parameters,
    same_commit,
)
from llm_speed.perf.prediction.collectives import (
    all_reduce_figures,
    predict_all_reduce,
)
from llm_speed.perf.prediction.elementwise import (
    elementwise_cost,
    predict_cross_entropy,
    predict_elementwise,
)
from llm_speed.perf.prediction.gemm import (
    DEQUANT_METHODS,
    dequant_terms,
    gemm_config_choice,
    predict_gemm,
    with_dequant,
)
from llm_speed.perf.prediction.moe import (
    grouped_tile,
    predict_moe,
)
from llm_speed.perf.prediction.names import (
    ALIASES,
    ATTENTION_OPS,
    BOUNDS,
    COLLECTIVE_OPS,
    CONTEXTS,
    CROSS_ENTROPY_OPS,
    ELEMENTWISE_OPS,
    FITTED_DTYPES,
    FP8_GEMM_SECTION,
    GEMM_OPS,
    MOE_OPS,
    NOT_FITTED,
    OPS,
    SDPA_BACKENDS,
    UNMEASURED_OPS,
    UNMODELLED,
    VENDOR,
    Breakdown,
    Prediction,
    attention_dtypes,
    check_computes_in,
    family_of,
    implementations,
    resolve_implementation,
    sdpa_default_backend,
)
from llm_speed.perf.prediction.terms import (
    KernelPass,
    Problem,
    Terms,
    block_time,
    check_context,
    host_exposed,
    host_path_seconds,
    list_schedule,
    makespan,
    memory_time,
    no_more,
    occupancy,
    tensor_core_efficiency,
)
from llm_speed.perf.roofline import roofline

# The public names of the parts, importable from here as before the split.
__all__ = [
    "ALIASES",
    "ATTENTION_OPS",
    "AttentionShape",
    "BACKWARD_FACTOR",
    "BOUNDS",
    "Breakdown",
    "CALIBRATION_ENV",
    "CALIBRATION_FILE",
    "COLLECTIVE_OPS",
    "CONTEXTS",
    "CONVERSIONS_PER_CLOCK_PER_SM",
    "CROSS_ENTROPY_OPS",
    "DEQUANT_METHODS",
    "EAGER_SOFTMAX_PASSES",
    "ELEMENTWISE_OPS",
    "FP8_GEMM_SECTION",
    "GEMM_OPS",
    "GPUConstants",
    "KernelPass",
    "LPT_MIN_ROWS",
    "MOE_OPS",
    "NOT_FITTED",
    "OPS",
    "Prediction",
    "REFERENCE_GPU",
    "SDPA_BACKENDS",
    "SFU_OPS_PER_CLOCK_PER_SM",
    "THREADS_PER_WARP",
    "UNMEASURED_OPS",
    "UNMODELLED",
    "VENDOR",
    "WARPS_PER_WARPGROUP",
    "WGMMA_ROWS",
    "all_reduce_figures",
    "block_time",
    "build_entry",
    "compiled_key",
    "elementwise_cost",
    "family_of",
    "dequant_model",
    "dequant_terms",
    "gemm_config_choice",
    "with_dequant",
    "gpu_constants",
    "grouped_tile",
    "host_table",
    "implementations",
    "key_blocks",
    "launch_order",
    "list_schedule",
    "load_calibration",
    "lpt_section",
    "makespan",
    "occupancy",
    "parameters",
    "predict",
    "predict_call",
    "predict_work",
    "query_blocks",
    "resolve_implementation",
    "same_commit",
    "tensor_core_efficiency",
]


def predict(
    op: str,
    gpu: str | GPUSpec,
    *,
    implementation: str = "llm-speed",
    context: str = "bench",
    build: str | None = None,
    calibration: Any = None,
    **problem: Any,
) -> Prediction:
    """The time ``implementation`` of ``op`` takes on ``gpu`` for ``problem``, its bound and why.

    ``op``: a row of the op table (``llm_speed.ops.names()``) or "all_reduce". ``implementation``:
    "llm-speed", "vendor" (cuBLAS for GEMMs, torch's default SDPA backend for attention, eager PyTorch for
    the fused ops, NCCL's NVLS for all-reduce), or a name of :func:`implementations`. ``context``: "bench"
    (as ``llm-speed bench`` times it: L2 flushed before each call), "stream" (back-to-back calls),
    "isolated" (one call, host path and device time added) or "graph" (replayed from a CUDA graph: no host
    path). ``build``: which llm-speed build (the
    calibration's ``builds``; None: this checkout). ``problem``, by op:

    * gemm, tensor_core_gemm, tensor_core_gemm_int8, gemm_fp8 (dtype fp8, out bf16): ``m, n, k``
      (out[m, n] = A[m, k] @ B[k, n]), ``batch``,
      ``dtype`` (bf16), ``out_dtype``, ``with_bias``, ``with_c``; weight-only quantized B: ``weight_dtype``
      ("int8", "int4"), ``group_size``, ``scale_bytes`` (2), ``dequant`` ("convert" or "lop3"); ``tile``
      (BM, BN, BK, warps) to force one. gemm_fp8 also: ``scaling`` ("tensor", "row", "block": 1x128 A and
      128x128 B blocks), ``layout`` ("NT": both operands K-major, as torch._scaled_mm and ``x @ W^T``; "NN",
      "TN", "TT": llm-speed copies the operand that is not K-major first).
    * attention rows: ``batch, heads_q, seq_q, seq_kv`` (= seq_q), ``head_dim``, ``heads_kv``, ``dtype``
      (fp16), ``causal``, ``window``; ``config`` / ``backward_config`` (BM, BN, warps, stages) to force
      tiles, ``launch_order`` ("lpt", "row") the query-block kernels' order, ``deterministic`` the dQ
      kernel's backward, ``atomic_dq`` the five-matmul backward where the build's default is the dQ
      kernel. Varlen: ``lengths_q``, ``lengths_k`` (lists, or one int: one sequence) instead of batch and
      sequence lengths. ``window``: None or (left, right), each side an int >= 0 or None.
      ``sdpa_attention`` on an SDPA backend (or "vendor") is that backend's fused kernel, priced and labelled
      as ``flash_attention`` on it (the same call, whose measurements set the backend's parameters:
      calibrated); "llm-speed" names torch's default backend there (``llm_speed.helpers.sdpa_attention``
      calls ``F.scaled_dot_product_attention``).
      KV-cache decode: ``batch, heads_q, seq_q`` (1), ``seq_kv`` (the keys each sequence attends to: cached
      + new), ``head_dim, heads_kv, seq_new``, ``kv_dtype`` (the cache's, default ``dtype``; "fp8": 1 byte
      per cache element, labelled uncalibrated), ``page_size`` (a paged cache: priced as the dense one).
    * rms_norm(_backward): ``rows, hidden``; swiglu(_backward): ``rows, width`` (or ``elements``);
      apply_rotary: ``batch, heads, seq, head_dim, rotary_dim``; fused_linear_cross_entropy(_backward):
      ``tokens, hidden, vocab``; geglu(_backward): as swiglu; apply_rotary_qk(_backward): ``batch,
      heads_q, heads_kv, seq, head_dim, rotary_dim``; cross_entropy(_backward) (on logits): ``tokens,
      vocab``; moe_route(_backward): ``tokens, experts, top_k``; moe_sort: ``tokens, top_k, experts,
      id_bytes`` (4); all each with ``dtype`` (bf16).
    * grouped_gemm(_backward): ``tokens`` (rows of all groups), ``groups, n, k``; fused_moe(_backward):
      ``tokens, hidden, intermediate, experts, top_k``; ``dtype`` (bf16). Routing is taken as balanced.
    * all_reduce: ``size_bytes, num_gpus``, ``link`` ("nvlink"); implementation "ring", "tree", "nvls",
      "auto" ("vendor" = nvls).
    """
    if not isinstance(op, str):
        raise TypeError(f"op must be a string, got {type(op).__name__}")
    if build is not None and not isinstance(build, str):
        raise TypeError(
            f"build must be a string (a commit or an entry of the calibration's builds) or None, got "
            f"{type_name(build)} {build!r}"
        )
    family = family_of(op)
    impl = resolve_implementation(op, implementation)
    asked = ALIASES.get(str(implementation).strip().lower(), str(implementation).strip().lower())
    sdpa_default = asked in ("vendor", "sdpa") or (op == "sdpa_attention" and asked == "llm-speed")
    if impl == VENDOR["attention"] and sdpa_default:
        impl = sdpa_default_backend(problem.get("dtype", "fp16"))  # SDPA's default backend for that dtype
    context = check_context(context)
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    recorded = {key: _plain(value) for key, value in problem.items()}
    work = Problem(op, problem)
    host_s = 0.0
    dtype = "bf16"
    if family == "collective":
        params, calibrated, source = parameters(spec, "nccl", "collective", calibration)
        terms, flops, moved, _ = predict_all_reduce(spec, consts, impl, params, work)
        return Prediction(
            op=op,
            gpu=spec.id,
            implementation=impl,
            seconds=terms.device,
            bound="latency" if terms.latency_s >= terms.memory_s else "memory",
            breakdown=_breakdown(terms, flops, moved, 0.0, 0.0),
            floor_s=0.0,
            context=context,
            calibrated=calibrated,
            source=source,
            problem=recorded,
        )
    section = {"cross_entropy": "elementwise", "moe": "gemm"}.get(family, family)
    if op == "gemm_fp8":  # its own fit (calibrate.FITTED: "gemm fp8")
        section = FP8_GEMM_SECTION
    params, calibrated, source = parameters(spec, impl, section, calibration)
    built = build_entry(impl, build, calibration)
    why_not = None
    if family == "gemm":
        terms, flops, moved, info = predict_gemm(op, spec, consts, impl, params, built, work)
        dtype, why_not = info["dtype"], info.get("uncalibrated")
    elif family == "attention":
        dtype = normalize_dtype(work.get("dtype", "fp8" if op == "flash_attention_fp8" else "fp16"))
        hint = "; fp8 q, k, v are flash_attention_fp8's" if dtype == "fp8" else ""
        hint += "; an fp8 cache is kv_dtype" if dtype == "fp8" and op == "attention_kvcache_fwd" else ""
        check_computes_in(op, impl, dtype, attention_dtypes(op, impl), hint)
        if dtype not in FITTED_DTYPES and op != "flash_attention_fp8":  # (fp8: NOT_FITTED says why)
            why_not = f"the attention fit uses fp16 and bf16 points only: {dtype} priced with theirs"
        terms, flops, moved = predict_attention(op, spec, consts, impl, params, built, work, calibration)
        no_more(work, op)
    elif family == "elementwise":
        terms, flops, moved, dtype = predict_elementwise(op, spec, consts, impl, params, work)
    elif family == "moe":
        terms, flops, moved, dtype = predict_moe(op, spec, consts, impl, params, work)
    else:
        terms, flops, moved, dtype = predict_cross_entropy(op, spec, consts, impl, params, work, calibration)
    host_s = host_path_seconds(built.get("host_s") or host_table(spec, impl, calibration), op)
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    device = terms.device
    exposed = host_exposed(host_s, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or terms.latency_s >= max(terms.compute_s, terms.memory_s):
        bound = "latency"
    else:
        bound = "compute" if terms.compute_s >= terms.memory_s else "memory"
    floor_dtype = "fp32" if dtype == "fp32" and family == "attention" else dtype
    floor = roofline(flops, moved, floor_dtype, spec).time_floor_s if moved else 0.0
    if built.get("source"):
        source = f"{source}; build {build or 'current'}: {built['source']}"
    measured = (
        "fitted" in params and family != "cross_entropy" and op not in UNMEASURED_OPS and op not in NOT_FITTED
    )
    if measured and why_not:
        measured = False
        source = f"UNCALIBRATED for {op} here ({why_not}): {source}"
    elif not measured:
        why = NOT_FITTED.get(op, "no measurement of it on any GPU")
        source = f"UNCALIBRATED for {op} ({why}): {source}"
    elif op == "attention_kvcache_fwd" and normalize_dtype(problem.get("kv_dtype") or "fp16") == "fp8":
        measured = False  # the fitted decode parameters are a 16-bit cache's (issue 35: no fp8 figure yet)
        source = f"UNCALIBRATED for {op} over an fp8 cache (no measurement of it on any GPU): {source}"
    return Prediction(
        op=op,
        gpu=spec.id,
        implementation=impl,
        seconds=seconds,
        bound=bound,
        breakdown=_breakdown(terms, flops, moved, host_s, exposed),
        floor_s=floor,
        context=context,
        calibrated=calibrated and consts.calibrated and measured,
        source=source,
        problem=recorded,
    )


def _plain(value: Any) -> Any:
    """A problem value as plain JSON: tuples as lists, NumPy scalars and arrays as Python values."""
    if isinstance(value, (tuple, list)):
        return [_plain(entry) for entry in value]
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # NumPy: tolist gives Python ints, floats, bools
        return value.tolist()
    return value


def predict_call(
    ops: Sequence[str],
    gpu: str | GPUSpec,
    *,
    implementation: str = "llm-speed",
    context: str = "bench",
    build: str | None = None,
    calibration: Any = None,
    **problem: Any,
) -> Prediction:
    """Several ops run back to back under one timer on the same ``problem`` (a forward and its backward, as
    ``llm-speed bench attention --mode fwd+bwd`` times them): their device times add, and so do their host
    paths, which overlap the device as one call's would (``context``: one L2 flush before the whole call in
    "bench"). One op: :func:`predict` itself."""
    if len(ops) == 1:
        return predict(ops[0], gpu, implementation=implementation, context=context, build=build,
                       calibration=calibration, **problem)  # fmt: skip
    context = check_context(context)
    parts = [
        predict(op, gpu, implementation=implementation, context="graph", build=build, calibration=calibration,
                **problem)
        for op in ops
    ]  # fmt: skip
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    device = sum(p.seconds for p in parts)
    host = sum(p.breakdown.host_s for p in parts)
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    exposed = host_exposed(host, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    longest = max(parts, key=lambda p: p.seconds)
    b = [p.breakdown for p in parts]
    breakdown = replace(
        longest.breakdown,
        flops=sum(x.flops for x in b),
        bytes_moved=sum(x.bytes_moved for x in b),
        dram_bytes=sum(x.dram_bytes for x in b),
        compute_s=sum(x.compute_s for x in b),
        memory_s=sum(x.memory_s for x in b),
        latency_s=sum(x.latency_s for x in b),
        host_s=host,
        host_exposed_s=exposed,
        exp_s=sum(x.exp_s for x in b),
        kernels=sum(x.kernels for x in b),
        notes=tuple(note for x in b for note in x.notes),
    )
    return replace(
        longest,
        op="+".join(ops),
        seconds=seconds,
        bound="latency" if exposed >= device else longest.bound,
        breakdown=breakdown,
        floor_s=sum(p.floor_s for p in parts),
        context=context,
        calibrated=all(p.calibrated for p in parts),
        source="; ".join(dict.fromkeys(p.source for p in parts)),
    )


def _breakdown(terms: Terms, flops: float, moved: float, host_s: float, exposed: float) -> Breakdown:
    return Breakdown(
        flops=flops,
        bytes_moved=moved,
        dram_bytes=terms.dram_bytes,
        compute_s=terms.compute_s,
        memory_s=terms.memory_s,
        latency_s=terms.latency_s,
        host_s=host_s,
        host_exposed_s=exposed,
        achievable_flops_per_s=flops / terms.compute_s if terms.compute_s else 0.0,
        tensor_core_efficiency=terms.eta,
        achievable_bandwidth=terms.bandwidth,
        l2_bytes=terms.l2_bytes,
        exp_s=terms.exp_s,
        dequant_s=terms.dequant_s,
        tile=terms.tile,
        split_k=terms.split_k,
        programs=terms.programs,
        waves=terms.waves,
        wave_efficiency=terms.wave_efficiency,
        kernels=terms.kernels,
        notes=terms.notes,
    )


def dequant_model(
    gpu: str | GPUSpec, weight_dtype: str, *, implementation: str = "vendor", method: str | None = None,
    calibration: Any = None,
) -> dict[str, float]:  # fmt: skip
    """The dequantization model :func:`predict` gives ``implementation``'s GEMMs with weights stored in
    ``weight_dtype`` on ``gpu``: ``ops_per_weight``, ``ops_per_s`` (the units that run them) and
    ``overlap`` with the weight stream (:func:`with_dequant`); ``method`` as predict's ``dequant``."""
    params, _, _ = parameters(gpu, resolve_implementation("gemm", implementation), "gemm", calibration)
    method = method or params.get("dequant_default", "convert")
    return dequant_terms(gpu_constants(gpu, calibration), params, method, normalize_dtype(weight_dtype))


def predict_work(
    gpu: str | GPUSpec,
    *,
    flops: float,
    bytes_moved: float,
    dtype: str = "bf16",
    family: str = "elementwise",
    implementation: str = "llm-speed",
    context: str = "bench",
    kernels: int = 1,
    calibration: Any = None,
) -> Prediction:
    """A kernel known only by its FLOPs and bytes (an op the model has no row for: an embedding gather, a
    residual add, MoE dispatch, MLA attention): the compute at the family's large-tile tensor-core efficiency
    (``family`` "gemm" or "attention"; "elementwise": no tensor cores, the CUDA cores' fp32 rate), the bytes
    at the achievable bandwidth, ``kernels`` launches, and the host path of the implementation's default."""
    context = check_context(context)
    spec = get_gpu(gpu)
    consts = gpu_constants(spec, calibration)
    vendor = {"gemm": "cublas", "attention": VENDOR["attention"], "elementwise": "pytorch"}[family]
    impl = vendor if implementation == "vendor" else implementation
    params, calibrated, source = parameters(spec, impl, family, calibration)
    dtype = normalize_dtype(dtype)
    if family == "elementwise":
        rate = consts.alu_per_s or spec.peak_flops("fp32")
    else:
        width = 128.0
        rate = (
            spec.peak_flops("tf32" if dtype == "fp32" else dtype)
            * float(params["eta"])
            * width
            / (width + float(params.get("n_half", 0.0)))
        )
        if family == "gemm":
            intensity = 128 * 256 / (128 + 256)
            rate *= intensity / (intensity + float(params.get("tile_half", 0.0)))
    compute = flops / rate if flops else 0.0
    memory, bandwidth = memory_time(params, consts, bytes_moved, 0.0, spec.sm_count)
    terms = Terms(
        compute_s=compute,
        memory_s=memory,
        latency_s=kernels * float(params.get("latency_s", 0.0)),
        dram_bytes=bytes_moved,
        l2_bytes=0.0,
        bandwidth=bandwidth,
        eta=rate
        / spec.peak_flops("fp32" if family == "elementwise" else ("tf32" if dtype == "fp32" else dtype)),
        kernels=kernels,
    )
    host = (
        host_path_seconds(host_table(spec, impl, calibration), "default")
        if impl != "llm-speed"
        else host_path_seconds(build_entry(impl, None, calibration).get("host_s", {}), "default")
    )
    flush_s = consts.l2_flush_bytes / consts.copy_bytes_per_s if consts.copy_bytes_per_s else 0.0
    device = terms.device
    exposed = host_exposed(host * kernels, device, context, flush_s)
    seconds = device + exposed if context == "isolated" else max(device, exposed)
    if exposed >= device or terms.latency_s >= max(compute, memory):
        bound = "latency"
    else:
        bound = "compute" if compute >= memory else "memory"
    floor_dtype = "fp32" if family == "elementwise" else dtype
    floor = roofline(flops, bytes_moved, floor_dtype, spec).time_floor_s if bytes_moved else 0.0
    return Prediction(
        op="work",
        gpu=spec.id,
        implementation=impl,
        seconds=seconds,
        bound=bound,
        breakdown=_breakdown(terms, flops, bytes_moved, host * kernels, exposed),
        floor_s=floor,
        context=context,
        calibrated=calibrated and consts.calibrated,
        source=source,
        problem={"flops": flops, "bytes_moved": bytes_moved, "dtype": dtype, "family": family},
    )
