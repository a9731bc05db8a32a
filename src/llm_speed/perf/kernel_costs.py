"""FLOPs and minimum DRAM bytes of the kernels llm-speed benchmarks, so predictions sit next to measurements.

Conventions (stated once, used everywhere):

* FLOPs count multiply-adds as 2 FLOPs and only matrix products (the Tensor Core work); softmax, scaling and
  masking are O(s^2) elementwise work that no published TFLOP/s figure counts (FlashAttention-2 paper, Sec. 4;
  its benchmark script uses the same 4*b*h*s_q*s_kv*d forward count).
* Bytes are the minimum DRAM traffic of the named algorithm: every tensor it must read is read once, every
  tensor it must write is written once. Real kernels re-read K/V tiles (mostly from L2), so measured DRAM
  traffic is at least this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.gpus import dtype_bytes
from llm_speed.core.hardware import Hardware, default_hardware
from llm_speed.core.policy import current_policy
from llm_speed.core.tiers import ATTENTION_TIER_FLOORS, first_fitting
from llm_speed.perf._checks import attention_shape

ATTENTION_MODES = ("fwd", "bwd", "fwd+bwd")
ATTENTION_IMPLS = ("flash", "tiled", "naive")

# FlashAttention's backward runs 5 matmuls (recompute S = QK^T, dV = P^T dO, dP = dO V^T, dQ = dS K,
# dK = dS^T Q) against the forward's 2 (S = QK^T, O = PV): 5/2 = 2.5x (FlashAttention-2 paper, Sec. 4).
BACKWARD_TO_FORWARD_FLOPS = 2.5

# LSE (log-sum-exp per query row) and the backward's delta = rowsum(dO * O) are kept in fp32.
SOFTMAX_STATS_BYTES = 4


@dataclass(frozen=True)
class KernelCost:
    """Work and minimum DRAM traffic of one kernel call."""

    flops: float
    bytes_moved: float

    @property
    def intensity(self) -> float:
        """Arithmetic intensity ``flops / bytes_moved`` in FLOP/byte."""
        return self.flops / self.bytes_moved if self.bytes_moved else float("inf")

    def __add__(self, other: KernelCost) -> KernelCost:
        return KernelCost(self.flops + other.flops, self.bytes_moved + other.bytes_moved)


def _check_mode_and_impl(mode: str, impl: str) -> None:
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode must be one of {ATTENTION_MODES}, got {mode!r}")
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")


def flash_attention_bytes(q_elems: int, kv_elems: int, rows: int, element: int) -> tuple[int, int]:
    """Minimum DRAM bytes of the flash forward and backward (the formula in :func:`attention_cost`):
    ``q_elems``/``kv_elems`` elements of Q (= O) and of K (= V), ``rows`` softmax rows, ``element`` bytes."""
    forward = element * (2 * q_elems + 2 * kv_elems) + SOFTMAX_STATS_BYTES * rows
    backward = element * (4 * q_elems + 4 * kv_elems) + 3 * SOFTMAX_STATS_BYTES * rows
    return forward, backward


def attention_cost_for_mode(
    forward_flops: float, forward_bytes: float, backward_bytes: float, mode: str
) -> KernelCost:
    """The forward, backward (2.5x the forward's model FLOPs) or both, as ``mode`` asks."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"mode must be one of {ATTENTION_MODES}, got {mode!r}")
    forward = KernelCost(float(forward_flops), float(forward_bytes))
    backward = KernelCost(BACKWARD_TO_FORWARD_FLOPS * forward_flops, float(backward_bytes))
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def visible_pairs(seq_q: int, seq_kv: int, causal: bool) -> int:
    """Number of (query, key) pairs attention computes, per batch element and query head.

    Non-causal: ``seq_q * seq_kv``. Causal uses bottom-right alignment (FlashAttention >= 2.1, PyTorch's
    ``causal_lower_right``): query ``i`` sees keys ``j <= i + seq_kv - seq_q``, i.e.
    ``max(0, i + seq_kv - seq_q + 1)`` keys. Summing that arithmetic series over the rows that see at least
    one key gives the closed form below; for a square ``s x s`` mask it is ``s (s + 1) / 2``, about half.
    """
    seq_q = positive_int("seq_q", seq_q, allow_zero=True)
    seq_kv = positive_int("seq_kv", seq_kv, allow_zero=True)
    if not causal:
        return seq_q * seq_kv
    offset = seq_kv - seq_q
    first_row = max(0, -offset)  # rows before this see no key at all
    rows = seq_q - first_row
    if rows <= 0:
        return 0
    first_count = first_row + offset + 1
    last_count = seq_kv  # the last query row sees every key
    return rows * (first_count + last_count) // 2


def attention_cost(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    causal: bool = False,
    mode: str = "fwd",
    impl: str = "flash",
    score_dtype: Any = None,
    out_dtype: Any = None,
) -> KernelCost:
    """FLOPs and minimum DRAM bytes of scaled-dot-product attention.

    FLOPs (all impls): forward = ``4 * batch * heads_q * head_dim * visible_pairs`` (QK^T and PV, 2 FLOPs per
    multiply-add each); backward = 2.5x forward (5 matmuls vs 2, FlashAttention-2 convention; a naive backward
    that keeps P executes only 4, i.e. 2x, but the model-FLOP convention stays 2.5x so TFLOP/s compare).
    Causal counts only visible pairs (see :func:`visible_pairs`).

    Bytes, with e = element size, Nq = batch*heads_q*seq_q*head_dim, Nk = batch*heads_kv*seq_kv*head_dim,
    R = batch*heads_q*seq_q (softmax rows), M = batch*heads_q*seq_q*seq_kv (full score matrix, masked or not),
    e_s = element size of the naive score matrices (``score_dtype``, default ``dtype``; the project's
    ``naive_attention`` keeps them in fp32):

    * flash (FlashAttention-2, ``llm_speed.flash_attention``): forward reads Q, K, V, writes O and the fp32
      LSE: ``e*(2*Nq + 2*Nk) + 4*R``. Backward reads Q, K, V, O, dO and the LSE, writes and reads
      delta = rowsum(dO*O) (fp32), writes dQ, dK, dV: ``e*(4*Nq + 4*Nk) + 3*4*R``.
    * tiled (two-pass safe softmax, ``llm_speed.tiled_attention``): pass 1 reads K for the row maxima, pass 2
      reads K again and V, so K is read twice: ``e*(2*Nq + 3*Nk) + 4*R``; its backward is flash's.
      (It also computes QK^T twice: executed FLOPs are 1.5x the forward's model FLOPs.)
    * naive (textbook: S written, read by softmax, P written, read by PV): forward
      ``e*(2*Nq + 2*Nk) + 4*e_s*M``; backward (P read for dV, dP written and read, P read again, dS written,
      dS read for dQ and for dK) ``e*(4*Nq + 4*Nk) + 7*e_s*M``. Eager PyTorch makes more passes than this
      (scale, max, subtract, exp, sum, divide each read and write M elements), so it lands above this floor.

    ``heads_kv`` (GQA/MQA) defaults to ``heads_q`` and must divide it. ``out_dtype``: the forward output's
    dtype where it is not ``dtype`` (fp8 attention reads e4m3 and writes bfloat16, FlashAttention-3's):
    O's ``Nq`` elements are counted at its size (forward only: there is no fp8 backward).
    """
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_kv, head_dim, heads_kv
    )
    _check_mode_and_impl(mode, impl)
    element = dtype_bytes(dtype)
    score_element = element if score_dtype is None else dtype_bytes(score_dtype)

    forward_flops = 4 * batch * heads_q * head_dim * visible_pairs(seq_q, seq_kv, causal)
    q_elems = batch * heads_q * seq_q * head_dim
    kv_elems = batch * heads_kv * seq_kv * head_dim
    rows = batch * heads_q * seq_q
    score_elems = batch * heads_q * seq_q * seq_kv

    if impl == "naive":
        forward_bytes = element * (2 * q_elems + 2 * kv_elems) + 4 * score_element * score_elems
        backward_bytes = element * (4 * q_elems + 4 * kv_elems) + 7 * score_element * score_elems
    else:  # flash, and tiled whose backward is flash's
        forward_bytes, backward_bytes = flash_attention_bytes(q_elems, kv_elems, rows, element)
        if impl == "tiled":
            forward_bytes += element * kv_elems  # the second pass reads K again
    if out_dtype is not None:
        forward_bytes += (dtype_bytes(out_dtype) - element) * q_elems
    return attention_cost_for_mode(forward_flops, forward_bytes, backward_bytes, mode)


