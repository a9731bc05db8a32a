"""The one GPU spec table of llm-speed, with a source for every number.

Conventions (read these before using a number):

* ``peak_tflops`` holds **dense** peaks in TFLOP/s (TOP/s for ``int8``). NVIDIA datasheets print the
  2:4-sparsity figure for tensor-core dtypes (marked with an asterisk); the table stores half of it, the dense
  figure, and the source string says which printed number it came from.
* ``fp32`` is the non-tensor-core (CUDA core) FP32 peak; ``tf32`` is the tensor-core TF32 peak; ``fp64`` is
  the non-tensor-core FP64 peak (A100/H100/H200 have a faster FP64 tensor-core path, noted in ``sources``).
* ``fp16``/``bf16``/``fp8`` are tensor-core peaks **with FP32 accumulation** (what ``torch.matmul`` and
  Triton's ``tl.dot`` use). This only matters on GeForce cards (RTX 4090), whose FP32-accumulate rate is half
  the FP16-accumulate rate that marketing quotes.
* A dtype the GPU has no peak for is absent from ``peak_tflops``, never 0.
* Bandwidths are decimal: GB/s = 1e9 bytes/s. ``nvlink_bandwidth_gbs`` and ``pcie_bandwidth_gbs`` are the
  datasheet figures, which are **bidirectional totals** (both directions added); one direction carries half.
  :meth:`GPUSpec.nvlink_unidirectional_bytes_per_s` gives that half.
* ``hbm_capacity_gb`` is the datasheet capacity in decimal GB. What a device reports can differ either way
  (HBM stacks come in GiB: the H100 SXM's "80 GB" is 80 GiB, of which the driver leaves 85.02e9 bytes;
  ECC on GDDR takes a share). ``device_memory_bytes`` holds the reported figure where we measured it, and
  :attr:`GPUSpec.usable_memory_bytes`, the one "fits" is judged against, prefers it.
* ``smem_per_sm_kb`` is the largest shared-memory carve-out one SM can give (the opt-in maximum per block is
  1 KB less); ``register_file_per_sm_kb`` is 64K 32-bit registers = 256 KB on all of these.

Nothing here touches the GPU at import time; :func:`detect_gpu` and :func:`live_device_properties` read the
device only when called.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# Bytes per element of every dtype name the performance model understands. int4/fp4 are packed two per byte.
DTYPE_BYTES: dict[str, float] = {
    "fp64": 8,
    "fp32": 4,
    "tf32": 4,
    "fp16": 2,
    "bf16": 2,
    "fp8": 1,
    "int8": 1,
    "int4": 0.5,
    "fp4": 0.5,
}

# Spellings accepted for each canonical dtype name (torch dtypes arrive as "torch.float16" etc.).
_DTYPE_ALIASES: dict[str, str] = {
    "fp64": "fp64",
    "float64": "fp64",
    "double": "fp64",
    "f64": "fp64",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "f32": "fp32",
    "tf32": "tf32",
    "tensorfloat32": "tf32",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "f16": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
    "float8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "float8_e4m3fnuz": "fp8",
    "float8_e5m2fnuz": "fp8",
    "e4m3": "fp8",
    "e5m2": "fp8",
    "int8": "int8",
    "i8": "int8",
    "uint8": "int8",
    "int4": "int4",
    "fp4": "fp4",
}


def normalize_dtype(dtype: Any) -> str:
    """Canonical dtype name ("fp64", "fp32", "tf32", "fp16", "bf16", "fp8", "int8", "int4", "fp4").

    Accepts those names, their long spellings ("float16", "bfloat16", "half", ...) and ``torch.dtype``
    objects (``torch.float32`` means plain FP32, not TF32). Raises ValueError for anything else.
    """
    text = dtype if isinstance(dtype, str) else str(dtype)  # torch.float16 -> "torch.float16"
    key = text.strip().lower().removeprefix("torch.")
    if key not in _DTYPE_ALIASES:
        raise ValueError(
            f"dtype {dtype!r} is not understood; accepted: {', '.join(DTYPE_BYTES)} "
            "(or float64/float32/float16/bfloat16/float8_e4m3fn/int8 and the matching torch.dtype)"
        )
    return _DTYPE_ALIASES[key]


def dtype_bytes(dtype: Any) -> float:
    """Bytes per element of ``dtype`` (any spelling :func:`normalize_dtype` accepts); int4/fp4 give 0.5."""
    return DTYPE_BYTES[normalize_dtype(dtype)]


@dataclass(frozen=True)
class GPUSpec:
    """One GPU model's published specification. See the module docstring for the conventions."""

    id: str
    name: str
    aliases: tuple[str, ...]
    architecture: str
    compute_capability: tuple[int, int]
    sm_count: int
    boost_clock_mhz: int
    peak_tflops: dict[str, float]
    hbm_capacity_gb: float
    hbm_bandwidth_gbs: float
    l2_cache_mb: float
    smem_per_sm_kb: int
    register_file_per_sm_kb: int
    nvlink_bandwidth_gbs: float | None
    pcie_bandwidth_gbs: float
    memory_type: str  # DRAM kind: HBM2, HBM2e, HBM3, HBM3e, GDDR6, GDDR6X
    sources: dict[str, str] = field(default_factory=dict)
    # torch.cuda.get_device_properties().total_memory as measured on one such device (its source says
    # where); None where we never measured one.
    device_memory_bytes: float | None = None

    def __hash__(self) -> int:
        # The generated hash would fail on the dict fields; equal specs have equal ids.
        return hash(self.id)

    @property
    def vendor(self) -> str:
        """The maker, the first word of the name: "NVIDIA", "AMD" (a user spec's: whatever its name says)."""
        return self.name.split(" ", 1)[0]

    def peak_flops(self, dtype: Any) -> float:
        """Dense peak in FLOP/s (OP/s for int8) for ``dtype``: ``peak_tflops[dtype] * 1e12``.

        ``dtype`` is a name ("bf16", "float16", "fp32", "tf32", ...) or a ``torch.dtype``; ``torch.float32``
        and "fp32" mean the non-tensor-core FP32 peak, "tf32" the tensor-core TF32 peak. Raises ValueError
        naming this GPU's dtypes when it has no peak for ``dtype``.
        """
        name = normalize_dtype(dtype)
        if name not in self.peak_tflops:
            raise ValueError(
                f"dtype {dtype!r} has no peak on {self.id}; accepted dtypes: {', '.join(self.peak_tflops)}"
            )
        return self.peak_tflops[name] * 1e12

    @property
    def memory_bandwidth(self) -> float:
        """Peak DRAM (HBM or GDDR) bandwidth in bytes/s: ``hbm_bandwidth_gbs * 1e9``."""
        return self.hbm_bandwidth_gbs * 1e9

    @property
    def memory_capacity_bytes(self) -> float:
        """Datasheet DRAM capacity in bytes: ``hbm_capacity_gb * 1e9``."""
        return self.hbm_capacity_gb * 1e9

    @property
    def usable_memory_bytes(self) -> float:
        """The memory a program can allocate from, in bytes: ``device_memory_bytes`` where it was measured,
        else the datasheet capacity. "Fits" in the memory estimates is judged against this."""
        measured = self.device_memory_bytes
        return measured if measured is not None else self.memory_capacity_bytes

    def ridge_point(self, dtype: Any) -> float:
        """Roofline ridge point (machine balance) in FLOP/byte: ``peak_flops(dtype) / memory_bandwidth``.

        A kernel whose arithmetic intensity is below this is memory-bound on this GPU (Williams, Waterman and
        Patterson, "Roofline", CACM 2009).
        """
        return self.peak_flops(dtype) / self.memory_bandwidth

    def nvlink_unidirectional_bytes_per_s(self) -> float | None:
        """Bytes/s one GPU can send over NVLink in one direction: half the bidirectional datasheet figure."""
        if self.nvlink_bandwidth_gbs is None:
            return None
        return self.nvlink_bandwidth_gbs * 1e9 / 2

    def pcie_unidirectional_bytes_per_s(self) -> float:
        """Bytes/s over PCIe in one direction: half the bidirectional datasheet figure."""
        return self.pcie_bandwidth_gbs * 1e9 / 2


