"""What :func:`llm_speed.perf.predict.predict` models: the op families, the implementation names and their
aliases, and the result types (:class:`Prediction`, :class:`Breakdown`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from llm_speed.core.gpus import normalize_dtype

# How a call is timed (the docstring of llm_speed.perf.predict) and which term bounds it.
CONTEXTS = ("bench", "stream", "isolated", "graph")
BOUNDS = ("compute", "memory", "latency")


# Ops of the table, by family.
GEMM_OPS = ("gemm", "tensor_core_gemm", "tensor_core_gemm_int8", "gemm_fp8")
ATTENTION_OPS = (
    "flash_attention",
    "flash_attention_fp8",
    "flash_attention_backward",
    "tiled_attention",
    "naive_attention",
    "sdpa_attention",
    "flash_attention_varlen",
    "flash_attention_varlen_backward",
    "attention_kvcache_fwd",
)
ELEMENTWISE_OPS = (
    "rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "apply_rotary",
    "geglu",
    "geglu_backward",
    "apply_rotary_qk",
    "apply_rotary_qk_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "moe_route",
    "moe_route_backward",
    "moe_sort",
)
CROSS_ENTROPY_OPS = ("fused_linear_cross_entropy", "fused_linear_cross_entropy_backward")
MOE_OPS = ("grouped_gemm", "grouped_gemm_backward", "fused_moe", "fused_moe_backward")
COLLECTIVE_OPS = ("all_reduce",)
OPS = GEMM_OPS + ATTENTION_OPS + ELEMENTWISE_OPS + CROSS_ENTROPY_OPS + MOE_OPS + COLLECTIVE_OPS

# The dtypes each GEMM row computes in (llm_speed.gemm: fp16, bf16, fp32, tf32 under torch's fp32 precision;
# tensor_core_gemm fp16 and bf16; the 8-bit rows theirs); cuBLAS's gemm (torch.matmul) takes fp64 as well.
GEMM_OP_DTYPES = {
    "gemm": ("fp16", "bf16", "fp32", "tf32"),
    "tensor_core_gemm": ("fp16", "bf16"),
    "tensor_core_gemm_int8": ("int8",),
    "gemm_fp8": ("fp8",),
}
# The dtypes whose measurements the GEMM and attention fits use (llm_speed.perf.measurements.kind_of): another
# dtype's call of a 16-bit row is priced at its peak with their parameters, uncalibrated.
FITTED_DTYPES = ("fp16", "bf16")


# The dtypes attention rows compute in (q, k, v): llm-speed's kernels fp16, bf16 and fp32, fp8 through
# flash_attention_fp8 only (a decode's fp8 cache is ``kv_dtype``); SDPA's fused backends as torch documents
# them (flash and cuDNN 16-bit only, memory-efficient fp32 too).
ATTENTION_DTYPES = {"llm-speed": ("fp16", "bf16", "fp32"), "sdpa-flash": ("fp16", "bf16"),
                    "sdpa-cudnn": ("fp16", "bf16"), "sdpa-efficient": ("fp16", "bf16", "fp32")}  # fmt: skip


def attention_dtypes(op: str, implementation: str) -> tuple[str, ...]:
    """The dtypes of q, k, v that ``implementation``'s ``op`` computes in (``implementation`` resolved)."""
    if op == "flash_attention_fp8":
        return ("fp8",)
    return ATTENTION_DTYPES.get(implementation, ATTENTION_DTYPES["llm-speed"])


def sdpa_default_backend(dtype: Any) -> str:
    """The fused backend F.scaled_dot_product_attention dispatches to on Hopper for q, k, v in ``dtype`` (its
    order: flash, memory-efficient, cuDNN, math): flash for 16-bit inputs, memory-efficient for fp32 (flash
    takes 16-bit only); another dtype's is refused later by name."""
    return "sdpa-efficient" if normalize_dtype(dtype) == "fp32" else VENDOR["attention"]


# What the streaming, cross-entropy and MoE rows compute in (their kernels take float16, bfloat16, float32).
FLOAT_DTYPES = ("fp16", "bf16", "fp32")


def check_computes_in(op: str, implementation: str | None, dtype: str, accepted: tuple[str, ...],
                      hint: str = "") -> str:  # fmt: skip
    """``dtype`` if ``op`` (by ``implementation``, where it matters) computes in it; else a ValueError naming
    the dtype, the row and what it takes (``hint``: where the dtype is computed instead)."""
    if dtype not in accepted:
        by = f" ({implementation})" if implementation else ""
        listed = ", ".join(accepted)
        raise ValueError(f"dtype {dtype!r} is not one {op}{by} computes in; accepted: {listed}{hint}")
    return dtype


