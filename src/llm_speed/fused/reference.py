"""Plain-PyTorch specs of the fused ops: the same signatures and semantics as the kernels, computed in float32
(float64 stays float64, so the tests' float64 truth is the same code). Tests and ``bench op`` compare against
these; the ops' CPU fallbacks (no interpreter) reuse the formulas.
"""

from __future__ import annotations

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where the references compute: float64 stays float64 (the truth), all else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None = None,
    *,
    eps: float = 1e-6,
    offset: float = 0.0,
    casting: str = "float32",
    in_place: bool = False,
):
    """RMSNorm, same signature and semantics as :func:`llm_speed.rms_norm` (``in_place`` changes nothing
    here). ``casting="llama"``: the normalised x rounded to x's dtype before the weight, as Llama's module."""
    xf = x.to(compute_dtype(x.dtype))
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if casting == "llama":
        y = y.to(x.dtype).to(xf.dtype)
    if weight is not None:
        y = y * (offset + weight.to(xf.dtype))
    return y.to(x.dtype)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, gate's dtype out (:func:`llm_speed.swiglu`)."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.silu(gate.to(ct)) * up.to(ct)).to(gate.dtype)


def geglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gelu(gate, approximate="tanh") * up``, gate's dtype out (:func:`llm_speed.geglu`)."""
    ct = compute_dtype(gate.dtype)
    return (torch.nn.functional.gelu(gate.to(ct), approximate="tanh") * up.to(ct)).to(gate.dtype)


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


def _rotary_tables(cos, sin, position_ids, unsqueeze_dim, ct):
    """cos, sin broadcastable over q ``[b, h, s, d]`` (unsqueeze_dim 1) or ``[b, s, h, d]`` (2), in ``ct``."""
    if position_ids is not None:  # a table [positions, d] gathered by position
        ids = position_ids if position_ids.dim() == 2 else position_ids[None]
        cos, sin = cos[ids.long()], sin[ids.long()]
    elif cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    return cos.to(ct).unsqueeze(unsqueeze_dim), sin.to(ct).unsqueeze(unsqueeze_dim)


def _rotary_halves(x, cos, sin, interleaved, conjugate):
    """Hugging Face's rotation of the first cos.shape[-1] dims of x (cos, sin broadcastable), the rest kept;
    ``conjugate``: the transposed map (the backward, from the halves layout back to x's)."""
    d = cos.shape[-1]
    h = d // 2
    c1, c2, s1, s2 = cos[..., :h], cos[..., h:d], sin[..., :h], sin[..., h:d]
    if interleaved:
        c2, s2 = c1, s1
    rot, rest = x[..., :d], x[..., d:]
    if conjugate:
        d1, d2 = rot[..., :h], rot[..., h:]
        o1, o2 = d1 * c1 + d2 * s2, d2 * c2 - d1 * s1
        out = torch.stack((o1, o2), -1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
    else:
        x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else (rot[..., :h], rot[..., h:])
        out = torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), -1)
    return torch.cat((out, rest), -1)


def apply_rotary_qk_reference(q, k, cos, sin, *, position_ids=None, unsqueeze_dim=1, interleaved=False):
    """Hugging Face's ``apply_rotary_pos_emb`` (``interleaved``: ``apply_rotary_pos_emb_interleave``) with the
    signature and semantics of :func:`llm_speed.apply_rotary_qk`: compute dtype inside, q's and k's dtypes
    out, contiguous. ``position_ids`` gathers rows of a 2-D table (else unused, as in Hugging Face)."""
    if cos.dim() != 2:
        position_ids = None
    ct = compute_dtype(q.dtype)
    c, s = _rotary_tables(cos, sin, position_ids, unsqueeze_dim, ct)
    return tuple(_rotary_halves(x.to(ct), c, s, interleaved, False).to(x.dtype).contiguous() for x in (q, k))


def rotary_qk_backward_reference(dq_out, dk_out, cos, sin, position_ids, unsqueeze_dim, interleaved):
    """The gradients for q and k of :func:`apply_rotary_qk_reference` given those of its outputs."""
    if cos.dim() != 2:
        position_ids = None
    ct = compute_dtype(dq_out.dtype)
    c, s = _rotary_tables(cos, sin, position_ids, unsqueeze_dim, ct)
    return tuple(
        _rotary_halves(g.to(ct), c, s, interleaved, True).to(g.dtype).contiguous() for g in (dq_out, dk_out)
    )


def softcapped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """``softcap * tanh(logits / softcap)`` in the compute dtype (``softcap`` 0: no cap)."""
    z = logits.to(compute_dtype(logits.dtype))
    return softcap * torch.tanh(z / softcap) if softcap > 0 else z


def cross_entropy_reference(
    logits,
    target,
    *,
    weight=None,
    ignore_index=-100,
    reduction="mean",
    label_smoothing=0.0,
    softcap=None,
    lse_square_scale=0.0,
    return_z_loss=False,
    loss_dtype=torch.float32,
):
    """Softcap, cross-entropy (PyTorch's, per row) and z-loss in float32 (float64 stays float64), reduced as
    :func:`llm_speed.cross_entropy` states: "mean" divides the cross-entropy by the class weights of the rows
    not ignored (their number without weights) and the z-loss by that number (at least 1); a cross-entropy
    divisor of 0 gives a cross-entropy of 0 and no gradient through it (PyTorch: NaN or +-inf)."""
    z = softcapped(logits, softcap or 0.0)
    w = None if weight is None else weight.to(z.dtype)
    ce = torch.nn.functional.cross_entropy(
        z, target, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing
    )
    kept = target != ignore_index
    zl = torch.where(kept, lse_square_scale * torch.logsumexp(z, -1).square(), 0.0)
    out_dtype = torch.float64 if logits.dtype == torch.float64 else loss_dtype
    if reduction == "none":
        loss, z_loss = ce + zl, zl
    else:
        ce_div = z_div = torch.ones((), dtype=z.dtype, device=z.device)
        if reduction == "mean":
            count = kept.sum().to(z.dtype)
            ce_div = count if w is None else torch.where(kept, w[torch.where(kept, target, 0)], 0.0).sum()
            ce_div = torch.where(ce_div == 0, float("inf"), ce_div)
            z_div = count.clamp(min=1)
        z_loss = zl.sum() / z_div
        loss = ce.sum() / ce_div + z_loss
    return (loss.to(out_dtype), z_loss.to(out_dtype)) if return_z_loss else loss.to(out_dtype)


def fused_linear_cross_entropy_reference(
    hidden,
    weight,
    target,
    *,
    bias=None,
    ce_weight=None,
    **loss_options,
):
    """Full logits in the inputs' dtype, then :func:`cross_entropy_reference` (float64 stays float64); the
    semantics of :func:`llm_speed.fused_linear_cross_entropy`, an all-ignored mean included."""
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return cross_entropy_reference(logits, target, weight=ce_weight, **loss_options)
