"""Memory hierarchy and attention memory: quick formulas, and a precise model beside them.

* :func:`analyze_memory_hierarchy`, :func:`calculate_attention_vram`, :func:`calculate_flash_attention_vram`
  are the old projects' quick estimates for one sequence (decimal GB), with their errors corrected: the
  standard score matrix is counted per head, and the 1 KB figure is named a streaming time, not a latency.
* :func:`estimate_attention_memory` and :func:`find_optimal_batch_size` are the ``cuda_llm_ops`` helpers'
  formulas with their signatures, counting each dtype's real size (bfloat16 is 2 bytes).
* :func:`attention_memory` is the precise model: batch, GQA, separate query/key lengths, standard vs
  FlashAttention, inference vs training (tensors saved for backward and the backward's own peak), with an
  itemised breakdown.

The old projects' literal formulas (bfloat16 as 4 bytes, one score matrix for all heads, a 1 KB "latency")
live on, for code that depends on their numbers, in :mod:`cuda_llm_ops.memory` only.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from llm_speed.core.args import check_real, positive_int
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.perf._checks import attention_shape
from llm_speed.perf.kernel_costs import SOFTMAX_STATS_BYTES

# Peak bandwidth of each level of an A100's memory hierarchy (bytes/s). The per-GPU figures of the project
# live in llm_speed.core.gpus; this small table serves the quick one-GPU overview below.
MEMORY_BANDWIDTH: dict[str, float] = {
    "shared_memory": 19e12,  # FlashAttention paper (Dao et al. 2022), Fig. 1: A100 SRAM 19 TB/s
    "l2_cache": 5120 * 1.41e9,  # A100 whitepaper: L2 reads 5,120 bytes/clock at the 1,410 MHz boost clock
    "hbm": 1.555e12,  # A100 40 GB datasheet: 1,555 GB/s
}


def bytes_to_gb(bytes_val: float) -> float:
    """Decimal gigabytes: ``bytes / 1e9``."""
    return bytes_val / 1e9


def analyze_memory_hierarchy() -> dict[str, dict[str, float]]:
    """Per level of an A100's memory hierarchy: peak bandwidth in TB/s and the time to stream 1 KB at it.

    ``stream_1kb_ns = 1024 / bandwidth * 1e9`` for each level of :data:`MEMORY_BANDWIDTH`. This is a
    throughput figure, not an access latency: a single access costs tens of cycles in shared memory and
    hundreds of cycles in L2 and HBM (Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via
    Microbenchmarking", 2018), whatever the bandwidth.
    """
    return {
        level: {"bandwidth_tb_s": bandwidth / 1e12, "stream_1kb_ns": 1024 / bandwidth * 1e9}
        for level, bandwidth in MEMORY_BANDWIDTH.items()
    }


def checked_qkv_and_output(
    seq_len: int, num_heads: int, head_dim: int, dtype_bytes: float
) -> tuple[float, float]:
    """Checked sizes, then the bytes of Q, K, V together (3*s*h*d*e) and of the output (s*h*d*e)."""
    seq_len = positive_int("seq_len", seq_len)
    num_heads = positive_int("num_heads", num_heads)
    head_dim = positive_int("head_dim", head_dim)
    dtype_bytes = positive_number("dtype_bytes", dtype_bytes)
    tensor = seq_len * num_heads * head_dim * dtype_bytes
    return 3 * tensor, tensor


def positive_number(name: str, value: Any) -> float:
    """``value`` if a finite real number > 0 (NumPy scalars accepted; :func:`check_real`'s errors naming
    ``name``), an integer kept an int (exact arithmetic, as before), anything else as a float."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
        return int(value)
    return check_real(name, value, positive=True)


def gb_breakdown(**parts: float) -> dict[str, float]:
    """Each part (bytes) in decimal GB, in order, then their ``total``."""
    return {
        **{name: bytes_to_gb(value) for name, value in parts.items()},
        "total": bytes_to_gb(sum(parts.values())),
    }


def calculate_attention_vram(
    seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int = 2
) -> dict[str, float]:
    """Standard attention memory in decimal GB for one sequence.

    qkv = 3*s*h*d*e; attention_matrix = h*s*s*e (one s x s score matrix per head); output = s*h*d*e;
    total = their sum. (The softmax output P doubles the matrix while softmax runs, and training saves more:
    :func:`attention_memory` counts those.)
    """
    qkv, output = checked_qkv_and_output(seq_len, num_heads, head_dim, dtype_bytes)
    element = positive_number("dtype_bytes", dtype_bytes)  # NumPy scalars as Python numbers
    attention_matrix = int(num_heads) * int(seq_len) * int(seq_len) * element
    return gb_breakdown(qkv=qkv, attention_matrix=attention_matrix, output=output)


def calculate_flash_attention_vram(
    seq_len: int, num_heads: int, head_dim: int, dtype_bytes: int = 2
) -> dict[str, float]:
    """FlashAttention memory in decimal GB for one sequence (the old projects' formula).

    qkv = 3*s*h*d*e; online_softmax = s*h*2*4 (running max and sum, fp32, per row and head); output = s*h*d*e.
    (FlashAttention-2 keeps max and sum in registers and stores one fp32 LSE per row: half this figure.)
    """
    qkv, output = checked_qkv_and_output(seq_len, num_heads, head_dim, dtype_bytes)
    online_softmax = seq_len * num_heads * 2 * 4
    return gb_breakdown(qkv=qkv, online_softmax=online_softmax, output=output)


def estimate_attention_memory(
    batch: int, heads: int, seq_len: int, head_dim: int, dtype: Any = "fp16"
) -> float:
    """FlashAttention memory estimate in MiB (bytes / 1024^2), with ``cuda_llm_ops``'s signature.

    inputs Q, K, V = 3*b*h*s*d*e; output = b*h*s*d*e; working memory = 0.1 * b*h*s*d*e (a 10% allowance);
    e = the dtype's size (2 for float16 and bfloat16, 4 for float32, 1 for fp8). For (2, 16, 8192, 64) this
    gives 131.2 MiB. (``cuda_llm_ops.estimate_attention_memory`` keeps the old rule: every dtype but float16
    counts 4 bytes.)
    """
    batch = positive_int("batch", batch)
    heads = positive_int("heads", heads)
    seq_len = positive_int("seq_len", seq_len)
    head_dim = positive_int("head_dim", head_dim)
    element = dtype_bytes(normalize_dtype(dtype))
    tensor = batch * heads * seq_len * head_dim * element
    input_mem = 3 * tensor
    output_mem = tensor
    working_mem = tensor * 0.1
    return (input_mem + output_mem + working_mem) / (1024 * 1024)


def find_optimal_batch_size(heads: int, seq_len: int, head_dim: int, max_memory_gb: float = 16) -> int:
    """The largest power-of-two batch whose Q, K, V, O fit in ``max_memory_gb`` GiB with 20% slack.

    per_sample = 4*h*s*d*2 bytes (fp16 Q, K, V, O);
    max_batch = int(max_memory_gb * 1024^3 / per_sample / 1.2);
    result = the largest power of two <= max_batch, at least 1. For (16, 2048, 64, 24) this gives 1024 (the
    old project's docs said "e.g. 8", which this formula does not produce).
    """
    heads = positive_int("heads", heads)
    seq_len = positive_int("seq_len", seq_len)
    head_dim = positive_int("head_dim", head_dim)
    max_memory_gb = positive_number("max_memory_gb", max_memory_gb)
    max_memory_bytes = max_memory_gb * 1024**3
    per_sample = 4 * heads * seq_len * head_dim * 2
    try:
        max_batch = int(max_memory_bytes / per_sample / 1.2)
    except OverflowError:  # a finite size past float range (1e300 GiB): exact arithmetic
        max_batch = int(Fraction(max_memory_gb) * 1024**3 / per_sample / Fraction(1.2))
    if max_batch < 1:
        return 1
    return 2 ** (max_batch.bit_length() - 1)


ATTENTION_MEMORY_IMPLS = ("flash", "standard")


@dataclass(frozen=True)
class AttentionMemory:
    """Itemised attention memory in bytes. ``peak_bytes`` is what must fit on the device at once.

    Inference (``training=False``): ``peak_bytes = forward_peak_bytes``. Training: the larger of the forward
    peak and the backward peak; ``saved_for_backward_bytes`` lists what stays alive between the two.
    ``items`` names every tensor counted in ``peak_bytes``.
    """

    impl: str
    training: bool
    dtype: str
    element_bytes: float
    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_kv: int
    head_dim: int
    q_bytes: float
    k_bytes: float
    v_bytes: float
    output_bytes: float
    kv_repeated_bytes: float  # K and V repeated to every query head (standard with GQA/MQA only), together
    scores_bytes: float  # S = QK^T, standard only
    probs_bytes: float  # P = softmax(S), standard only
    softmax_stats_bytes: float  # fp32 LSE per query row, flash only
    forward_peak_bytes: float
    saved_for_backward_bytes: float | None  # training only (None for inference)
    backward_peak_bytes: float | None  # training only (None for inference)
    peak_bytes: float
    items: dict[str, float] = field(default_factory=dict)

    @property
    def peak_gb(self) -> float:
        """``peak_bytes`` in decimal GB."""
        return self.peak_bytes / 1e9


def attention_memory(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "bf16",
    training: bool = False,
    impl: str = "flash",
) -> AttentionMemory:
    """Precise attention memory (bytes) for a batch, with GQA and separate query/key lengths.

    With e = element size, Q = O = b*hq*sq*d*e, K = V = b*hkv*skv*d*e, S = P = b*hq*sq*skv*e, L = b*hq*sq*4:

    * standard forward (matmul, softmax, matmul, as eager PyTorch runs it): S and P are both alive while
      softmax runs, then S is freed and O is allocated while P is alive:
      ``peak = Q + K + V + max(S + P, P + O)``.
    * flash forward: ``peak = Q + K + V + O + L`` (one fp32 log-sum-exp per query row, as FlashAttention-2
      stores; the running max and sum live in registers).
    * training, standard: autograd saves Q, K (for QK^T), P (softmax output, PV input) and V:
      ``saved = Q + K + V + P``. The backward runs PV's backward (dP, dV), softmax's (dS = P * (dP -
      rowsum(dP * P)); P and dP die after it), then QK^T's (dQ, dK), with O and dO alive throughout:
      ``backward = Q + K + V + O + dO + dV + max(P + dP + dS, dS + dQ + dK)`` (three s^2 tensors at once).
    * GQA/MQA, standard: eager attention repeats K and V to all ``heads_q`` heads first (``k_repeated``,
      ``v_repeated``, each b*hq*skv*d*e), alive through the forward and saved for the backward, whose dK and
      dV then have the repeated size too. FlashAttention reads the shared K/V heads directly.
    * training, flash: saved = Q + K + V + O + L; backward peak adds dO, the fp32 dQ accumulator
      (b*hq*sq*d*4, FlashAttention-2), delta = rowsum(dO * O) and the LSE in base 2 in fp32 (each L-sized),
      and dQ, dK, dV.

    Inputs and the output are counted (they occupy memory during the call); the caller's other activations
    are not. ``heads_kv`` defaults to ``heads_q`` and must divide it.
    """
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_kv, head_dim, heads_kv
    )
    if impl not in ATTENTION_MEMORY_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_MEMORY_IMPLS}, got {impl!r}")
    dtype_name = normalize_dtype(dtype)
    element = dtype_bytes(dtype_name)

    q = batch * heads_q * seq_q * head_dim * element
    kv = batch * heads_kv * seq_kv * head_dim * element
    out = q
    score = batch * heads_q * seq_q * seq_kv * element
    stats = batch * heads_q * seq_q * SOFTMAX_STATS_BYTES
    inputs = {"q": q, "k": kv, "v": kv}

    if impl == "standard":
        scores_bytes, probs_bytes, stats_bytes = score, score, 0.0
        # Eager GQA/MQA repeats K and V to every query head (repeat_interleave) before the matmuls.
        repeated = {}
        if heads_kv < heads_q:
            kv_repeated = batch * heads_q * seq_kv * head_dim * element
            repeated = {"k_repeated": kv_repeated, "v_repeated": kv_repeated}
        kv_used = repeated.get("k_repeated", kv)  # size of the K/V the matmuls (and their gradients) see
        forward_items = (
            {**inputs, **repeated, "scores": score, "probs": score}
            if score >= out
            else {**inputs, **repeated, "probs": score, "output": out}
        )
        forward_peak = sum(forward_items.values())
        saved = q + 2 * kv + sum(repeated.values()) + score
        # Autograd runs PV's backward (dP, dV), softmax's (dS; P and dP die after it), then QK^T's (dQ, dK).
        alive = {**inputs, **repeated, "output": out, "grad_output": out, "grad_v": kv_used}
        softmax_step = {**alive, "probs": score, "grad_probs": score, "grad_scores": score}
        qk_step = {**alive, "grad_scores": score, "grad_q": q, "grad_k": kv_used}
        backward_items = max(softmax_step, qk_step, key=lambda step: sum(step.values()))
    else:
        scores_bytes, probs_bytes, stats_bytes = 0.0, 0.0, float(stats)
        repeated = {}
        forward_items = {**inputs, "output": out, "softmax_lse": stats}
        forward_peak = sum(forward_items.values())
        saved = q + 2 * kv + out + stats
        dq_accum = batch * heads_q * seq_q * head_dim * 4
        backward_items = {
            **inputs,
            "output": out,
            "softmax_lse": stats,
            "grad_output": out,
            "grad_q_accum_fp32": dq_accum,
            "delta_fp32": stats,
            "softmax_lse_log2_fp32": stats,  # the LSE in base 2, made by the preprocess (FlashAttention-3's)
            "grad_q": q,
            "grad_k": kv,
            "grad_v": kv,
        }
    backward_peak = sum(backward_items.values())

    if training and backward_peak > forward_peak:
        peak, items = backward_peak, backward_items
    else:
        peak, items = forward_peak, forward_items
    return AttentionMemory(
        impl=impl,
        training=training,
        dtype=dtype_name,
        element_bytes=element,
        batch=batch,
        heads_q=heads_q,
        heads_kv=heads_kv,
        seq_q=seq_q,
        seq_kv=seq_kv,
        head_dim=head_dim,
        q_bytes=float(q),
        k_bytes=float(kv),
        v_bytes=float(kv),
        output_bytes=float(out),
        kv_repeated_bytes=float(sum(repeated.values())),
        scores_bytes=float(scores_bytes),
        probs_bytes=float(probs_bytes),
        softmax_stats_bytes=stats_bytes,
        forward_peak_bytes=float(forward_peak),
        saved_for_backward_bytes=float(saved) if training else None,
        backward_peak_bytes=float(backward_peak) if training else None,
        peak_bytes=float(peak),
        items={name: float(value) for name, value in items.items()},
    )