def gemm_op_for(dtype: str) -> str:
    """The GEMM row of the op table that computes in ``dtype`` (a normalized name): gemm_fp8 for fp8,
    tensor_core_gemm_int8 for int8, else gemm (which refuses a dtype it does not take)."""
    return {"fp8": "gemm_fp8", "int8": "tensor_core_gemm_int8"}.get(dtype, "gemm")


# Op-table rows predict knows it has no model for, with the reason (the error names it). Every row of
# ``llm_speed.ops`` is in OPS or here (tests/perf/test_predict.py checks it): a new row gets a model or an
# entry, never silence.
UNMODELLED: dict[str, str] = {
    "quantize_fp8": "a streaming pass over its input, not fitted on any GPU",
}
# Rows modelled with the parameters of other kernels, never measured themselves on any GPU: their
# predictions say ``calibrated=False`` (the streaming rows without a fitted entry say it too).
UNMEASURED_OPS = (
    "geglu",
    "geglu_backward",
    "apply_rotary_qk",
    "apply_rotary_qk_backward",
    "cross_entropy",
    "cross_entropy_backward",
    "moe_route",
    "moe_route_backward",
    "moe_sort",
) + MOE_OPS
# gemm_fp8's parameters: their own calibration section (an fp8 fit: llm_speed.perf.calibrate.FITTED).
FP8_GEMM_SECTION = "gemm fp8"
# Rows measured on a GPU but modelled with the 16-bit kernels' parameters, no fit using their points
# (FITTED_DTYPES): ``calibrated=False`` too, with the reason.
NOT_FITTED: dict[str, str] = {
    "flash_attention_fp8": "the flash forward's model at fp8 peaks and 1-byte inputs; measured on the H100 "
    "2026-11-25 at 2-4x the model's time (slower than the 16-bit kernel from seq 2048 on): not fitted",
    "tensor_core_gemm_int8": "the GEMM model at int8 peaks; measured on the H100 2026-11-25 (0cce093, "
    "benchmarks/results/h100-sxm/0cce093-tests-bench) at 2.5-2.9x the model's time (4096^3 0.298 ms, "
    "461 TOPS: the Triton kernel waits for every int32 product, as Triton's pipeliner keeps a wgmma in "
    "flight only with an fp32 accumulator) and torch._int_mm at 6-11x (121-127 TOPS): not fitted",
}

# Implementation names, and what each alias means.
SDPA_BACKENDS = ("sdpa-flash", "sdpa-cudnn", "sdpa-efficient")
ALIASES = {
    "flash": "llm-speed",
    "llm_speed": "llm-speed",
    "kvcache": "llm-speed",
    "kvcache-paged": "llm-speed",
    "torch": "cublas",
    "torch-int-mm": "cublas",
    "eager": "pytorch",
}
# "vendor": cuBLAS for GEMMs; for attention the backend F.scaled_dot_product_attention picks by default on
# Hopper for fp16/bf16 (the FlashAttention-2 kernel: cuDNN's has a lower priority in torch's dispatcher).
# MoE GEMMs: torch._grouped_mm (cuBLAS/CUTLASS grouped kernels) modelled with cuBLAS's GEMM parameters.
VENDOR = {
    "gemm": "cublas",
    "attention": "sdpa-flash",
    "elementwise": "pytorch",
    "collective": "nvls",
    "moe": "cublas",
}


def family_of(op: str) -> str:
    """The model family of an op: gemm, cross_entropy, attention, elementwise, moe or collective."""
    if op in GEMM_OPS or op in CROSS_ENTROPY_OPS:
        return "gemm" if op in GEMM_OPS else "cross_entropy"
    if op in ATTENTION_OPS:
        return "attention"
    if op in ELEMENTWISE_OPS:
        return "elementwise"
    if op in MOE_OPS:
        return "moe"
    if op in COLLECTIVE_OPS:
        return "collective"
    if op in UNMODELLED:
        raise ValueError(
            f"op: no prediction for {op!r} ({UNMODELLED[op]}); predict_work(gpu, flops=, bytes_moved=) "
            f"gives an uncalibrated estimate from its FLOPs and bytes; modelled: {', '.join(OPS)}"
        )
    raise ValueError(
        f"op: no prediction for {op!r}; modelled: {', '.join(OPS)} (predict_work(gpu, flops=, "
        "bytes_moved=) gives an uncalibrated estimate of any kernel from its FLOPs and bytes)"
    )


