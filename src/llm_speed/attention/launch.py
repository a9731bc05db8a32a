"""Launchers: pick block sizes, allocate outputs, set the constexpr switches and start the Triton kernels.

Block sizes come from ``configs.py`` (chosen by the device's shared memory per block). Under the interpreter
the same table is used; num_warps and num_stages are ignored there. The work of each call is reported to the
op table by the ops (``flash.py``, ``varlen.py``), not here, so every path is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ..core import runtime, tensors
from ..core.kernel_math import rne_by_hand
from . import kernels
from .configs import KernelConfig, backward_config, forward_config  # noqa: F401  (KernelConfig: tests use it)

KERNEL_FORWARD = "flash_attention_fwd"
KERNEL_TILED = "tiled_attention_fwd"
KERNEL_BACKWARD_PREPROCESS = "flash_attention_bwd_preprocess"
KERNEL_BACKWARD_DKDV = "flash_attention_bwd_dkdv"
KERNEL_BACKWARD_DQ = "flash_attention_bwd_dq"

MIN_DOT_DIM = 16  # tl.dot needs every tile dim >= 16


def _padded_head_dim(head_dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def _dot_switches(dtype: torch.dtype) -> dict:
    return {
        # The interpreter's tl.dot is wrong on bfloat16: widen the (already bf16-rounded) tiles there only.
        "DOT_IN_FP32": runtime.INTERPRETED and dtype == torch.bfloat16,
        # float32 inputs get a true float32 product, not TF32 (ignored for 16-bit inputs).
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
        # float32 -> bfloat16 casts round to nearest even under the interpreter too.
        "RNE_BY_HAND": rne_by_hand(dtype),
    }


@dataclass(frozen=True)
class Masking:
    """What each query sees and how scores are shaped: the causal flag folded into the window's right side.

    ``window`` is ``(left, right)`` with None for an unbounded side (``reference.visible`` is the spec);
    ``softcap`` None or > 0.
    """

    is_causal: bool = False
    window: tuple[int | None, int | None] | None = None
    softcap: float | None = None

    def kernel_args(self, scale: float) -> dict:
        left, right = self.window if self.window is not None else (None, None)
        if self.is_causal:
            right = 0
        return {
            "scale": scale,
            "softcap": self.softcap if self.softcap is not None else 1.0,
            "window_left": left if left is not None else 0,
            "window_right": right if right is not None else 0,
            "HAS_LEFT": left is not None,
            "HAS_RIGHT": right is not None,
            "SOFTCAP": self.softcap is not None,
        }


@dataclass(frozen=True)
class Packed:
    """Packed sequences (flash-attn's varlen layout): tensors ``[total, heads, head_dim]``, sequence b in
    rows ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1``; ``cu_seqlens_*`` int32 ``[batch + 1]``."""

    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor

    @property
    def batch(self) -> int:
        return self.cu_seqlens_q.shape[0] - 1


def _strides(t: torch.Tensor, packed: Packed | None) -> tuple[int, int, int]:
    """(batch, head, row) strides: dense ``[B, H, S, D]``, or packed ``[T, H, D]`` as one batch."""
    if packed is None:
        return t.stride(0), t.stride(1), t.stride(2)
    return 0, t.stride(1), t.stride(0)


_ROW_LETTER = {"q": "m", "o": "m", "do": "m", "dq": "m", "k": "n", "v": "n", "dk": "n", "dv": "n"}


def _stride_args(packed: Packed | None, **tensors: torch.Tensor) -> dict:
    """Keyword stride arguments ``stride_<name>b/h/<row>`` of each named tensor, as the kernels spell them."""
    args = {}
    for name, t in tensors.items():
        stride_b, stride_h, stride_row = _strides(t, packed)
        args.update({f"stride_{name}b": stride_b, f"stride_{name}h": stride_h})
        args[f"stride_{name}{_ROW_LETTER[name]}"] = stride_row
    return args


def _lse_strides(lse: torch.Tensor, packed: Packed | None) -> tuple[int, int]:
    """(batch, head) strides of a row statistic: dense ``[B, H, S]``, packed ``[H, T]``."""
    return (lse.stride(0), lse.stride(1)) if packed is None else (0, lse.stride(0))


def _grid(
    n_rows: int, block: int, batch: int, heads: int, packed: Packed | None, cu_seqlens: torch.Tensor | None
) -> tuple[tuple[int], dict]:
    """1-D grid and the kernel arguments that let each program find its rows (``kernels._program``).

    Dense: ``cdiv(seq, block)`` programs per (batch, head). Packed: ``cdiv(total, block) + batch`` per head,
    an upper bound on the real block count (each sequence wastes at most one partial block) known without
    reading the lengths back to the host; the real per-sequence block counts are summed on the device into
    ``BLOCK_STARTS`` ``[batch + 1]``, which each program searches for its sequence. Spare programs exit
    having written nothing. A second grid axis would cap batch * heads at 65535 on CUDA.
    """
    if packed is None:
        return (triton.cdiv(n_rows, block) * batch * heads,), {"batch": batch, "grid_blocks": 0, "BLOCK_B": 1}
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.zeros(batch + 1, dtype=torch.int32, device=cu_seqlens.device)
    starts[1:] = torch.cumsum(torch.div(lengths + (block - 1), block, rounding_mode="floor"), 0)
    grid_blocks = triton.cdiv(n_rows, block) + batch
    args = {"batch": batch, "grid_blocks": grid_blocks, "BLOCK_B": triton.next_power_of_2(batch)}
    return (grid_blocks * heads,), dict(args, BLOCK_STARTS=starts)


def _sequence_args(q, packed: Packed | None) -> dict:
    if packed is None:
        # Dense programs never read these pointers; any tensor will do.
        return {"CU_Q": q, "CU_K": q, "BLOCK_STARTS": q}
    return {"CU_Q": packed.cu_seqlens_q, "CU_K": packed.cu_seqlens_k}


def _shape(q, k, packed: Packed | None):
    """(batch, heads_q, heads_kv, seq_q, seq_kv, head_dim); packed: seq_* are the totals, batch from cu."""
    if packed is None:
        batch, heads_q, seq_q, head_dim = q.shape
        return batch, heads_q, k.shape[1], seq_q, k.shape[2], head_dim
    return packed.batch, q.shape[1], k.shape[1], q.shape[0], k.shape[0], q.shape[2]


def forward(q, k, v, masking: Masking, scale: float, two_pass: bool = False, packed: Packed | None = None):
    """Launch the flash (or, with ``two_pass``, the tiled) forward. Returns (out contiguous, lse float32):
    dense ``[B, Hq, Sq, D]`` and ``[B, Hq, Sq]``, packed ``[Tq, Hq, D]`` and ``[Hq, Tq]``."""
    batch, heads_q, heads_kv, seq_q, seq_kv, head_dim = _shape(q, k, packed)
    out = tensors.new_output(q.shape, q.dtype, q.device)
    lse_shape = (batch, heads_q, seq_q) if packed is None else (heads_q, seq_q)
    lse = tensors.new_output(lse_shape, torch.float32, q.device)
    block_d = _padded_head_dim(head_dim)
    config = forward_config(block_d, q.dtype)
    grid, grid_args = _grid(
        seq_q, config.block_m, batch, heads_q, packed, packed.cu_seqlens_q if packed else None
    )
    stride_lb, stride_lh = _lse_strides(lse, packed)
    kernels._attention_fwd_kernel[grid](
        Q=q, K=k, V=v, O=out, LSE=lse, **_sequence_args(q, packed), **grid_args,
        **_stride_args(packed, q=q, k=k, v=v, o=out), stride_lb=stride_lb, stride_lh=stride_lh,
        heads_q=heads_q, group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
        **masking.kernel_args(scale),
        TWO_PASS=two_pass,
        IS_VARLEN=packed is not None,
        EVEN_M=packed is None and seq_q % config.block_m == 0,
        EVEN_N=packed is None and seq_kv % config.block_n == 0,
        EVEN_D=head_dim == block_d,
        **_dot_switches(q.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    runtime.record_launch(KERNEL_TILED if two_pass else KERNEL_FORWARD)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, masking: Masking, scale: float, packed: Packed | None = None):
    """Launch the three backward kernels: delta = rowsum(dO * O) - dLSE, then dK/dV over key blocks, then dQ.

    dK/dV and dQ come from separate kernels so every output element has exactly one writer: no atomics, and
    the result is bitwise repeatable. Layouts as :func:`forward`.
    """
    batch, heads_q, heads_kv, seq_q, seq_kv, head_dim = _shape(q, k, packed)
    block_d = _padded_head_dim(head_dim)
    even_d = head_dim == block_d
    switches = _dot_switches(q.dtype)
    mask_args = masking.kernel_args(scale)
    stride_lb, stride_lh = _lse_strides(lse, packed)
    sequences = _sequence_args(q, packed)

    # delta: packed rows run as one batch of total_q rows (rows are independent here).
    fwd_cfg = forward_config(block_d, q.dtype)
    delta = tensors.new_output(lse.shape, torch.float32, q.device)
    rows_batch = batch if packed is None else 1
    kernels._flash_bwd_preprocess_kernel[(triton.cdiv(seq_q, fwd_cfg.block_m) * rows_batch * heads_q,)](
        O=out, DO=dout, DLSE=dlse if dlse is not None else delta, DELTA=delta,
        **_stride_args(packed, o=out, do=dout), stride_lb=stride_lb, stride_lh=stride_lh,
        heads_q=heads_q, seq_q=seq_q, head_dim=head_dim,
        HAS_DLSE=dlse is not None, EVEN_M=seq_q % fwd_cfg.block_m == 0, EVEN_D=even_d,
        BLOCK_M=fwd_cfg.block_m, BLOCK_D=block_d,
    )  # fmt: skip
    runtime.record_launch(KERNEL_BACKWARD_PREPROCESS)

    dk = tensors.new_output(k.shape, k.dtype, k.device)
    dv = tensors.new_output(v.shape, v.dtype, v.device)
    dq = tensors.new_output(q.shape, q.dtype, q.device)
    cfg = backward_config(block_d, q.dtype)
    # What the dK/dV and dQ kernels share: inputs, strides, sizes, masking and dtype switches.
    common = dict(
        Q=q, K=k, V=v, DO=dout, LSE=lse, DELTA=delta, **sequences,
        **_stride_args(packed, q=q, k=k, v=v, do=dout), stride_lb=stride_lb, stride_lh=stride_lh,
        group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim, **mask_args,
        IS_VARLEN=packed is not None, EVEN_D=even_d, **switches, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid, grid_args = _grid(
        seq_kv, cfg.block_n, batch, heads_kv, packed, packed.cu_seqlens_k if packed else None
    )
    kernels._flash_bwd_dkdv_kernel[grid](
        **common, **grid_args, DK=dk, DV=dv, **_stride_args(packed, dk=dk, dv=dv), heads_kv=heads_kv,
        EVEN_M=packed is None and seq_q % cfg.block_m == 0,
        EVEN_N=packed is None and seq_kv % cfg.block_n == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
    )  # fmt: skip
    runtime.record_launch(KERNEL_BACKWARD_DKDV)

    # dQ holds Q, dO and the fp32 dQ accumulator [BM, BD]; K and V stream, like the forward.
    grid, grid_args = _grid(
        seq_q, cfg.block_n, batch, heads_q, packed, packed.cu_seqlens_q if packed else None
    )
    kernels._flash_bwd_dq_kernel[grid](
        **common, **grid_args, DQ=dq, **_stride_args(packed, dq=dq), heads_q=heads_q,
        EVEN_M=packed is None and seq_q % cfg.block_n == 0,
        EVEN_N=packed is None and seq_kv % cfg.block_m == 0,
        BLOCK_M=cfg.block_n, BLOCK_N=cfg.block_m,
    )  # fmt: skip
    runtime.record_launch(KERNEL_BACKWARD_DQ)
    return dq, dk, dv