# Matmuls each implementation executes, as multiples of the forward's two (QK^T, PV).
_EXECUTED_FORWARD_MATMULS = {"flash": 2, "tiled": 3, "naive": 2}  # tiled: QK^T in both passes
# flash/tiled: by default the dK/dV kernel runs S, dP, dV, dK and adds dQ by atomics (5, FlashAttention-2's);
# the deterministic path (``deterministic=True`` or PyTorch's deterministic mode) has a separate dQ kernel
# that recomputes S and dP before dQ (7: the price of a backward without atomics); naive keeps P (4).
_EXECUTED_BACKWARD_MATMULS = {"flash": 5, "tiled": 5, "naive": 4}
_DETERMINISTIC_BACKWARD_MATMULS = {"flash": 7, "tiled": 7, "naive": 4}


def backward_dq_kernel_by_default(gpu: Any = None) -> bool:
    """Whether llm-speed's attention backward computes dQ in a kernel of its own by default on ``gpu`` (a
    table id or GPUSpec; None: the stand-in H100 SXM), under the current launch policy: the launcher's rule
    (:meth:`LaunchPolicy.dq_kernel_on`) on the GPU's attention tier (``core.tiers``' floors)."""
    hardware = default_hardware() if gpu is None else Hardware.from_spec(gpu)
    return current_policy().dq_kernel_on(first_fitting(ATTENTION_TIER_FLOORS, hardware).name)