# --- sources ---
_A100_DATASHEET = "NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4)"
_A100_WHITEPAPER = "NVIDIA A100 Tensor Core GPU Architecture whitepaper (2020), Table 1/Table 3"
_H100_DATASHEET = "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM and PCIe columns"
_H100_WHITEPAPER = "NVIDIA H100 Tensor Core GPU Architecture whitepaper (GTC22), Table 2/Table 3"
_H200_DATASHEET = "NVIDIA H200 Tensor Core GPU datasheet / product page (H200 SXM column)"
_HGX_B200 = "NVIDIA HGX B200 platform specification (8-GPU totals divided by 8), nvidia.com/data-center/hgx"
_B200_DEVICE = "CUDA device properties read on a B200 (NVIDIA publishes no L2/SM/clock datasheet figure)"
_BLACKWELL_TUNING = "NVIDIA Blackwell Tuning Guide (CUDA docs): 228 KB shared memory per SM, 64K registers"
_L40S_DATASHEET = "NVIDIA L40S datasheet (2023)"
_L4_DATASHEET = "NVIDIA L4 Tensor Core GPU datasheet (2023)"
_ADA_WHITEPAPER = "NVIDIA Ada GPU Architecture whitepaper v2.1, Appendix A (RTX 4090) and Table 1"
_ADA_TUNING = "NVIDIA Ada Tuning Guide (CUDA docs): 100 KB shared memory per SM, 64K registers per SM"
_HOPPER_TUNING = "NVIDIA Hopper Tuning Guide (CUDA docs): 228 KB shared memory per SM, 64K registers per SM"
_AMPERE_TUNING = "NVIDIA Ampere Tuning Guide (CUDA docs): 164 KB shared memory per SM (A100), 64K registers"
_ADA_FP64 = "Ada SMs run FP64 at 1/64 of the FP32 rate (CUDA Programming Guide, arithmetic throughput table)"
_H800_DATASHEET = "NVIDIA H800 Tensor Core GPU datasheet (H800 SXM5 column)"
_H100_NVL = "NVIDIA H100 Tensor Core GPU datasheet (2023), H100 NVL column (per GPU of the NVL pair)"
_GH200_DATASHEET = "NVIDIA GH200 Grace Hopper Superchip datasheet (2023/2024), GPU figures"
_T4_DATASHEET = "NVIDIA T4 Tensor Core GPU datasheet (T4-datasheet-951643)"
_TURING_TUNING = "NVIDIA Turing Tuning Guide (CUDA docs): 64 KB shared memory per SM, 64K registers per SM"
_TURING_WHITEPAPER = "NVIDIA Turing GPU Architecture whitepaper (TU104: 4 MB L2; T4 uses 40 of its SMs)"
_MI300X_DATASHEET = "AMD Instinct MI300X accelerator data sheet / product page (amd.com), OAM module"
_CDNA3_WHITEPAPER = "AMD CDNA 3 Instruction Set Architecture / CDNA 3 white paper (2023)"


def _sparse_halved(printed: str) -> str:
    return f"{printed}; the datasheet's figure is with 2:4 sparsity, the table stores half (dense)"


