"""Plain PyTorch GEMM: the specification the Triton kernels are tested against, and the CPU fallback.

Same arguments as ``llm_speed.gemm``; ``compute_dtype`` chooses the precision of the arithmetic (tests use
float64, the fallback float32, like the kernels' fp32 accumulator).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "silu")


def apply_activation(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The activation the kernels fuse into their epilogue, in PyTorch (None: identity)."""
    if activation is None:
        return x
    if activation == "relu":
        return torch.relu(x)
    if activation == "gelu":
        return F.gelu(x)
    if activation == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if activation == "silu":
        return F.silu(x)
    raise ValueError(f"activation must be None or one of {ACTIVATIONS}, got {activation!r}")


def gemm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    trans_a: bool = False,
    trans_b: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``act(alpha * op(a) @ op(b) + beta * c + bias)`` in ``compute_dtype``, returned in ``out_dtype``.

    op(x) is x or its transpose over the last two dims. Batch dims broadcast like ``torch.matmul``. With
    beta == 0, c is not read. Differentiable (tests use it for float64 reference gradients).
    """
    op_a = a.mT if trans_a else a
    op_b = b.mT if trans_b else b
    result = alpha * torch.matmul(op_a.to(compute_dtype), op_b.to(compute_dtype))
    if beta != 0:
        result = result + beta * c.to(compute_dtype)
    if bias is not None:
        result = result + bias.to(compute_dtype)
    result = apply_activation(result, activation)
    return result.to(out_dtype or a.dtype)


def gemm_int8_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of int8 tensors computed exactly in int64, returned as int32."""
    return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(torch.int32)


# --- fp8 ----------------------------------------------------------------------------------------------------

FP8_BLOCK = 128
TENSOR, ROW, BLOCKWISE = 0, 1, 2  # the scalings gemm_fp8 reads from its scale shapes


def _expand_scale(scale: torch.Tensor, rows: int, cols: int, granularity) -> torch.Tensor:
    """A scale of ``granularity`` broadcast to [rows, cols] (blocks repeated, the last one cut)."""
    if granularity == "tensor":
        return scale.reshape(1, 1).expand(rows, cols)
    if granularity == "row":
        return scale.reshape(rows, 1).expand(rows, cols)
    block_rows = 1 if tuple(granularity) == (1, FP8_BLOCK) else FP8_BLOCK
    return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]


def scaling_of(m: int, n: int, k: int, sa_shape: tuple, sb_shape: tuple, trans_b: bool) -> int:
    """TENSOR, ROW or BLOCKWISE from the scale shapes (b's scale is read against b as stored: [N, K] when
    ``trans_b``); ValueError naming both shapes and the accepted ones when no granularity matches. Where a
    tiny problem fits several (M = 1 and K <= 128: [1, 1] is all three), the first is taken: they agree."""
    groups_k = -(-k // FP8_BLOCK)
    single = ((), (1,), (1, 1))
    a_options = {TENSOR: sa_shape in single, ROW: sa_shape == (m, 1), BLOCKWISE: sa_shape == (m, groups_k)}
    if trans_b:
        row_b, block_b = (n, 1), (-(-n // FP8_BLOCK), groups_k)
    else:
        row_b, block_b = (1, n), (groups_k, -(-n // FP8_BLOCK))
    b_options = {TENSOR: sb_shape in single, ROW: sb_shape == row_b, BLOCKWISE: sb_shape == block_b}
    for scaling in (TENSOR, ROW, BLOCKWISE):
        if a_options[scaling] and b_options[scaling]:
            return scaling
    b_name = "[N, K]" if trans_b else "[K, N]"
    raise ValueError(
        f"scale_a {list(sa_shape)} and scale_b {list(sb_shape)} match no granularity for a [{m}, {k}] @ "
        f"b {b_name} with N={n}; accepted: tensor x tensor ([], [1] or [1, 1] each), row x row "
        f"(scale_a [{m}, 1], scale_b {list(row_b)}), 1x128 x 128x128 (scale_a [{m}, {groups_k}], "
        f"scale_b {list(block_b)})"
    )


def quantize_fp8_reference(
    x: torch.Tensor, dtype: torch.dtype, granularity
) -> tuple[torch.Tensor, torch.Tensor]:
    """``llm_speed.quantize_fp8`` in PyTorch: ``scale = max(amax, 1e-12) / fp8_max`` (float32) per group,
    ``x_fp8 = (x / scale).clamp(+-fp8_max).to(dtype)`` (PyTorch rounds to nearest even)."""
    fp8_max = torch.finfo(dtype).max
    xf = x.float()
    rows, cols = x.shape
    a = xf.abs()
    if granularity == "tensor":
        amax = a.amax() if a.numel() else a.new_zeros(())
    elif granularity == "row":
        amax = a.amax(1, keepdim=True) if cols else a.new_zeros(rows, 1)
    else:
        block_rows = 1 if tuple(granularity) == (1, FP8_BLOCK) else FP8_BLOCK
        groups_r, groups_c = -(-rows // block_rows), -(-cols // FP8_BLOCK)
        padded = a.new_zeros(groups_r * block_rows, groups_c * FP8_BLOCK)
        padded[:rows, :cols] = a
        amax = padded.reshape(groups_r, block_rows, groups_c, FP8_BLOCK).amax(dim=(1, 3))
    scale = amax.clamp(min=1e-12) / fp8_max
    q = (xf / _expand_scale(scale, rows, cols, granularity)).clamp(-fp8_max, fp8_max).to(dtype)
    return q, scale


def gemm_fp8_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    trans_b: bool = False,
    compute_dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """``(a * scale_a) @ (b * scale_b) + bias`` of dequantized operands in ``compute_dtype``, returned in
    ``out_dtype``; the granularity is read from the scale shapes as ``llm_speed.gemm_fp8`` reads it."""
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    scaling = scaling_of(m, n, k, tuple(scale_a.shape), tuple(scale_b.shape), bool(trans_b))
    a_hp = a.to(compute_dtype)
    b_hp = b.to(compute_dtype)  # as stored
    sa, sb = scale_a.to(compute_dtype), scale_b.to(compute_dtype)
    if scaling == BLOCKWISE:
        a_hp = a_hp * _expand_scale(sa, m, k, (1, FP8_BLOCK))
        b_hp = b_hp * _expand_scale(sb, *b.shape, (FP8_BLOCK, FP8_BLOCK))
    elif scaling == ROW:
        a_hp = a_hp * sa.reshape(m, 1)
        b_hp = b_hp * (sb.reshape(n, 1) if trans_b else sb.reshape(1, n))
    else:
        a_hp = a_hp * sa.reshape(())
        b_hp = b_hp * sb.reshape(())
    out = a_hp @ (b_hp.mT if trans_b else b_hp)
    if bias is not None:
        out = out + bias.to(compute_dtype)
    return out.to(out_dtype)