def attention_hardware_flops(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    causal: bool = False,
    mode: str = "fwd",
    impl: str = "flash",
    deterministic: bool | None = None,
    gpu: Any = None,
) -> float:
    """Matmul FLOPs an implementation actually executes (for HFU), against :func:`attention_cost`'s model
    FLOPs (for MFU). Each (Q, K) or (P, V) matmul over the visible pairs costs 2 * batch * heads_q * head_dim
    * visible_pairs. Forward: flash and naive run 2 matmuls, tiled 3 (its second pass recomputes QK^T: 1.5x).
    Backward, flash and tiled: 5 when dQ is added by atomics from the dK/dV kernel (S, dP, dV, dK, dQ: 2.5x
    the forward), 7 when dQ has a kernel of its own that recomputes S and dP (every dQ element has one
    writer: 3.5x). ``deterministic`` True is that second path (``deterministic=True`` or PyTorch's
    deterministic mode), False the first; None (the default) is what the backward runs by default on ``gpu``
    (a table id or :class:`GPUSpec`; None: the H100 SXM that stands in without a device) under the current
    launch policy: its own dQ kernel on the H100/H200's 227 KB tier, atomics on the smaller tiers. Naive: 4
    (P was kept: 2x the forward instead of 2.5x). Masked-out work inside partially visible tiles is not
    counted; it depends on the tile size."""
    batch, heads_q, seq_q, seq_kv, head_dim, _ = attention_shape(
        batch, heads_q, seq_q, seq_kv, head_dim, None
    )
    _check_mode_and_impl(mode, impl)
    if deterministic is None:
        deterministic = backward_dq_kernel_by_default(gpu)
    one_matmul = 2.0 * batch * heads_q * head_dim * visible_pairs(seq_q, seq_kv, causal)
    forward = _EXECUTED_FORWARD_MATMULS[impl] * one_matmul
    matmuls = _DETERMINISTIC_BACKWARD_MATMULS if deterministic else _EXECUTED_BACKWARD_MATMULS
    backward = matmuls[impl] * one_matmul
    return {"fwd": forward, "bwd": backward, "fwd+bwd": forward + backward}[mode]


