"""Launchers: pick block sizes, allocate outputs, set the constexpr switches and start the Triton kernels.

Block sizes come from ``configs.py`` (chosen by the device's shared memory per block). Under the interpreter
the same table is used; num_warps and num_stages are ignored there.
"""

from __future__ import annotations

import math

import torch
import triton

from .. import _runtime
from . import kernels
from .configs import BlockConfig, backward_config, forward_config  # noqa: F401  (BlockConfig: tests use it)

KERNEL_FORWARD = "flash_attention_fwd"
KERNEL_TILED = "tiled_attention_fwd"
KERNEL_BACKWARD_PREPROCESS = "flash_attention_bwd_preprocess"
KERNEL_BACKWARD_DKDV = "flash_attention_bwd_dkdv"
KERNEL_BACKWARD_DQ = "flash_attention_bwd_dq"

MIN_DOT_DIM = 16  # tl.dot needs every tile dim >= 16


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised). One function so tests can poison every output with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def _padded_head_dim(head_dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


def _dot_switches(dtype: torch.dtype) -> dict:
    return {
        # The interpreter's tl.dot is wrong on bfloat16: widen the (already bf16-rounded) tiles there only.
        "DOT_IN_FP32": _runtime.INTERPRETED and dtype == torch.bfloat16,
        # float32 inputs get a true float32 product, not TF32 (ignored for 16-bit inputs).
        "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32",
    }


def _strides3(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _qk_scale_log2(scale: float) -> float:
    return scale * math.log2(math.e)


def _grid(n_rows: int, block: int, batch_heads: int) -> tuple[int]:
    """1-D grid: one program per block of rows of each (batch, head). The kernels split the program id back
    (``kernels._block_and_head``); a second grid axis would cap batch * heads at 65535 on CUDA."""
    return (triton.cdiv(n_rows, block) * batch_heads,)


def forward(q, k, v, is_causal: bool, scale: float, two_pass: bool = False):
    """Launch the flash (or, with ``two_pass``, the tiled) forward. Returns (out contiguous, lse float32)."""
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    out = new_output((batch, heads_q, seq_q, head_dim), q.dtype, q.device)
    lse = new_output((batch, heads_q, seq_q), torch.float32, q.device)
    block_d = _padded_head_dim(head_dim)
    config = forward_config(block_d, q.dtype)
    kernels._attention_fwd_kernel[_grid(seq_q, config.block_m, batch * heads_q)](
        q, k, v, out, lse,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(out),
        heads_q, heads_q // heads_kv, seq_q, seq_kv, head_dim, _qk_scale_log2(scale),
        TWO_PASS=two_pass,
        IS_CAUSAL=is_causal,
        EVEN_M=seq_q % config.block_m == 0,
        EVEN_N=seq_kv % config.block_n == 0,
        EVEN_D=head_dim == block_d,
        **_dot_switches(q.dtype),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=block_d,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    _runtime.record_launch(KERNEL_TILED if two_pass else KERNEL_FORWARD)
    return out, lse


def backward(dout, q, k, v, out, lse, dlse, is_causal: bool, scale: float):
    """Launch the three backward kernels: delta = rowsum(dO * O) - dLSE, then dK/dV over key blocks, then dQ.

    dK/dV and dQ come from separate kernels so every output element has exactly one writer: no atomics, and
    the result is bitwise repeatable.
    """
    batch, heads_q, seq_q, head_dim = q.shape
    heads_kv, seq_kv = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    block_d = _padded_head_dim(head_dim)
    even_d = head_dim == block_d
    switches = _dot_switches(q.dtype)
    qk_scale_log2 = _qk_scale_log2(scale)

    fwd_cfg = forward_config(block_d, q.dtype)
    delta = new_output((batch, heads_q, seq_q), torch.float32, q.device)
    kernels._flash_bwd_preprocess_kernel[_grid(seq_q, fwd_cfg.block_m, batch * heads_q)](
        out, dout, dlse if dlse is not None else delta, delta,
        *_strides3(out), *_strides3(dout),
        heads_q, seq_q, head_dim,
        HAS_DLSE=dlse is not None, EVEN_M=seq_q % fwd_cfg.block_m == 0, EVEN_D=even_d,
        BLOCK_M=fwd_cfg.block_m, BLOCK_D=block_d,
    )  # fmt: skip
    _runtime.record_launch(KERNEL_BACKWARD_PREPROCESS)

    dk = new_output((batch, heads_kv, seq_kv, head_dim), k.dtype, k.device)
    dv = new_output((batch, heads_kv, seq_kv, head_dim), v.dtype, v.device)
    cfg = backward_config(block_d, q.dtype)
    kernels._flash_bwd_dkdv_kernel[_grid(seq_kv, cfg.block_n, batch * heads_kv)](
        q, k, v, dout, lse, delta, dk, dv,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(dk), *_strides3(dv),
        heads_q, heads_kv, group, seq_q, seq_kv, head_dim, qk_scale_log2, scale,
        IS_CAUSAL=is_causal, EVEN_M=seq_q % cfg.block_m == 0, EVEN_N=seq_kv % cfg.block_n == 0, EVEN_D=even_d,
        **switches,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _runtime.record_launch(KERNEL_BACKWARD_DKDV)

    dq = new_output((batch, heads_q, seq_q, head_dim), q.dtype, q.device)
    # dQ holds Q, dO and the fp32 dQ accumulator [BM, BD]; K and V stream, like the forward.
    kernels._flash_bwd_dq_kernel[_grid(seq_q, cfg.block_n, batch * heads_q)](
        q, k, v, dout, lse, delta, dq,
        *_strides3(q), *_strides3(k), *_strides3(v), *_strides3(dout), *_strides3(dq),
        heads_q, group, seq_q, seq_kv, head_dim, qk_scale_log2, scale,
        IS_CAUSAL=is_causal, EVEN_M=seq_q % cfg.block_n == 0, EVEN_N=seq_kv % cfg.block_m == 0, EVEN_D=even_d,
        **switches,
        BLOCK_M=cfg.block_n, BLOCK_N=cfg.block_m, BLOCK_D=block_d,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    _runtime.record_launch(KERNEL_BACKWARD_DQ)
    return dq, dk, dv
