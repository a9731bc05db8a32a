"""Plain-PyTorch specs of the fused ops: the same signatures and semantics as the kernels, computed in float32
(float64 stays float64, so the tests' float64 truth is the same code). Tests and ``bench op`` compare against
these; the ops' CPU fallbacks (no interpreter) reuse the formulas.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the references compute: float64 stays float64 (the truth), all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, *, eps: float = 1e-6, offset: float = 0.0):
    """RMSNorm, same signature and semantics as :func:`llm_speed.rms_norm`."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps) * (offset + weight.to(xf.dtype))
    return y.to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, gate's dtype out (:func:`llm_speed.swiglu`)."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def rotate(x, cos, sin, interleaved: bool, conjugate: bool) -> torch.Tensor:
    """The rotary rotation of x ``[batch, heads, seq, head_dim]`` by cos/sin ``[(batch,) seq, half]``, by the
    opposite angle when ``conjugate`` (the backward), x's dtype out, contiguous."""
    half = cos.shape[-1]
    ct = compute_dtype(x.dtype)
    c = (cos if cos.dim() == 3 else cos[None]).to(ct)[:, None]
    s = (sin if sin.dim() == 3 else sin[None]).to(ct)[:, None]
    if conjugate:
        s = -s
    rot = x[..., : 2 * half].to(ct)
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :half], rot[..., half:])
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    rotated = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half :]), -1).contiguous()


def apply_rotary_reference(x, cos, sin, *, interleaved: bool = False) -> torch.Tensor:
    """Rotary embedding with the signature and semantics of :func:`llm_speed.apply_rotary`."""
    return rotate(x, cos, sin, interleaved, False)


def softcapped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in the compute dtype (``softcap`` 0: no cap)."""
    z = logits.to(compute_dtype(logits.dtype))
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


def reduce_loss(rows, target, ignore_index: int, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """Per-row losses reduced as :func:`llm_speed.fused_linear_cross_entropy` states: "none", "sum", or "mean"
    over the non-ignored rows (0 when every row is ignored, where PyTorch gives 0 / 0 = NaN)."""
    if reduction == "none":
        return rows.to(dtype)
    total = rows.sum()
    if reduction == "sum":
        return total.to(dtype)
    count = (target != ignore_index).sum().clamp(min=1)
    return (total / count).to(dtype)


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    target,
    *,
    bias=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
):
    """Full logits in the inputs' dtype, softcap and cross-entropy in float32 (float64 stays float64); the
    semantics of :func:`llm_speed.fused_linear_cross_entropy`, an all-ignored mean included."""
    z = softcapped(torch.nn.functional.linear(hidden, weight, bias), softcap or 0.0)
    rows = torch.nn.functional.cross_entropy(
        z, target, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    return reduce_loss(rows, target, ignore_index, reduction, hidden.dtype)