def gemm_cost(
    m: int,
    n: int,
    k: int,
    *,
    dtype: Any = "fp16",
    batch: int = 1,
    out_dtype: Any = None,
    with_c: bool = False,
    with_bias: bool = False,
) -> KernelCost:
    """FLOPs and minimum DRAM bytes of ``D = A @ B (+ C) (+ bias)`` with A [m, k], B [k, n], D [m, n].

    FLOPs = ``2 * m * n * k * batch`` (the cuBLAS / Triton-tutorial convention; the O(mn) epilogue adds are
    not counted). Bytes = ``batch * (m*k + k*n) * e_in + batch * m*n * e_out`` (+ ``batch*m*n*e_out`` to read
    C, + ``n*e_out`` for one bias row shared by the batch). ``out_dtype`` defaults to ``dtype``.
    """
    m = positive_int("m", m)
    n = positive_int("n", n)
    k = positive_int("k", k)
    batch = positive_int("batch", batch)
    in_bytes = dtype_bytes(dtype)
    out_bytes = in_bytes if out_dtype is None else dtype_bytes(out_dtype)
    flops = 2 * m * n * k * batch
    bytes_moved = batch * (m * k + k * n) * in_bytes + batch * m * n * out_bytes
    if with_c:
        bytes_moved += batch * m * n * out_bytes
    if with_bias:
        bytes_moved += n * out_bytes
    return KernelCost(float(flops), float(bytes_moved))


def kvcache_decode_cost(
    batch: int,
    heads_q: int,
    seq_q: int,
    context: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    seq_new: int = 0,
    causal: bool = False,
    kv_dtype: Any = None,
    window: tuple[int | None, int | None] | None = None,
) -> KernelCost:
    """FLOPs and minimum DRAM bytes of ``llm_speed.flash_attention_with_kvcache`` (decode over a KV cache).

    ``context`` is the number of keys each sequence attends to (``cache_seqlens + seq_new``), ``seq_new``
    how many of them the call appends. FLOPs as :func:`attention_cost`'s forward over the (query, key) pairs
    the queries (the last ``seq_q`` positions) compute: all ``seq_q x context``, or under ``causal`` or a
    ``window`` (left, right; flash-attn's) those :func:`window_visible_pairs` counts. Bytes, with e =
    element size: the visible cache read once, ``2*e*batch*heads_kv*context*head_dim`` (K and V, whatever
    the page layout: pages are whole rows), Q read and O written ``2*e*batch*heads_q*seq_q*head_dim``, the
    fp32 LSE ``4*batch*heads_q*seq_q``, and the append (new K/V read, then written into the cache)
    ``4*e*batch*heads_kv*seq_new*head_dim``. Split-KV's partial results and the int32 lengths/block table
    are not counted: they are small beside the cache and not part of the minimum. At seq_q = 1 the
    intensity is about ``heads_q / heads_kv`` FLOP/byte: decode is bound by memory bandwidth on every GPU in
    the table.

    ``kv_dtype``: the cache's dtype when it is not ``dtype`` (an fp8 cache: "fp8", ``torch.float8_e4m3fn``):
    the cache is read at its element size ``c`` (``2*c*batch*heads_kv*context*head_dim``), and the append
    reads the new K/V at ``e`` and writes them at ``c`` (``2*(e + c)*batch*heads_kv*seq_new*head_dim``).
    The descales (a few floats) are not counted.
    """
    batch, heads_q, seq_q, context, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, context, head_dim, heads_kv
    )
    seq_new = positive_int("seq_new", seq_new, allow_zero=True)
    if seq_new > context:
        raise ValueError(f"seq_new ({seq_new}) cannot exceed context ({context}): appended keys are attended")
    element = dtype_bytes(dtype)
    cache_element = element if kv_dtype is None else dtype_bytes(kv_dtype)
    pairs = window_visible_pairs(seq_q, context, is_causal=causal, window=window)
    flops = 4 * batch * heads_q * head_dim * pairs
    # Q, O, the LSE and the visible cache are flash's forward traffic; the append comes on top.
    rows = batch * heads_q * seq_q
    q_bytes, _ = flash_attention_bytes(rows * head_dim, 0, rows, element)
    cache_bytes = 2 * cache_element * batch * heads_kv * context * head_dim
    append_bytes = 2 * (element + cache_element) * batch * heads_kv * seq_new * head_dim
    return KernelCost(float(flops), float(q_bytes + cache_bytes + append_bytes))


# --- windowed and packed (varlen) FlashAttention ------------------------------------------------------
# FLOPs count the visible (query, key) pairs; the minimum bytes are the flash algorithm's (a window shrinks
# the FLOPs, not the minimum bytes: every key is still read by some query block unless no query sees it,
# which these counts ignore).


