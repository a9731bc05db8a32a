"""Launchers: pick block sizes, allocate outputs, set the constexpr switches and start the Triton kernels.

Block sizes are chosen per padded head_dim so that the tiles fit shared memory on an H100 (228 KiB per SM)
with room for pipelining: big query blocks for small heads, smaller key blocks and fewer stages as head_dim
grows. They are sane starting points, not tuned ones (tuning is a later issue). Under the interpreter the
same table is used; num_warps and num_stages are ignored there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from .. import _runtime
from . import kernels

KERNEL_FORWARD = "flash_attention_fwd"
KERNEL_TILED = "tiled_attention_fwd"
KERNEL_BACKWARD_PREPROCESS = "flash_attention_bwd_preprocess"
KERNEL_BACKWARD_DKDV = "flash_attention_bwd_dkdv"
KERNEL_BACKWARD_DQ = "flash_attention_bwd_dq"

MIN_DOT_DIM = 16  # tl.dot needs every tile dim >= 16


@dataclass(frozen=True)
class BlockConfig:
    block_m: int  # query rows per block
    block_n: int  # key rows per block
    num_warps: int
    num_stages: int


def new_output(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocate a kernel output (uninitialised). One function so tests can poison every output with NaN."""
    return torch.empty(shape, dtype=dtype, device=device)


def _padded_head_dim(head_dim: int) -> int:
    return max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))


# Per padded head_dim (64 stands for 16..64): (block_m, block_n, num_warps, num_stages). 16-bit tiles use
# tensor cores. float32 uses an IEEE product (no TF32), which Triton runs on FMA units with both operands in
# registers: smaller tiles and 8 warps. Compiled for sm_90 with Triton 3.6, the 16-bit configurations and
# float32 at head_dim <= 64 spill at most a few hundred bytes per thread; the earlier float32 head_dim-64
# tiles (128 x 64, 4 warps) spilled 11-17 KB per thread.
_FORWARD = {
    torch.float16: {64: (128, 64, 4, 3), 128: (128, 32, 8, 2), 256: (64, 32, 8, 1)},
    torch.float32: {64: (64, 32, 8, 2), 128: (64, 32, 8, 1), 256: (32, 32, 8, 1)},
}
_BACKWARD = {
    torch.float16: {64: (64, 64, 4, 2), 128: (32, 64, 8, 2), 256: (32, 32, 8, 1)},
    torch.float32: {64: (32, 32, 8, 2), 128: (32, 32, 8, 1), 256: (32, 16, 8, 1)},
}


def _lookup(table: dict, block_d: int, dtype: torch.dtype) -> BlockConfig:
    # bfloat16 tiles have the sizes of float16 ones.
    by_dim = table[torch.float32 if dtype == torch.float32 else torch.float16]
    return BlockConfig(*by_dim[max(64, block_d)])


def forward_config(block_d: int, dtype: torch.dtype) -> BlockConfig:
    """Forward/dQ blocks: Q [BM, BD] stays on chip, K and V [BN, BD] tiles stream through."""
    return _lookup(_FORWARD, block_d, dtype)


def backward_config(block_d: int, dtype: torch.dtype) -> BlockConfig:
    """dK/dV blocks: K, V and the fp32 dK, dV accumulators [BN, BD] stay on chip; Q, dO [BM, BD] stream."""
    return _lookup(_BACKWARD, block_d, dtype)


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