def _ampere_a100(
    gpu_id: str, name: str, aliases: tuple[str, ...], form: str, capacity_gb: float, bandwidth_gbs: float
) -> GPUSpec:
    """A100 variants share the GA100 compute figures; they differ in memory and form factor."""
    return GPUSpec(
        id=gpu_id,
        name=name,
        aliases=aliases,
        architecture="Ampere",
        compute_capability=(8, 0),
        sm_count=108,
        boost_clock_mhz=1410,
        peak_tflops={"fp64": 9.7, "fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0, "int8": 624.0},
        hbm_capacity_gb=capacity_gb,
        hbm_bandwidth_gbs=bandwidth_gbs,
        l2_cache_mb=40.0,
        smem_per_sm_kb=164,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=600.0,
        pcie_bandwidth_gbs=64.0,
        memory_type="HBM2e" if capacity_gb == 80 else "HBM2",
        sources={
            "peak_tflops": _sparse_halved(
                f"{_A100_DATASHEET}: FP64 9.7 (FP64 Tensor Core 19.5), FP32 19.5, TF32 312*, BF16/FP16 624*, "
                "INT8 1248*"
            ),
            "hbm_capacity_gb": f"{_A100_DATASHEET}, {form} column",
            "hbm_bandwidth_gbs": f"{_A100_DATASHEET}, {form} column",
            "sm_count": _A100_WHITEPAPER,
            "boost_clock_mhz": _A100_WHITEPAPER,
            "l2_cache_mb": _A100_WHITEPAPER,
            "smem_per_sm_kb": _AMPERE_TUNING,
            "register_file_per_sm_kb": _AMPERE_TUNING,
            "nvlink_bandwidth_gbs": f"{_A100_DATASHEET}: NVLink 600 GB/s"
            + (" (PCIe cards: with the 2-GPU NVLink bridge)" if form == "PCIe" else ""),
            "pcie_bandwidth_gbs": f"{_A100_DATASHEET}: PCIe Gen4 64 GB/s",
        },
    )


def _hopper_compute_sources(form: str) -> dict[str, str]:
    return {
        "sm_count": _H100_WHITEPAPER + f" ({form})",
        "boost_clock_mhz": f"maximum SM clock nvidia-smi reports on H100 {form}; the dense tensor peaks "
        "imply a lower sustained clock (SXM: 989.4 TFLOP/s = 132 SMs x 4,096 FLOP/clk x 1.83 GHz)",
        "l2_cache_mb": _H100_WHITEPAPER,
        "smem_per_sm_kb": _HOPPER_TUNING,
        "register_file_per_sm_kb": _HOPPER_TUNING,
    }


# H100 SXM5 and H200 share these: the whitepaper's exact dense figures (boost clock 1.83 GHz for the peaks);
# the datasheets round them (989 / 1,979* / 3,958*).
_GH100_SXM_PEAKS = {
    "fp64": 33.5,
    "fp32": 66.9,
    "tf32": 494.7,
    "fp16": 989.4,
    "bf16": 989.4,
    "fp8": 1978.9,
    "int8": 1978.9,
}
_GH100_SXM_PEAK_SOURCE = (
    f"{_H100_WHITEPAPER}, H100 SXM5 column, dense / 2:4-sparsity pairs: FP64 33.5 (FP64 Tensor Core "
    "66.9), FP32 66.9, TF32 494.7/989.4, BF16/FP16 989.4/1978.9, FP8 1978.9/3957.8, INT8 1978.9/3957.8; "
    "the table stores the dense figure"
)

_GPUS: tuple[GPUSpec, ...] = (
    _ampere_a100(
        "a100-sxm-80gb",
        "NVIDIA A100 SXM4 80GB",
        ("a100", "a100-80gb", "a100-sxm", "a100-sxm4-80gb", "a100-80gb-sxm", "a100-sxm4"),
        "SXM4 80GB",
        80.0,
        2039.0,
    ),
    _ampere_a100(
        "a100-sxm-40gb",
        "NVIDIA A100 SXM4 40GB",
        ("a100-40gb", "a100-sxm4-40gb", "a100-40gb-sxm"),
        "SXM4 40GB",
        40.0,
        1555.0,
    ),
    _ampere_a100(
        "a100-pcie-80gb",
        "NVIDIA A100 PCIe 80GB",
        ("a100-pcie", "a100-80gb-pcie", "a100-pcie-80g"),
        "PCIe",
        80.0,
        1935.0,
    ),
    _ampere_a100(
        "a100-pcie-40gb", "NVIDIA A100 PCIe 40GB", ("a100-40gb-pcie", "a100-pcie-40g"), "PCIe", 40.0, 1555.0
    ),
    GPUSpec(
        id="h100-sxm",
        name="NVIDIA H100 SXM5 80GB",
        aliases=("h100", "h100-sxm5", "h100-80gb-hbm3", "h100-sxm5-80gb", "h100-80gb"),
        architecture="Hopper",
        compute_capability=(9, 0),
        sm_count=132,
        boost_clock_mhz=1980,
        peak_tflops=_GH100_SXM_PEAKS,
        hbm_capacity_gb=80.0,
        hbm_bandwidth_gbs=3350.0,
        l2_cache_mb=50.0,
        smem_per_sm_kb=228,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=900.0,
        pcie_bandwidth_gbs=128.0,
        memory_type="HBM3",
        device_memory_bytes=85_017_493_504.0,
        sources={
            "peak_tflops": _GH100_SXM_PEAK_SOURCE,
            "hbm_capacity_gb": f"{_H100_DATASHEET}, SXM: 80 GB",
            "device_memory_bytes": "torch total_memory on our H100 SXM, 2026-11-25 "
            "(benchmarks/results/h100-sxm/d1b0227-quick-tests-bench/doctor.json: memory_gb 85.017)",
            "hbm_bandwidth_gbs": f"{_H100_DATASHEET}, SXM: 3.35 TB/s",
            "nvlink_bandwidth_gbs": f"{_H100_DATASHEET}, SXM: NVLink 900 GB/s",
            "pcie_bandwidth_gbs": f"{_H100_DATASHEET}: PCIe Gen5 128 GB/s",
            **_hopper_compute_sources("SXM5"),
        },
    ),
    GPUSpec(
        id="h100-pcie",
        name="NVIDIA H100 PCIe 80GB",
        aliases=("h100-pcie-80gb", "h100-80gb-pcie", "h100-pcie5"),
        architecture="Hopper",
        compute_capability=(9, 0),
        sm_count=114,
        boost_clock_mhz=1755,
        peak_tflops={
            "fp64": 26.0,
            "fp32": 51.0,
            "tf32": 378.0,
            "fp16": 756.5,
            "bf16": 756.5,
            "fp8": 1513.0,
            "int8": 1513.0,
        },
        hbm_capacity_gb=80.0,
        hbm_bandwidth_gbs=2000.0,
        l2_cache_mb=50.0,
        smem_per_sm_kb=228,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=600.0,
        pcie_bandwidth_gbs=128.0,
        memory_type="HBM2e",
        sources={
            "peak_tflops": _sparse_halved(
                f"{_H100_DATASHEET}, PCIe: FP64 26 (FP64 Tensor Core 51), FP32 51, TF32 756*, "
                "BF16/FP16 1,513*, FP8 3,026*, INT8 3,026*"
            ),
            "hbm_capacity_gb": f"{_H100_DATASHEET}, PCIe: 80 GB",
            "hbm_bandwidth_gbs": f"{_H100_DATASHEET}, PCIe: 2 TB/s",
            "nvlink_bandwidth_gbs": f"{_H100_DATASHEET}, PCIe: NVLink bridge 600 GB/s",
            "pcie_bandwidth_gbs": f"{_H100_DATASHEET}: PCIe Gen5 128 GB/s",
            **_hopper_compute_sources("PCIe"),
        },
    ),
    GPUSpec(
        id="h200",
        name="NVIDIA H200 SXM 141GB",
        aliases=("h200-sxm", "h200-sxm5", "h200-141gb", "h200-sxm-141gb"),
        architecture="Hopper",
        compute_capability=(9, 0),
        sm_count=132,
        boost_clock_mhz=1980,
        peak_tflops=_GH100_SXM_PEAKS,
        hbm_capacity_gb=141.0,
        hbm_bandwidth_gbs=4800.0,
        l2_cache_mb=50.0,
        smem_per_sm_kb=228,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=900.0,
        pcie_bandwidth_gbs=128.0,
        memory_type="HBM3e",
        sources={
            "peak_tflops": "H200 runs the GH100 SXM5 die of H100 SXM at the same clocks; "
            + _GH100_SXM_PEAK_SOURCE
            + f". {_H200_DATASHEET} prints the same figures rounded: FP64 34, FP32 67, TF32 989*, BF16/FP16 "
            "1,979*, FP8 3,958*",
            "hbm_capacity_gb": f"{_H200_DATASHEET}: 141 GB HBM3e",
            "hbm_bandwidth_gbs": f"{_H200_DATASHEET}: 4.8 TB/s",
            "nvlink_bandwidth_gbs": f"{_H200_DATASHEET}: NVLink 900 GB/s",
            "pcie_bandwidth_gbs": f"{_H200_DATASHEET}: PCIe Gen5 128 GB/s",
            "sm_count": "H200 uses the GH100 die of H100 SXM5 (132 SMs); " + _H100_WHITEPAPER,
            "boost_clock_mhz": "nvidia-smi max SM clock of H200 SXM (same as H100 SXM5)",
            "l2_cache_mb": "GH100 L2, " + _H100_WHITEPAPER,
            "smem_per_sm_kb": _HOPPER_TUNING,
            "register_file_per_sm_kb": _HOPPER_TUNING,
        },
    ),
    GPUSpec(
        id="b200",
        name="NVIDIA B200 (HGX B200)",
        aliases=("b200-sxm", "b200-180gb", "hgx-b200", "dgx-b200"),
        architecture="Blackwell",
        compute_capability=(10, 0),
        sm_count=148,
        boost_clock_mhz=1965,
        peak_tflops={
            "fp64": 37.0,
            "fp32": 75.0,
            "tf32": 1125.0,
            "fp16": 2250.0,
            "bf16": 2250.0,
            "fp8": 4500.0,
            "int8": 4500.0,
        },
        hbm_capacity_gb=180.0,
        hbm_bandwidth_gbs=8000.0,
        l2_cache_mb=126.5,
        smem_per_sm_kb=228,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=1800.0,
        pcie_bandwidth_gbs=128.0,
        memory_type="HBM3e",
        sources={
            "peak_tflops": _sparse_halved(
                f"{_HGX_B200}: FP64/FP64 Tensor Core 296 TFLOPS, FP32 600 TFLOPS, TF32 18 PFLOPS*, "
                "FP16/BF16 36 PFLOPS*, FP8 72 PFLOPS*, INT8 72 POPS* for 8 GPUs"
            ),
            "hbm_capacity_gb": f"{_HGX_B200}: 1,440 GB total (marketing also quotes 192 GB per GPU)",
            "hbm_bandwidth_gbs": f"{_HGX_B200}: 64 TB/s total",
            "nvlink_bandwidth_gbs": f"{_HGX_B200}: NVLink 5, 1.8 TB/s per GPU",
            "pcie_bandwidth_gbs": "HGX B200 host link PCIe Gen5 x16 (128 GB/s); DGX B200 datasheet",
            "sm_count": _B200_DEVICE + ": multiProcessorCount 148",
            "boost_clock_mhz": _B200_DEVICE + ": maximum SM clock 1,965 MHz",
            "l2_cache_mb": _B200_DEVICE + ": l2CacheSize 132,644,864 bytes = 126.5 MiB",
            "smem_per_sm_kb": _BLACKWELL_TUNING,
            "register_file_per_sm_kb": _BLACKWELL_TUNING,
        },
    ),
    GPUSpec(
        id="l40s",
        name="NVIDIA L40S",
        aliases=("l40s-48gb",),
        architecture="Ada Lovelace",
        compute_capability=(8, 9),
        sm_count=142,
        boost_clock_mhz=2520,
        peak_tflops={
            "fp64": 1.43,
            "fp32": 91.6,
            "tf32": 183.0,
            "fp16": 362.05,
            "bf16": 362.05,
            "fp8": 733.0,
            "int8": 733.0,
        },
        hbm_capacity_gb=48.0,
        hbm_bandwidth_gbs=864.0,
        l2_cache_mb=96.0,
        smem_per_sm_kb=100,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=None,
        pcie_bandwidth_gbs=64.0,
        memory_type="GDDR6",
        sources={
            "peak_tflops": _sparse_halved(
                f"{_L40S_DATASHEET}: FP32 91.6, TF32 366*, BF16/FP16 733*, FP8 1,466*, INT8 1,466*"
            )
            + f"; fp64 = FP32/64 ({_ADA_FP64})",
            "hbm_capacity_gb": f"{_L40S_DATASHEET}: 48 GB GDDR6 with ECC",
            "hbm_bandwidth_gbs": f"{_L40S_DATASHEET}: 864 GB/s",
            "nvlink_bandwidth_gbs": f"{_L40S_DATASHEET}: NVLink not supported",
            "pcie_bandwidth_gbs": f"{_L40S_DATASHEET}: PCIe Gen4 x16 64 GB/s bidirectional",
            "sm_count": "AD102 with 142 SMs (18,176 CUDA cores / 128 per SM), " + _L40S_DATASHEET,
            "boost_clock_mhz": "L40S max boost clock 2,520 MHz (NVIDIA L40S product brief)",
            "l2_cache_mb": "AD102 L2 96 MB, " + _ADA_WHITEPAPER,
            "smem_per_sm_kb": _ADA_TUNING,
            "register_file_per_sm_kb": _ADA_TUNING,
        },
    ),
    GPUSpec(
        id="l4",
        name="NVIDIA L4",
        aliases=("l4-24gb",),
        architecture="Ada Lovelace",
        compute_capability=(8, 9),
        sm_count=58,
        boost_clock_mhz=2040,
        peak_tflops={
            "fp64": 0.47,
            "fp32": 30.3,
            "tf32": 60.0,
            "fp16": 121.0,
            "bf16": 121.0,
            "fp8": 242.5,
            "int8": 242.5,
        },
        hbm_capacity_gb=24.0,
        hbm_bandwidth_gbs=300.0,
        l2_cache_mb=48.0,
        smem_per_sm_kb=100,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=None,
        pcie_bandwidth_gbs=64.0,
        memory_type="GDDR6",
        sources={
            "peak_tflops": _sparse_halved(
                f"{_L4_DATASHEET}: FP32 30.3, TF32 120*, BF16/FP16 242*, FP8 485*, INT8 485*"
            )
            + f"; fp64 = FP32/64 ({_ADA_FP64})",
            "hbm_capacity_gb": f"{_L4_DATASHEET}: 24 GB GDDR6",
            "hbm_bandwidth_gbs": f"{_L4_DATASHEET}: 300 GB/s",
            "nvlink_bandwidth_gbs": f"{_L4_DATASHEET}: no NVLink",
            "pcie_bandwidth_gbs": f"{_L4_DATASHEET}: PCIe Gen4 x16 64 GB/s",
            "sm_count": "AD104 in L4 with 58 SMs (7,424 CUDA cores / 128 per SM), " + _L4_DATASHEET,
            "boost_clock_mhz": "L4 max boost clock 2,040 MHz (NVIDIA L4 product brief)",
            "l2_cache_mb": "AD104 L2 48 MB, " + _ADA_WHITEPAPER,
            "smem_per_sm_kb": _ADA_TUNING,
            "register_file_per_sm_kb": _ADA_TUNING,
        },
    ),
    GPUSpec(
        id="rtx-4090",
        name="NVIDIA GeForce RTX 4090",
        aliases=("4090", "rtx4090", "geforce-rtx-4090"),
        architecture="Ada Lovelace",
        compute_capability=(8, 9),
        sm_count=128,
        boost_clock_mhz=2520,
        peak_tflops={
            "fp64": 1.29,
            "fp32": 82.6,
            "tf32": 82.6,
            "fp16": 165.2,
            "bf16": 165.2,
            "fp8": 330.3,
            "int8": 660.6,
        },
        hbm_capacity_gb=24.0,
        hbm_bandwidth_gbs=1008.0,
        l2_cache_mb=72.0,
        smem_per_sm_kb=100,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=None,
        pcie_bandwidth_gbs=64.0,
        memory_type="GDDR6X",
        sources={
            "peak_tflops": (
                f"{_ADA_WHITEPAPER}, dense columns: FP32 82.6, TF32 82.6, "
                "FP16/BF16 with FP32 accumulate 165.2 (330.3 with FP16 accumulate), "
                "FP8 with FP32 accumulate 330.3 (660.6 with FP16 accumulate), "
                f"INT8 660.6; fp64 1.29 = FP32/64 ({_ADA_FP64})"
            ),
            "hbm_capacity_gb": f"{_ADA_WHITEPAPER}: 24 GB GDDR6X",
            "hbm_bandwidth_gbs": f"{_ADA_WHITEPAPER}: 1,008 GB/s (21 Gbps, 384-bit)",
            "nvlink_bandwidth_gbs": "RTX 4090 has no NVLink connector",
            "pcie_bandwidth_gbs": "RTX 4090: PCIe Gen4 x16 (64 GB/s bidirectional)",
            "sm_count": _ADA_WHITEPAPER + ": 128 SMs",
            "boost_clock_mhz": _ADA_WHITEPAPER + ": boost clock 2,520 MHz",
            "l2_cache_mb": _ADA_WHITEPAPER + ": 72 MB L2",
            "smem_per_sm_kb": _ADA_TUNING,
            "register_file_per_sm_kb": _ADA_TUNING,
        },
    ),
)


def _gh100_variant(
    gpu_id: str,
    name: str,
    aliases: tuple[str, ...],
    *,
    peaks: dict[str, float],
    peak_source: str,
    capacity_gb: float,
    bandwidth_gbs: float,
    nvlink_gbs: float,
    memory_type: str,
    datasheet: str,
    extra_sources: dict[str, str] | None = None,
    boost_clock_mhz: int = 1980,
    clock_source: str = "as H100 SXM5 (maximum SM clock nvidia-smi reports)",
) -> GPUSpec:
    """H100 variants (H800, H100 NVL, GH200) share the GH100 die's SMs, L2 and shared memory."""
    return GPUSpec(
        id=gpu_id,
        name=name,
        aliases=aliases,
        architecture="Hopper",
        compute_capability=(9, 0),
        sm_count=132,
        boost_clock_mhz=boost_clock_mhz,
        peak_tflops=peaks,
        hbm_capacity_gb=capacity_gb,
        hbm_bandwidth_gbs=bandwidth_gbs,
        l2_cache_mb=50.0,
        smem_per_sm_kb=228,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=nvlink_gbs,
        pcie_bandwidth_gbs=128.0,
        memory_type=memory_type,
        sources={
            "peak_tflops": peak_source,
            "hbm_capacity_gb": f"{datasheet}: {capacity_gb:g} GB {memory_type}",
            "hbm_bandwidth_gbs": f"{datasheet}: {bandwidth_gbs / 1000:g} TB/s",
            "nvlink_bandwidth_gbs": f"{datasheet}: NVLink {nvlink_gbs:g} GB/s",
            "pcie_bandwidth_gbs": f"{datasheet}: PCIe Gen5 128 GB/s",
            "sm_count": "GH100 with 132 SMs enabled (as H100 SXM5), " + _H100_WHITEPAPER,
            "boost_clock_mhz": clock_source,
            "l2_cache_mb": "GH100 L2, " + _H100_WHITEPAPER,
            "smem_per_sm_kb": _HOPPER_TUNING,
            "register_file_per_sm_kb": _HOPPER_TUNING,
            **(extra_sources or {}),
        },
    )


_H800_PEAKS = dict(_GH100_SXM_PEAKS, fp64=1.0)
_H100_NVL_PEAKS = {
    "fp64": 30.0,
    "fp32": 60.0,
    "tf32": 417.5,
    "fp16": 835.5,
    "bf16": 835.5,
    "fp8": 1670.5,
    "int8": 1670.5,
}

_EXTRA_GPUS: tuple[GPUSpec, ...] = (
    _gh100_variant(
        "h800",
        "NVIDIA H800 SXM5 80GB",
        ("h800-sxm", "h800-sxm5", "h800-80gb", "h800-80gb-hbm3"),
        peaks=_H800_PEAKS,
        peak_source=_sparse_halved(
            f"{_H800_DATASHEET}: FP64 1, FP64 Tensor Core 1, FP32 67, TF32 989*, BF16/FP16 1,979*, "
            "FP8 3,958*, INT8 3,958* (the H100 SXM figures except FP64)"
        ),
        capacity_gb=80.0,
        bandwidth_gbs=3350.0,
        nvlink_gbs=400.0,
        memory_type="HBM3",
        datasheet=_H800_DATASHEET,
    ),
    _gh100_variant(
        "h100-nvl",
        "NVIDIA H100 NVL 94GB",
        ("h100nvl", "h100-nvl-94gb", "h100-94gb"),
        peaks=_H100_NVL_PEAKS,
        peak_source=_sparse_halved(
            f"{_H100_NVL}: FP64 30, FP64 Tensor Core 60, FP32 60, TF32 835*, BF16/FP16 1,671*, "
            "FP8 3,341*, INT8 3,341*"
        ),
        capacity_gb=94.0,
        bandwidth_gbs=3900.0,
        nvlink_gbs=600.0,
        memory_type="HBM3",
        datasheet=_H100_NVL,
        # its FP32 peak at 132 SMs x 128 lanes x 2 FLOP: the SXM5's 1980 MHz would give 66.9, not 60
        boost_clock_mhz=1776,
        clock_source=f"{_H100_NVL}: FP32 60 TFLOP/s / (132 SMs x 128 FP32 lanes x 2 FLOP) = 1,776 MHz",
    ),
    _gh100_variant(
        "gh200",
        "NVIDIA GH200 Grace Hopper Superchip (96GB HBM3)",
        ("gh200-96gb", "gh200-480gb", "grace-hopper"),
        peaks=_GH100_SXM_PEAKS,
        peak_source=f"{_GH200_DATASHEET}: FP64 34, FP32 67, TF32 989*, BF16/FP16 1,979*, FP8 3,958*, INT8 "
        "3,958* (2:4 sparsity figures; the H100 SXM5 die and clocks), stored dense as "
        + _GH100_SXM_PEAK_SOURCE,
        capacity_gb=96.0,
        bandwidth_gbs=4000.0,
        nvlink_gbs=900.0,
        memory_type="HBM3",
        datasheet=_GH200_DATASHEET,
        extra_sources={
            "nvlink_bandwidth_gbs": f"{_GH200_DATASHEET}: NVLink 900 GB/s GPU-GPU (NVLink-C2C to the "
            "Grace CPU is also 900 GB/s)",
            "pcie_bandwidth_gbs": f"{_GH200_DATASHEET}: PCIe Gen5 x16 lanes (128 GB/s) on the Grace side",
        },
    ),
    _gh100_variant(
        "gh200-144gb",
        "NVIDIA GH200 Grace Hopper Superchip (144GB HBM3e)",
        ("gh200-hbm3e", "gh200-624gb"),
        peaks=_GH100_SXM_PEAKS,
        peak_source=f"{_GH200_DATASHEET}: same GPU compute as the 96 GB version; {_GH100_SXM_PEAK_SOURCE}",
        capacity_gb=144.0,
        bandwidth_gbs=4900.0,
        nvlink_gbs=900.0,
        memory_type="HBM3e",
        datasheet=_GH200_DATASHEET,
    ),
    GPUSpec(
        id="t4",
        name="NVIDIA T4",
        aliases=("tesla-t4", "t4-16gb"),
        architecture="Turing",
        compute_capability=(7, 5),
        sm_count=40,
        boost_clock_mhz=1590,
        peak_tflops={"fp64": 0.25, "fp32": 8.1, "fp16": 65.0, "int8": 130.0},
        hbm_capacity_gb=16.0,
        hbm_bandwidth_gbs=320.0,
        l2_cache_mb=4.0,
        smem_per_sm_kb=64,
        register_file_per_sm_kb=256,
        nvlink_bandwidth_gbs=None,
        pcie_bandwidth_gbs=32.0,
        memory_type="GDDR6",
        sources={
            "peak_tflops": f"{_T4_DATASHEET}: FP32 8.1, mixed precision FP16/FP32 65, INT8 130 TOPS "
            "(INT4 260 TOPS, not stored); dense: Turing has no sparsity, no bf16, no tf32; fp64 = FP32/32 "
            "(CUDA Programming Guide, arithmetic throughput table, compute capability 7.5)",
            "hbm_capacity_gb": f"{_T4_DATASHEET}: 16 GB GDDR6",
            "hbm_bandwidth_gbs": f"{_T4_DATASHEET}: 320+ GB/s",
            "nvlink_bandwidth_gbs": f"{_T4_DATASHEET}: no NVLink",
            "pcie_bandwidth_gbs": f"{_T4_DATASHEET}: PCIe Gen3 x16 (32 GB/s bidirectional)",
            "sm_count": f"{_T4_DATASHEET}: 2,560 CUDA cores / 64 per Turing SM = 40 SMs",
            "boost_clock_mhz": "T4 maximum boost clock 1,590 MHz (nvidia-smi)",
            "l2_cache_mb": _TURING_WHITEPAPER,
            "smem_per_sm_kb": _TURING_TUNING,
            "register_file_per_sm_kb": _TURING_TUNING,
        },
    ),
    GPUSpec(
        id="mi300x",
        name="AMD Instinct MI300X",
        aliases=("amd-mi300x", "instinct-mi300x", "mi300x-192gb", "amd-instinct-mi300x"),
        architecture="CDNA 3",
        compute_capability=(9, 4),
        sm_count=304,
        boost_clock_mhz=2100,
        peak_tflops={
            "fp64": 81.7,
            "fp32": 163.4,
            "tf32": 653.7,
            "fp16": 1307.4,
            "bf16": 1307.4,
            "fp8": 2614.9,
            "int8": 2614.9,
        },
        hbm_capacity_gb=192.0,
        hbm_bandwidth_gbs=5300.0,
        l2_cache_mb=32.0,
        smem_per_sm_kb=64,
        register_file_per_sm_kb=512,
        nvlink_bandwidth_gbs=896.0,
        pcie_bandwidth_gbs=128.0,
        memory_type="HBM3",
        sources={
            "peak_tflops": f"{_MI300X_DATASHEET}: dense peaks FP64 vector 81.7 (matrix 163.4), FP32 vector "
            "163.4, TF32 653.7, FP16/BF16 1,307.4, FP8 2,614.9, INT8 2,614.9 TOPS (with sparsity: twice "
            "these)",
            "hbm_capacity_gb": f"{_MI300X_DATASHEET}: 192 GB HBM3",
            "hbm_bandwidth_gbs": f"{_MI300X_DATASHEET}: 5.3 TB/s peak memory bandwidth",
            "nvlink_bandwidth_gbs": f"{_MI300X_DATASHEET}: AMD Infinity Fabric, 7 links, 896 GB/s peak "
            "aggregate (stored in the NVLink field: the GPU-to-GPU fabric)",
            "pcie_bandwidth_gbs": f"{_MI300X_DATASHEET}: PCIe Gen5 x16 128 GB/s",
            "sm_count": f"{_MI300X_DATASHEET}: 304 compute units (the table's 'SM' column)",
            "boost_clock_mhz": f"{_MI300X_DATASHEET}: peak engine clock 2,100 MHz",
            "l2_cache_mb": f"{_CDNA3_WHITEPAPER}: 4 MB L2 per XCD x 8 XCDs (plus 256 MB Infinity Cache)",
            "smem_per_sm_kb": f"{_CDNA3_WHITEPAPER}: 64 KB LDS per compute unit",
            "register_file_per_sm_kb": f"{_CDNA3_WHITEPAPER}: 512 KB vector registers per compute unit",
            "compute_capability": "gfx942, which torch.cuda.get_device_capability reports as (9, 4) on ROCm",
        },
    ),
)

_GPUS = _GPUS + _EXTRA_GPUS

_BY_ID: dict[str, GPUSpec] = {gpu.id: gpu for gpu in _GPUS}


def _normalize_name(name: str) -> str:
    """Lower case, punctuation runs to '-', vendor words dropped ('NVIDIA H100 80GB' -> 'h100-80gb')."""
    key = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    for prefix in ("nvidia-", "geforce-", "tesla-"):
        key = key.removeprefix(prefix)
    return key


_ALIASES: dict[str, str] = {}
for _gpu in _GPUS:
    for _alias in (_gpu.id, _gpu.name, *_gpu.aliases):
        _ALIASES[_normalize_name(_alias)] = _gpu.id

# Names that torch.cuda.get_device_name() returns on these cards (as printed by nvidia-smi).
_DEVICE_NAMES: dict[str, str] = {
    "NVIDIA A100-SXM4-80GB": "a100-sxm-80gb",
    "NVIDIA A100-SXM4-40GB": "a100-sxm-40gb",
    "NVIDIA A100 80GB PCIe": "a100-pcie-80gb",
    "NVIDIA A100-PCIE-40GB": "a100-pcie-40gb",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA H100 PCIe": "h100-pcie",
    "NVIDIA H200": "h200",
    "NVIDIA B200": "b200",
    "NVIDIA L40S": "l40s",
    "NVIDIA L4": "l4",
    "NVIDIA GeForce RTX 4090": "rtx-4090",
    "NVIDIA H800": "h800",
    "NVIDIA H100 NVL": "h100-nvl",
    "NVIDIA GH200 480GB": "gh200",
    "Tesla T4": "t4",
    "AMD Instinct MI300X": "mi300x",
}
for _device_name, _gpu_id in _DEVICE_NAMES.items():
    _ALIASES[_normalize_name(_device_name)] = _gpu_id


def list_gpus() -> list[GPUSpec]:
    """Every GPU in the table, in table order."""
    return list(_GPUS)


def get_gpu(name: str | GPUSpec) -> GPUSpec:
    """The spec for an id ("h100-sxm"), alias ("H100", "h100_sxm5") or device name ("NVIDIA H100 80GB HBM3").

    Matching ignores case and punctuation. A :class:`GPUSpec` is returned unchanged. Raises ValueError listing
    the valid ids for an unknown name.
    """
    if isinstance(name, GPUSpec):
        return name
    if not isinstance(name, str):
        raise TypeError(f"gpu must be a GPU id string or GPUSpec, got {type(name).__name__}")
    gpu_id = _ALIASES.get(_normalize_name(name))
    if gpu_id is None:
        raise ValueError(f"unknown GPU {name!r}; valid ids: {', '.join(_BY_ID)}")
    return _BY_ID[gpu_id]


def detect_gpu() -> GPUSpec | None:
    """The table entry for the current CUDA device (from ``torch.cuda.get_device_name()``).

    Returns None when CUDA is unavailable or the device is not in the table.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        return get_gpu(torch.cuda.get_device_name())
    except ValueError:
        return None


def live_device_properties(device: int = 0) -> dict[str, Any] | None:
    """What the current CUDA device reports about itself, or None without CUDA.

    Keys: name, compute_capability, sm_count, memory_gb (decimal GB), table_id (the matching table entry, or
    None) and, when this torch exposes them: l2_cache_mb (MiB), smem_per_sm_kb and smem_per_block_optin_kb
    (KiB), register_file_per_sm_kb, sm_clock_mhz, and memory_bandwidth_gbs = 2 x memory clock x bus width / 8
    (double data rate). Peaks are not reported by the device; use the table.
    """
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(device)
    result: dict[str, Any] = {
        "name": props.name,
        "compute_capability": (props.major, props.minor),
        "sm_count": props.multi_processor_count,
        "memory_gb": props.total_memory / 1e9,
    }
    l2_bytes = getattr(props, "L2_cache_size", None)
    if l2_bytes is not None:
        result["l2_cache_mb"] = l2_bytes / 2**20
    smem_per_sm = getattr(props, "shared_memory_per_multiprocessor", None)
    if smem_per_sm is not None:
        result["smem_per_sm_kb"] = smem_per_sm / 1024
    smem_optin = getattr(props, "shared_memory_per_block_optin", None)
    if smem_optin is not None:
        result["smem_per_block_optin_kb"] = smem_optin / 1024
    registers = getattr(props, "regs_per_multiprocessor", None)
    if registers is not None:
        result["register_file_per_sm_kb"] = registers * 4 / 1024
    clock_khz = getattr(props, "clock_rate", None)
    if clock_khz:
        result["sm_clock_mhz"] = clock_khz / 1000
    memory_clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if memory_clock_khz and bus_bits:
        # Double data rate: two transfers per memory clock over the whole bus (CUDA bandwidthTest's formula).
        result["memory_bandwidth_gbs"] = 2 * memory_clock_khz * 1e3 * bus_bits / 8 / 1e9
    try:
        result["table_id"] = get_gpu(props.name).id
    except ValueError:
        result["table_id"] = None
    return result


# --- user-described GPUs ---

_INLINE_KEYS = {
    "memory_gb": "hbm_capacity_gb",
    "bandwidth_gbs": "hbm_bandwidth_gbs",
    "nvlink_gbs": "nvlink_bandwidth_gbs",
    "pcie_gbs": "pcie_bandwidth_gbs",
    "sm_count": "sm_count",
    "boost_clock_mhz": "boost_clock_mhz",
    "l2_cache_mb": "l2_cache_mb",
    "smem_per_sm_kb": "smem_per_sm_kb",
    "register_file_per_sm_kb": "register_file_per_sm_kb",
}

# The microarchitecture the prediction model (llm_speed.perf.predict) divides by: unknown (0) in a spec built
# without based_on, so predictions need them given, as does "fp32" (the CUDA cores' rate for elementwise ops).
MODEL_FIELDS = ("sm_count", "boost_clock_mhz", "l2_cache_mb", "smem_per_sm_kb", "register_file_per_sm_kb")


def prediction_gaps(spec: GPUSpec) -> list[str]:
    """The fields the prediction model needs that ``spec`` leaves unknown: :data:`MODEL_FIELDS` left at 0
    and ``fp32`` when ``peak_tflops`` has no fp32 peak. Empty for every table entry."""
    gaps = [name for name in MODEL_FIELDS if not getattr(spec, name)]
    return gaps if "fp32" in spec.peak_tflops else [*gaps, "fp32"]


def _positive_number(value: Any) -> bool:
    """A finite real number > 0 (a bool is not one)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


def custom_gpu(fields: dict[str, Any], *, origin: str = "user spec") -> GPUSpec:
    """A :class:`GPUSpec` from a dict of GPUSpec field names (``peak_tflops`` a dict of dense TFLOP/s per
    dtype). ``based_on`` (a table id) fills every field not given from that entry; without it ``id``,
    ``peak_tflops``, ``hbm_capacity_gb`` and ``hbm_bandwidth_gbs`` are required and the rest defaults to
    unknown (0, None): enough for rooflines and MFU; the prediction model also needs :data:`MODEL_FIELDS`
    and an fp32 peak (see :func:`prediction_gaps`). Every value given is recorded in ``sources`` as
    ``origin``. ValueError names a bad key.
    """
    if not isinstance(fields, dict):
        raise ValueError(f"{origin}: expected a JSON object of GPUSpec fields, got {type(fields).__name__}")
    fields = dict(fields)
    base_name = fields.pop("based_on", None)
    known = {f for f in GPUSpec.__dataclass_fields__ if f != "sources"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(
            f"{origin}: unknown keys {', '.join(unknown)}; accepted: based_on, {', '.join(sorted(known))}"
        )
    if base_name is not None:
        base = get_gpu(base_name)
        merged: dict[str, Any] = {f: getattr(base, f) for f in known}
        merged["id"] = f"{base.id}-custom"
        merged["name"] = f"{base.name} (user-modified)"
        merged["aliases"] = ()
        sources = dict(base.sources)
        if "peak_tflops" in fields:  # dtypes given replace the base's, the others are kept
            fields["peak_tflops"] = {**base.peak_tflops, **fields["peak_tflops"]}
        if "hbm_capacity_gb" in fields and "device_memory_bytes" not in fields:
            merged["device_memory_bytes"] = None  # the base's measurement is of the base's memory
    else:
        missing = [
            k for k in ("id", "peak_tflops", "hbm_capacity_gb", "hbm_bandwidth_gbs") if k not in fields
        ]
        if missing:
            raise ValueError(f"{origin}: missing {', '.join(missing)} (or give based_on: a table id)")
        merged = dict(
            name=str(fields["id"]),
            aliases=(),
            architecture="unknown",
            compute_capability=(0, 0),
            sm_count=0,
            boost_clock_mhz=0,
            l2_cache_mb=0.0,
            smem_per_sm_kb=0,
            register_file_per_sm_kb=0,
            nvlink_bandwidth_gbs=None,
            pcie_bandwidth_gbs=64.0,
            memory_type="unknown",
        )
        sources = {}
    peaks = fields.get("peak_tflops", merged.get("peak_tflops"))
    if not isinstance(peaks, dict) or not peaks:
        raise ValueError(f"{origin}: peak_tflops must be a non-empty object of dtype -> dense TFLOP/s")
    checked: dict[str, float] = {}
    for dtype, value in peaks.items():
        if not _positive_number(value):
            raise ValueError(f"{origin}: peak_tflops[{dtype!r}] must be a number > 0, got {value!r}")
        checked[normalize_dtype(dtype)] = float(value)
    fields["peak_tflops"] = checked
    # The sizes, and the microarchitecture the model divides by (0 SMs was a ZeroDivisionError deep in a
    # prediction): checked up front.
    for key in ("hbm_capacity_gb", "hbm_bandwidth_gbs", "pcie_bandwidth_gbs", "nvlink_bandwidth_gbs",
                "device_memory_bytes", *MODEL_FIELDS):  # fmt: skip
        optional = key in ("nvlink_bandwidth_gbs", "device_memory_bytes")
        if key not in fields or (optional and fields[key] is None):
            continue
        value, whole = fields[key], key == "sm_count"
        if not _positive_number(value) or (whole and value != int(value)):
            expected = "a positive integer" if whole else "a number > 0"
            raise ValueError(f"{origin}: {key} must be {expected}, got {value!r}")
        if whole:
            fields[key] = int(value)
    if "compute_capability" in fields:
        fields["compute_capability"] = tuple(fields["compute_capability"])
    merged.update(fields)
    merged["aliases"] = tuple(merged.get("aliases", ()))
    sources.update({key: origin for key in fields})
    return GPUSpec(**merged, sources=sources)


def load_gpu_spec(spec: str) -> GPUSpec:
    """A user GPU from a JSON file of GPUSpec fields (see :func:`custom_gpu`), or from an inline list
    ``"based_on=h100-sxm,bf16=800,bandwidth_gbs=3000,memory_gb=96"``: dtype names set dense TFLOP/s;
    memory_gb, bandwidth_gbs, nvlink_gbs, pcie_gbs, sm_count, boost_clock_mhz, l2_cache_mb, smem_per_sm_kb,
    register_file_per_sm_kb, id and based_on set those fields."""
    from pathlib import Path

    if not isinstance(spec, str):
        raise TypeError(f"gpu spec must be a str (a JSON path or key=value list), got {type(spec).__name__}")
    path = Path(spec).expanduser()
    if path.is_file():
        import json

        try:
            fields = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(f"gpu spec {spec!r} is not valid JSON: {error}") from error
        return custom_gpu(fields, origin=f"user GPU spec {path}")
    if "=" not in spec:
        raise ValueError(
            f"gpu spec {spec!r}: file not found, and not a key=value list (e.g. bf16=800,memory_gb=96)"
        )
    fields: dict[str, Any] = {}
    peaks: dict[str, float] = {}
    for item in spec.split(","):
        key, _, text = item.partition("=")
        key = key.strip()
        if key in ("id", "based_on"):
            fields[key] = text.strip()
            continue
        inline = key in _INLINE_KEYS  # the key checked before its value
        if not inline and key.lower().removeprefix("torch.") not in _DTYPE_ALIASES:
            raise ValueError(
                f"gpu spec item {item!r}: unknown key {key!r}; accepted: id, based_on, "
                f"{', '.join(_INLINE_KEYS)} and dtype names ({', '.join(DTYPE_BYTES)}) in TFLOP/s"
            )
        try:
            value = float(text)
        except ValueError as error:
            raise ValueError(f"gpu spec item {item!r}: {key} needs a number") from error
        if inline:
            # custom_gpu checks it (sm_count a positive integer): a whole number goes as an int.
            fields[_INLINE_KEYS[key]] = int(value) if value.is_integer() else value
        else:
            peaks[key] = value
    if peaks:
        fields["peak_tflops"] = peaks
    fields.setdefault("id", "user-gpu")
    return custom_gpu(fields, origin="user GPU spec (inline)")
