"""Whether an attention call may run the Gluon kernels (issue 73, stage 3): pure choices over the call's
tensors, options and launch policy, with no launch. The attention launcher asks
:func:`gluon_forward_applies` / :func:`gluon_backward_applies` and runs its Triton kernels wherever the
answer is False: other GPUs, CPU tensors, the interpreter, shapes or options the Gluon kernels do not take,
and every head dim the policy does not name (none as shipped: no GPU has proven them;
``llm_speed.core.policy``, candidates ``gluon-forward`` and ``gluon-backward``). The ``*_refusal``
functions say why not, for tests and ``doctor``."""

from __future__ import annotations

import torch

from ..core.policy import LaunchPolicy, current_policy
from .attention import BACKWARD_HEAD_DIMS, DTYPES, FP8_DTYPE, HEAD_DIMS
from .launch import device_refusal


def _refusal(q, k, v, head_dims: tuple[int, ...], field: str, kernel_dims: tuple[int, ...], *, window,
             softcap, alibi_slopes, dropout_p: float, descales, two_pass: bool) -> str | None:  # fmt: skip
    """Why the Gluon kernels do not take this call (shared by both directions: ``head_dims`` the policy's,
    ``kernel_dims`` the kernel's), or None."""
    tensors = (q, k, v)
    if not all(isinstance(x, torch.Tensor) for x in tensors):
        return "q, k and v are not all tensors"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "not dense [B, H, S, D] tensors (packed sequences or a paged cache)"
    head_dim = q.shape[-1]
    if head_dim not in head_dims:  # (first: as shipped every field is empty)
        return f"head dim {head_dim} not in the policy's {field} {head_dims}"
    if head_dim not in kernel_dims:
        return f"head dim {head_dim}: the Gluon kernel takes {kernel_dims}"
    if field == "gluon_fp8_forward_head_dims":
        if not q.dtype == k.dtype == v.dtype == FP8_DTYPE:
            return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: fp8 takes e4m3 alike"
    elif q.dtype not in DTYPES or k.dtype != q.dtype or v.dtype != q.dtype or descales is not None:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype}: fp16 or bf16 alike only (no fp8)"
    if window is not None and window != (None, None):
        return "a sliding window"
    if softcap is not None:
        return "a softcap"
    if alibi_slopes is not None:
        return "ALiBi slopes"
    if dropout_p:
        return "dropout"
    if two_pass:
        return "the two-pass (tiled) forward was asked for"
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[3] != head_dim:
        return "k and v shapes that do not match q's"
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return "q's heads are not a multiple of k's"
    if q.numel() == 0 or k.shape[2] == 0:
        return "an empty batch, query or key sequence"
    if not all(x.is_contiguous() for x in tensors):
        return "not contiguous [B, H, S, D] (the kernels read a [B H, S, D] view by TMA)"
    if any(x.data_ptr() % 16 for x in tensors):
        return "a base that is not 16-byte aligned (TMA)"
    if len({x.device for x in tensors}) != 1:
        return "tensors on several devices"
    return device_refusal(q.device)


def gluon_forward_refusal(q, k, v, *, window=None, softcap=None, alibi_slopes=None, dropout_p: float = 0.0,
                          descales=None, two_pass: bool = False,
                          policy: LaunchPolicy | None = None) -> str | None:  # fmt: skip
    """Why :func:`llm_speed.gluon.attention.forward` does not take this dense attention forward under
    ``policy`` (None: the current one), or None when it does. ``window``: (left, right) or None; ``descales``:
    fp8's (descale_q, descale_k, descale_v), None for 16-bit. An fp8 call (descales given, or e4m3 q) is
    taken only at the head dims of the policy's ``gluon_fp8_forward_head_dims``, a 16-bit one at those of
    ``gluon_forward_head_dims``."""
    policy = current_policy() if policy is None else policy
    fp8 = descales is not None or getattr(q, "dtype", None) == FP8_DTYPE
    field = "gluon_fp8_forward_head_dims" if fp8 else "gluon_forward_head_dims"
    return _refusal(q, k, v, getattr(policy, field), field, HEAD_DIMS, window=window, softcap=softcap,
                    alibi_slopes=alibi_slopes, dropout_p=dropout_p, descales=descales,
                    two_pass=two_pass)  # fmt: skip


def gluon_forward_applies(q, k, v, *, window=None, softcap=None, alibi_slopes=None, dropout_p: float = 0.0,
                          descales=None, two_pass: bool = False,
                          policy: LaunchPolicy | None = None) -> bool:  # fmt: skip
    """True when the attention launcher's dense forward should run the Gluon forward
    (:func:`gluon_forward_refusal` finds no reason not to)."""
    return gluon_forward_refusal(q, k, v, window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                 dropout_p=dropout_p, descales=descales, two_pass=two_pass,
                                 policy=policy) is None  # fmt: skip


def gluon_backward_refusal(q, k, v, out, dout, *, deterministic: bool = False, window=None, softcap=None,
                           alibi_slopes=None, dropout_p: float = 0.0,
                           policy: LaunchPolicy | None = None) -> str | None:  # fmt: skip
    """Why :func:`llm_speed.gluon.attention_bwd.backward` does not take this dense attention backward under
    ``policy``, or None when it does. ``deterministic``: a bitwise-repeatable backward was asked for (the
    call's flag or ``torch.are_deterministic_algorithms_enabled()``; not a tier's default dQ kernel): the
    Gluon backward adds dQ by atomics, so it refuses."""
    policy = current_policy() if policy is None else policy
    why = _refusal(q, k, v, policy.gluon_backward_head_dims, "gluon_backward_head_dims", BACKWARD_HEAD_DIMS,
                   window=window, softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                   descales=None, two_pass=False)  # fmt: skip
    if why is not None:
        return why
    if deterministic or torch.are_deterministic_algorithms_enabled():
        return "a deterministic backward was asked for (the Gluon backward adds dQ by atomics)"
    for name, x in (("out", out), ("dout", dout)):
        if not (isinstance(x, torch.Tensor) and x.shape == q.shape and x.dtype == q.dtype
                and x.device == q.device):  # fmt: skip
            return f"{name} is not a {tuple(q.shape)} {q.dtype} tensor on q's device"
    if not out.is_contiguous() or out.data_ptr() % 16:
        return "out is not contiguous and 16-byte aligned"
    if dout.is_contiguous() and dout.data_ptr() % 16:  # (contiguous() keeps its storage: TMA refuses it)
        return "dout is contiguous but not 16-byte aligned"
    return None


def gluon_backward_applies(q, k, v, out, dout, *, deterministic: bool = False, window=None, softcap=None,
                           alibi_slopes=None, dropout_p: float = 0.0,
                           policy: LaunchPolicy | None = None) -> bool:  # fmt: skip
    """True when the attention launcher's dense backward should run the Gluon backward
    (:func:`gluon_backward_refusal` finds no reason not to)."""
    return gluon_backward_refusal(q, k, v, out, dout, deterministic=deterministic, window=window,
                                  softcap=softcap, alibi_slopes=alibi_slopes, dropout_p=dropout_p,
                                  policy=policy) is None  # fmt: skip