def implementations(op: str) -> tuple[str, ...]:
    """The implementation names :func:`predict` accepts for ``op`` (aliases and "vendor" not listed)."""
    family = family_of(op)
    if family in ("gemm", "cross_entropy", "moe"):
        return ("llm-speed", "pytorch") if family == "cross_entropy" else ("llm-speed", "cublas")
    if family == "attention":
        if op == "sdpa_attention":  # torch's SDPA: its backends ("llm-speed" names the default one)
            return SDPA_BACKENDS
        if op in ("flash_attention", "flash_attention_backward"):
            return ("llm-speed", *SDPA_BACKENDS)
        if op in ("flash_attention_varlen", "flash_attention_varlen_backward", "attention_kvcache_fwd"):
            return ("llm-speed", "sdpa-flash")
        return ("llm-speed",)
    if family == "elementwise":
        return ("llm-speed", "pytorch")
    return ("ring", "tree", "nvls", "auto")


def resolve_implementation(op: str, implementation: str) -> str:
    """The canonical implementation name for ``op`` ("vendor" and aliases resolved); ValueError listing the
    accepted names otherwise."""
    if not isinstance(implementation, str):
        raise TypeError(f"implementation must be a string, got {type(implementation).__name__}")
    family = family_of(op)
    vendor = "pytorch" if family == "cross_entropy" else VENDOR[family]
    name = implementation.strip().lower()
    if name == "vendor":
        name = vendor
    elif name == "sdpa":
        name = VENDOR["attention"]
    name = ALIASES.get(name, name)
    if op == "sdpa_attention" and name == "llm-speed":
        # llm_speed.helpers.sdpa_attention is torch's SDPA: its default backend runs it, no llm-speed kernel
        name = VENDOR["attention"]
    accepted = implementations(op)
    if name not in accepted:
        # "vendor" is accepted only where the vendor's implementation of the op is modelled
        listed = ", ".join(accepted) + (", vendor" if vendor in accepted else "")
        why = ""
        if implementation.strip().lower() == "vendor":
            why = f" (vendor means {name} for the {family} rows, which {op} has no model of)"
        raise ValueError(
            f"implementation {implementation!r} is not modelled for {op}{why}; accepted: {listed}"
        )
    return name


@dataclass(frozen=True)
class Breakdown:
    """Every term of a prediction (seconds unless named otherwise)."""

    flops: float  # the model FLOPs of the op (kernel_costs)
    bytes_moved: float  # the minimum DRAM bytes (kernel_costs)
    dram_bytes: float  # modelled DRAM traffic: the minimum plus tile re-reads that miss the L2
    compute_s: float  # tensor cores (and exp units), over the programs' waves
    memory_s: float  # DRAM traffic at the achievable bandwidth, and L2 traffic at the L2's
    latency_s: float  # launch and the kernels' start/end on the device (all kernels of the call)
    host_s: float  # the host path per call (Python, checks, driver)
    host_exposed_s: float  # the part of the host path the call's time shows (see ``context``)
    achievable_flops_per_s: float  # flops / compute_s
    tensor_core_efficiency: float  # of the (first) kernel's tile, 0..1 of the dense peak
    achievable_bandwidth: float  # bytes/s the DRAM term runs at
    l2_bytes: float  # traffic served by the L2 (tile re-reads that hit)
    exp_s: float = 0.0  # exponentials on the special-function units (attention), before overlap
    dequant_s: float = 0.0  # weight-only dequantization on the CUDA cores (decode GEMMs)
    tile: tuple[int, ...] | None = None  # the (first) kernel's tile: (BM, BN, BK|warps, stages...) or None
    split_k: int = 1
    programs: int = 0  # programs (CTAs) of the main kernel
    waves: float = 0.0  # programs / SMs, before rounding up
    wave_efficiency: float = 1.0  # busy fraction of the SM-time over the waves (1: no idle SM)
    kernels: int = 1  # kernel launches per call
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Prediction:
    """What ``implementation`` of ``op`` takes on ``gpu``: ``seconds`` and the ``bound`` ("compute",
    "memory" or "latency"), with the terms in ``breakdown``, the roofline floor beside it, and where the
    parameters came from (``source``; ``calibrated`` is False when the GPU has no calibration of its
    own, or when no GPU measurement of this op set its parameters: :data:`UNMEASURED_OPS`,
    :data:`NOT_FITTED`, the streaming rows, the fused cross-entropy)."""

    op: str
    gpu: str
    implementation: str
    seconds: float
    bound: str
    breakdown: Breakdown
    floor_s: float
    context: str
    calibrated: bool
    source: str
    problem: dict[str, Any] = field(default_factory=dict)

    @property
    def milliseconds(self) -> float:
        return self.seconds * 1e3

    def error(self, measured_s: float) -> float:
        """Signed relative error of this prediction against a measured time: predicted / measured - 1."""
        if not measured_s or measured_s <= 0:
            raise ValueError(f"measured_s must be > 0, got {measured_s!r}")
        return self.seconds / measured_s - 1.0

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (``llm-speed predict --json``)."""
        record = asdict(self)
        record["milliseconds"] = self.milliseconds
        return record