def window_visible_pairs(
    seq_q: int, seq_kv: int, *, is_causal: bool = False, window: tuple[int | None, int | None] | None = None
) -> int:
    """(query, key) pairs a head computes under ``is_causal`` and ``window`` (``reference.visible``'s rule:
    query i sees keys ``p - left <= j <= p + right`` with ``p = i + seq_kv - seq_q``). Counted, not listed:
    the keys a row sees are a piecewise-linear function of ``p`` (it changes slope only where the window
    meets either end of the keys or sees none), so each piece is an arithmetic series; O(1) at any length."""
    seq_q = positive_int("seq_q", seq_q, allow_zero=True)
    seq_kv = positive_int("seq_kv", seq_kv, allow_zero=True)
    left, right = window if window is not None else (None, None)
    if is_causal:
        right = 0
    if not seq_q or not seq_kv:
        return 0
    first_p, end_p = seq_kv - seq_q, seq_kv  # p over [first_p, end_p)
    # an unbounded side as a bound past every row (the first key, or the last, for every p)
    left = end_p if left is None else left
    right = seq_kv - first_p if right is None else right

    def seen(p: int) -> int:
        return max(0, min(seq_kv - 1, p + right) - max(0, p - left) + 1)

    # where the count may change slope: the window's start reaches key 0, its end the last key, and where
    # it begins and stops seeing any key
    kinks = {left, seq_kv - 1 - right, -right, seq_kv - 1 + left}
    cuts = sorted({first_p, end_p, *(c for c in kinks for c in (c, c + 1) if first_p < c < end_p)})
    pairs = 0
    for start, stop in zip(cuts, cuts[1:], strict=False):  # [start, stop): linear in p
        pairs += (seen(start) + seen(stop - 1)) * (stop - start) // 2
    return pairs


def _flash_cost(forward_flops, q_elems, kv_elems, rows, element, mode) -> KernelCost:
    return attention_cost_for_mode(
        forward_flops, *flash_attention_bytes(q_elems, kv_elems, rows, element), mode
    )


def window_attention_cost(
    batch: int,
    heads_q: int,
    seq_q: int,
    seq_kv: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mode: str = "fwd",
) -> KernelCost:
    """Cost of ``flash_attention(..., is_causal=, window=)``: FLOPs over the visible pairs only."""
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_kv, head_dim, heads_kv
    )
    pairs = window_visible_pairs(seq_q, seq_kv, is_causal=is_causal, window=window)
    return _flash_cost(
        4 * batch * heads_q * head_dim * pairs,
        batch * heads_q * seq_q * head_dim,
        batch * heads_kv * seq_kv * head_dim,
        batch * heads_q * seq_q,
        dtype_bytes(dtype),
        mode,
    )


def varlen_attention_cost(
    lengths_q: Sequence[int],
    lengths_k: Sequence[int],
    heads_q: int,
    head_dim: int,
    *,
    heads_kv: int | None = None,
    dtype: Any = "fp16",
    is_causal: bool = False,
    window: tuple[int | None, int | None] | None = None,
    mode: str = "fwd",
) -> KernelCost:
    """Cost of ``flash_attention_varlen`` for sequences of these lengths: each sequence attends within itself,
    so FLOPs are the sum over sequences (not batch x max_seqlen); bytes are of the packed totals."""
    if len(lengths_q) != len(lengths_k):
        raise ValueError(f"lengths_q and lengths_k must have one entry per sequence, got {len(lengths_q)} "
                         f"and {len(lengths_k)}")  # fmt: skip
    _, heads_q, _, _, head_dim, heads_kv = attention_shape(1, heads_q, 1, 1, head_dim, heads_kv)
    pairs = sum(
        window_visible_pairs(sq, sk, is_causal=is_causal, window=window)
        for sq, sk in zip(lengths_q, lengths_k, strict=True)
    )
    total_q, total_k = sum(lengths_q), sum(lengths_k)
    return _flash_cost(
        4 * heads_q * head_dim * pairs,
        heads_q * total_q * head_dim,
        heads_kv * total_k * head_dim,
        heads_q * total_q,
        dtype_bytes(dtype),
        mode,
    )


def expected_experts_hit(num_experts: int, experts_per_token: int, num_tokens: float) -> float:
    """E * (1 - (1 - k/E)^T): expected number of distinct experts that T tokens choosing k of E experts
    uniformly at random touch (each expert is missed by one token with probability 1 - k/E)."""
    return num_experts * (1.0 - (1.0 - experts_per_token / num_experts) ** num_tokens)
