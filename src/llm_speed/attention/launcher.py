"""The attention implementations: the forward and backward of dense and packed problems (reporting,
allocation and launch, or the PyTorch fallback), and the calls already checked."""

from __future__ import annotations

import torch

from ..core import (
    runtime,
    tensors,
)
from ..core.hardware import hardware_of
from ..core.launch import (
    CallCache,
    Kernel,
    Plan,
    tma_aligned,
)
from ..core.policy import current_number, current_policy
from .backward_kernels import ATOMIC_BACKWARD_KERNELS, DETERMINISTIC_BACKWARD_KERNELS
from .checks import (
    check_scale,
    check_seqlens_values,
)
from .configs import tier_dq_kernel, tier_for
from .options import CAUSAL, NO_MODS, ScoreMods, from_op
from .plans import (
    backward_plans,
    descale_inputs,
    descale_key,
    forward_plan,
    launch_backward,
    new_dense_output,
    seq_major,
    transposed_values,
)
from .reference import (
    reference_backward,
    reference_forward,
    varlen_reference_backward,
    varlen_reference_forward,
)


def attention_forward(q, k, v, scale: float, mods: ScoreMods, two_pass=False, descales=None):
    """(out, lse) of the flash forward, or with ``two_pass`` the tiled one, of dense ``[B, H, S, D]``
    tensors (last dim contiguous) under the mask and score options ``mods``: out contiguous in q's dtype
    (bfloat16 for fp8), lse float32 ``[B, Hq, Sq]``. Reports its work; runs the Triton kernel wherever it can
    run, else the float32 PyTorch reference. fp8 (e4m3 q, k, v, flash only): ``descales`` = (descale_q,
    descale_k, descale_v), each float32 ``[]``, ``[1]``, ``[Hkv]``, ``[B, Hkv]`` or None."""
    shape, device = q.shape, q.device
    batch, heads_q, seq_q, head_dim = shape
    out_dtype = q.dtype if descales is None else torch.bfloat16  # fp8: bfloat16 out (FlashAttention-3's)
    if batch == 0 or seq_q == 0 or k.shape[2] == 0:
        # Nothing to launch. With no key at all every row sees nothing: output 0, LSE -inf.
        out = torch.zeros(shape, dtype=out_dtype, device=device)
        return out, torch.full(shape[:3], float("-inf"), dtype=torch.float32, device=device)
    if gluon_forward_takes(q, k, v, scale, mods, two_pass, descales):
        from ..gluon import attention as gluon_attention

        work = "flash_attention" if descales is None else "flash_attention_fp8"
        runtime.report_work(work, q=q, k=k, is_causal=mods.is_causal, window=None)
        names = ("descale_q", "descale_k", "descale_v")
        fp8 = {} if descales is None else dict(zip(names, descales, strict=True))
        return gluon_attention.forward(q, k, v, is_causal=mods.is_causal, scale=scale, **fp8)
    name = "tiled_attention" if two_pass else "flash_attention" if descales is None else "flash_attention_fp8"
    runtime.report_work(name, q=q, k=k, is_causal=mods.is_causal, window=mods.window)
    if not runtime.triton_runs_on(device):
        out, lse = reference_forward(q, k, v, is_causal=mods.is_causal, window=mods.window,
                                     softcap=mods.softcap, scale=scale, alibi_slopes=mods.alibi_slopes,
                                     dropout_p=mods.dropout_p, rng=mods.rng, descales=descales)  # fmt: skip
        if seq_major(shape, q.stride()):  # the layout the kernel writes
            out = new_dense_output(shape, True, out_dtype, device).copy_(out)
        return out, lse
    if descales is not None:  # fp8: V transposed once per call, so that the PV product is pipelined
        v = transposed_values(v)
    key = dense_plan_key(q, k, v, mods.key, scale < 0.0, two_pass)
    # (the descales' and V's layout part of the key for fp8 only: a 16-bit call's key is as before)
    if descales is None:
        plan = forward_plan(*key, aligned=tma_aligned(k, v), lse=True, policy=current_policy())
    else:
        plan = forward_plan(*key, descales=descale_key(descales), v_transposed=True, lse=True,
                             policy=current_policy())
    out, lse = _dense_outputs(shape, seq_major(shape, q.stride()), out_dtype, device)
    if descales is None and mods.alibi_slopes is None and mods.rng is None:  # the common call: five tensors
        _launch_dense(plan, q, k, v, out, lse, scale, mods.cap, mods.dropout_p)
    else:  # the slopes, seeds and descales a class has (the plan compiled out those it has not)
        extras = {} if descales is None else descale_inputs(descales)
        if plan.descriptors:  # TMA_KV: K and V through the interior loop's descriptors too
            extras.update(K_DESC=k, V_DESC=v)
        if mods.alibi_slopes is not None:
            extras["ALIBI"] = mods.alibi_slopes
        if mods.rng is not None:
            extras["RNG"] = mods.rng
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, scale=scale, softcap=mods.cap, dropout_p=mods.dropout_p,
                    **extras)  # fmt: skip
    return out, lse


def gluon_forward_takes(q, k, v, scale: float, mods: ScoreMods, two_pass=False, descales=None) -> bool:
    """Whether this dense forward runs the Gluon forward (issue 73): only where the launch policy names its
    head dim (none as shipped: one attribute read, and the Gluon package is not imported) and
    :func:`llm_speed.gluon.select.gluon_forward_applies` takes the call; a positive scale (the Gluon
    forward's schedule model and GPU tests cover positive scales only)."""
    policy = current_policy()
    if not (policy.gluon_forward_head_dims if descales is None else policy.gluon_fp8_forward_head_dims):
        return False
    if not scale > 0.0:
        return False
    from ..gluon.select import gluon_forward_applies

    return gluon_forward_applies(q, k, v, window=mods.window, softcap=mods.softcap,
                                 alibi_slopes=mods.alibi_slopes, dropout_p=mods.dropout_p, descales=descales,
                                 two_pass=two_pass)  # fmt: skip


def gluon_backward_takes(dout, q, k, v, out, scale: float, mods: ScoreMods, deterministic: bool) -> bool:
    """Whether this dense backward runs the Gluon backward: only where the launch policy names its head dim
    and :func:`llm_speed.gluon.select.gluon_backward_applies` takes the call (``deterministic``: the caller's
    flag; a tier's default dQ kernel does not refuse it, an asked-for bitwise-repeatable backward does).
    Any scale: its schedule model and GPU tests cover negative and zero scales (the forward's, positive
    ones only)."""
    if not current_policy().gluon_backward_head_dims:
        return False
    from ..gluon.select import gluon_backward_applies

    return gluon_backward_applies(q, k, v, out, dout, deterministic=deterministic, window=mods.window,
                                  softcap=mods.softcap, alibi_slopes=mods.alibi_slopes,
                                  dropout_p=mods.dropout_p)  # fmt: skip


def _launch_dense(plan: Plan, q, k, v, out, lse, scale: float, softcap: float, dropout_p: float) -> None:
    """Launch a dense forward plan on its five tensors (a ``TMA_KV`` plan takes K and V twice: as pointers
    and through its descriptors; lse None: a plan that stores none)."""
    if lse is None and plan.descriptors:
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    elif lse is None:
        plan.launch(Q=q, K=k, V=v, O=out, scale=scale, softcap=softcap, dropout_p=dropout_p)
    elif plan.descriptors:
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, LSE=lse, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, scale=scale, softcap=softcap, dropout_p=dropout_p)


def dense_plan_key(q, k, v, mask, negative: bool, two_pass: bool = False) -> tuple:
    """The :func:`forward_plan` arguments of a dense forward (``mask``: the call's
    :attr:`ScoreMods.key`)."""
    return (q.shape, k.shape, q.stride(), k.stride(), v.stride(), q.shape[0], q.dtype, mask, two_pass, False,
            negative, q.device)  # fmt: skip


def _dense_outputs(shape, like_seq_major: bool, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of a dense forward: out as :func:`new_dense_output`, lse float32 ``[B, Hq, Sq]``."""
    return new_dense_output(shape, like_seq_major, dtype, device), tensors.new_output(
        shape[:3], torch.float32, device
    )


class DenseCall:
    """A dense inference forward call (no window, softcap, ALiBi, dropout or fp8; no copy of q, k, v) whose
    metadata passed every check: what a call with the same metadata does, the report, the outputs and the
    launch (:data:`DENSE_CALLS`). ``lse`` False: the call does not return the LSE, so the plan stores none
    (one allocation less a call)."""

    __slots__ = ("plan", "shape", "lse_shape", "seq_major", "dtype", "device", "default_scale")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, negative: bool,
                 lse: bool):  # fmt: skip
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        self.lse_shape = tuple(q.shape[:3]) if lse else None
        self.seq_major = seq_major(q.shape, q.stride())
        self.default_scale = check_scale(None, q)
        key = dense_plan_key(q, k, v, (CAUSAL if is_causal else NO_MODS).key, negative)
        # (with LSE: the op's own plan)
        self.plan = forward_plan(*key, aligned=tma_aligned(k, v), lse=lse, policy=current_policy())

    def __call__(self, q, k, v, is_causal: bool, scale: float | None) -> tuple:
        runtime.report_work("flash_attention", q=q, k=k, is_causal=is_causal, window=None)
        out = new_dense_output(self.shape, self.seq_major, self.dtype, self.device)
        lse = self.lse_shape and tensors.new_output(self.lse_shape, torch.float32, self.device)
        _launch_dense(self.plan, q, k, v, out, lse, self.default_scale if scale is None else scale, 1.0, 0.0)
        return out, lse

    def forward(self, q, k, v, is_causal: bool, scale: float, *fixed) -> tuple:
        """:func:`forward` of such a call (the op's arguments; the plan fixes the others)."""
        return self(q, k, v, is_causal, scale)


# Dense calls already checked, by what the checks read: a repeated call (the same shapes, strides, dtypes,
# devices and flags) skips the checks and the op's layers, as PyTorch's C++ dispatch costs nothing there:
# 15 -> 7 us a call on the development CPU (launch stubbed), where SDPA takes 7. With grad it records the op's
# autograd node around the kept launch (Op.checked).
DENSE_CALLS = CallCache()


def dense_call_key(q, k, v, is_causal, scale, lse) -> tuple:
    """The key of :data:`DENSE_CALLS`: everything the checks and the plan of such a call read (``lse``:
    the LSE is stored: returned, or saved for the backward; the launch policy)."""
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, is_causal, lse, scale is not None and scale < 0.0,
            tma_aligned(k, v), current_number())  # fmt: skip


# The same calls made through flash-attn's interface (llm_speed.flash_attn_interface): q, k, v in its
# [batch, seq, heads, dim] layout, keyed (by dense_call_key) on those tensors as given, so a repeated call
# makes none of the four transposed views (q, k, v in, out back) that cost ~3 us of the development CPU, and
# with grad ~10 us (each view records an autograd node); the entry is the DENSE_CALLS entry its first call
# left (a sequence-major output; with grad, the LSE stored for the backward; a TMA plan's descriptors are
# made over the tensors as given, the same memory as the views its plan was made for).
_SEQ_MAJOR_CALLS = CallCache()


def seq_major_call(q, k, v, is_causal: bool, scale: float | None, lse: bool) -> DenseCall | None:
    """The call :func:`keep_seq_major` kept for flash-attn's ``[batch, seq, heads, dim]`` tensors ``q, k,
    v`` with this metadata (``lse``: the LSE stored, a call with grad), or None."""
    call = _SEQ_MAJOR_CALLS.get(dense_call_key(q, k, v, is_causal, scale, lse))
    if call is not None and runtime.observed():  # a profiler listens: the report names [B, H, S, D] shapes
        runtime.report_work("flash_attention", q=q.transpose(1, 2), k=k.transpose(1, 2), is_causal=is_causal,
                            window=None)  # fmt: skip
    return call


def launch_seq_major(call: DenseCall, q, k, v, scale: float | None, lse: bool) -> tuple:
    """(out, lse) of ``call`` launched on flash-attn's ``[batch, seq, heads, dim]`` tensors as given: out in
    q's layout, lse ``[batch, heads_q, seq_q]`` float32 when ``lse`` (else None)."""
    out = tensors.new_output(q.shape, q.dtype, q.device)  # the plan writes q's [B, S, H, D] order
    stats = tensors.new_output((q.shape[0], q.shape[2], q.shape[1]), torch.float32, q.device) if lse else None
    _launch_dense(call.plan, q, k, v, out, stats, call.default_scale if scale is None else scale, 1.0, 0.0)
    return out, stats


def seq_major_inference(q, k, v, is_causal: bool, scale: float | None) -> torch.Tensor | None:
    """For flash-attn's interface: the ``[batch, seq_q, heads_q, dim]`` output of a plain inference call on
    ``[batch, seq, heads, dim]`` tensors that an earlier call of the same metadata made through
    :func:`flash_attention` (and :func:`keep_seq_major`); None when there is none (the caller takes the
    full path). ``is_causal`` a bool, ``scale`` None or a finite float, no grad to record: the caller's
    conditions."""
    call = seq_major_call(q, k, v, is_causal, scale, False)
    return None if call is None else launch_seq_major(call, q, k, v, scale, False)[0]


def keep_seq_major(given: tuple, views: tuple, is_causal: bool, scale: float | None,
                   lse: bool = False) -> None:  # fmt: skip
    """After :func:`flash_attention` ran on ``views``, the ``transpose(1, 2)`` of flash-attn's ``[batch, seq,
    heads, dim]`` tensors ``given`` (q, k, v; no option; ``lse``: with grad, so the LSE was stored): keep
    what it kept for the next such call."""
    call = DENSE_CALLS.get(dense_call_key(*views, is_causal, scale, lse))
    if call is not None and call.seq_major:
        _SEQ_MAJOR_CALLS.put(dense_call_key(*given, is_causal, scale, lse), call)


def forward(
    q, k, v, is_causal: bool, scale: float, window_left=None, window_right=None, softcap=None,
    deterministic=False, alibi_slopes=None, dropout_p: float = 0.0, rng=None,
):  # fmt: skip
    """(out, lse) of the flash forward (:func:`attention_forward`); the op's implementation, its flat
    arguments made one :class:`ScoreMods` (``deterministic`` is the backward's, kept for it by the autograd
    context)."""
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
    return attention_forward(q, k, v, scale, mods)


def deterministic_backward(deterministic: bool, device: torch.device) -> bool:
    """Whether a backward on ``device`` computes dQ in a kernel of its own (the deterministic path): asked
    for, PyTorch's deterministic mode is on (``torch.use_deterministic_algorithms(True)``, read when the
    backward runs: PyTorch's convention), or the device's tier does by default (:func:`tier_dq_kernel`
    under the current policy)."""
    return (
        deterministic
        or torch.are_deterministic_algorithms_enabled()
        or tier_dq_kernel(tier_for(hardware_of(device)), current_policy())
    )


def default_backward_kernels(device) -> tuple[Kernel, ...]:
    """The kernels a backward on ``device`` launches unless asked for the deterministic path."""
    dq_kernel = deterministic_backward(False, torch.device(device))
    return DETERMINISTIC_BACKWARD_KERNELS if dq_kernel else ATOMIC_BACKWARD_KERNELS


def backward(
    dout, q, k, v, out, lse, dlse, is_causal: bool, scale: float, window_left=None, window_right=None,
    softcap=None, deterministic=False, alibi_slopes=None, dropout_p: float = 0.0, rng=None,
):  # fmt: skip
    """(dq, dk, dv) of the dense forward (flash or tiled: both save Q, K, V, O and the LSE); the backward
    op's implementation, its flat arguments made one :class:`ScoreMods`."""
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
    return attention_backward(dout, q, k, v, out, lse, dlse, scale, mods, deterministic)


def attention_backward(dout, q, k, v, out, lse, dlse, scale: float, mods: ScoreMods, deterministic: bool):
    """(dq, dk, dv) of a dense forward under ``mods``; reports its work. GQA gradients are summed over each
    query group. dQ by atomics (five matmuls per tile), or a dQ kernel of its own, bitwise repeatable, when
    :func:`deterministic_backward` says so."""
    dout = tensors.last_dim_contiguous(dout)
    if dlse is not None:
        dlse = dlse.contiguous()
    if q.numel() == 0 or k.numel() == 0:
        # Empty batch or sequence: no score exists, so every gradient is 0.
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    if gluon_backward_takes(dout, q, k, v, out, scale, mods, deterministic):
        from ..gluon import attention_bwd as gluon_attention_bwd

        runtime.report_work("flash_attention_backward", q=q, k=k, is_causal=mods.is_causal, window=None,
                            deterministic=False)  # fmt: skip
        return gluon_attention_bwd.backward(q, k, v, out, lse, dout, is_causal=mods.is_causal, scale=scale,
                                            dlse=dlse)  # fmt: skip
    deterministic = deterministic_backward(deterministic, q.device)
    runtime.report_work("flash_attention_backward", q=q, k=k, is_causal=mods.is_causal, window=mods.window,
                        deterministic=deterministic)  # fmt: skip
    if not runtime.triton_runs_on(q.device):
        return reference_backward(dout, q, k, v, out, lse, dlse, is_causal=mods.is_causal,
                                  window=mods.window, softcap=mods.softcap, scale=scale,
                                  alibi_slopes=mods.alibi_slopes, dropout_p=mods.dropout_p,
                                  rng=mods.rng)  # fmt: skip
    lse = lse.contiguous()
    dtypes = (q.dtype, out.dtype, dout.dtype, lse.dtype, None if dlse is None else dlse.dtype)
    plans = backward_plans(
        q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(), dout.stride(), q.shape[0], dtypes,
        dlse is not None, mods.key, False, deterministic, q.device,
        aligned=tma_aligned(q, dout) and tma_aligned(k, v), policy=current_policy(),
    )  # fmt: skip
    return launch_backward(plans, dout, q, k, v, out, lse, dlse, None, None, scale, mods, deterministic)


def varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, is_causal: bool, scale: float,
    window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
    dropout_p: float = 0.0, rng=None, seqused_k=None, block_table=None,
):  # fmt: skip
    """(out, lse) of packed sequences (:func:`packed_forward`); the packed op's implementation, its flat
    arguments made one :class:`ScoreMods`."""
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
    return packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, mods,
                          seqused_k, block_table)  # fmt: skip


def packed_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                   mods: ScoreMods, seqused_k=None, block_table=None, descales=None):  # fmt: skip
    """(out ``[Tq, Hq, D]``, lse float32 ``[Hq, Tq]``) of packed sequences under ``mods`` (fp8:
    ``descales`` as :func:`attention_forward`'s, indexed by sequence; out bfloat16).

    The values of ``cu_seqlens`` (and ``seqused_k``, ``block_table``) are checked on the host first where
    ``runtime.check_values`` allows (CPU tensors by default); elsewhere nothing reads them on the host: the
    kernel finds each sequence's rows on the device and writes NaN over the rows of a sequence whose bounds
    (or pages) are invalid. Paged (``block_table``): k and v are ``[num_pages, page_size, heads_kv,
    head_dim]``, sequence b's keys the first ``seqused_k[b]`` positions of its pages (without ``seqused_k``
    the differences of ``cu_seqlens_k``, taken in the kernel)."""
    shape, device = q.shape, q.device
    total_q, heads_q, _ = shape
    paged = block_table is not None
    total_k = block_table.shape[1] * k.shape[1] if paged else k.shape[0]  # paged: the capacity
    if runtime.check_values(device):
        check_seqlens_values(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k,
                             seqused_k=seqused_k, block_table=block_table, num_pages=k.shape[0])  # fmt: skip
    batch = cu_seqlens_q.shape[0] - 1
    out_dtype = q.dtype if descales is None else torch.bfloat16  # fp8: bfloat16 out (FlashAttention-3's)
    if total_q == 0:  # no query: nothing to launch
        lse = torch.empty((heads_q, 0), dtype=torch.float32, device=device)
        return torch.zeros_like(q, dtype=out_dtype), lse
    if batch == 0:  # rows but no sequence: cu_seqlens (one entry, both 0 and the total) is invalid
        lse = torch.full((heads_q, total_q), float("nan"), dtype=torch.float32, device=device)
        return torch.full_like(q, float("nan"), dtype=out_dtype), lse
    triton_runs = runtime.triton_runs_on(device)
    if total_k == 0 and not triton_runs:  # no key at all: every row sees nothing (output 0, LSE -inf)
        lse = torch.full((heads_q, total_q), float("-inf"), dtype=torch.float32, device=device)
        return torch.zeros_like(q, dtype=out_dtype), lse
    if total_k:
        runtime.report_work(
            "flash_attention_varlen", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            is_causal=mods.is_causal, window=mods.window, seqused_k=seqused_k, block_table=block_table,
        )  # fmt: skip
    if not triton_runs:
        return varlen_reference_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, is_causal=mods.is_causal,
                                        window=mods.window, softcap=mods.softcap, scale=scale,
                                        alibi_slopes=mods.alibi_slopes, dropout_p=mods.dropout_p,
                                        rng=mods.rng, seqused_k=seqused_k, block_table=block_table,
                                        descales=descales)  # fmt: skip
    plan = _varlen_plan(q, k, v, batch, mods.key, scale < 0.0, seqused_k is not None, block_table, descales)
    out = tensors.new_output(shape, out_dtype, device)
    lse = tensors.new_output((heads_q, total_q), torch.float32, device)
    if total_k == 0:
        # No key: the kernel still runs, to write 0 and -inf (NaN where cu_seqlens_q is invalid); it reads no
        # key row, so any tensor of k's dtype stands in for the empty K and V.
        k = v = q
    _launch_varlen(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale, mods, seqused_k, block_table,
                   descales)  # fmt: skip
    return out, lse


def _varlen_plan(q, k, v, batch: int, mask, negative: bool, seqused: bool = False, block_table=None,
                 descales=None) -> Plan:  # fmt: skip
    """The forward plan of a packed call of ``batch`` sequences (with the LSE, which the op returns);
    ``mask``: the call's :attr:`ScoreMods.key`."""
    paged = block_table is not None
    return forward_plan(q.shape, k.shape, q.stride(), k.stride(), v.stride(), batch, q.dtype, mask, False,
                        True, negative, q.device, seqused, block_table.shape if paged else None,
                        block_table.stride() if paged else None, descale_key(descales),
                        aligned=tma_aligned(k, v), lse=True, policy=current_policy())  # fmt: skip


def _launch_varlen(plan: Plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale: float,
                   mods: ScoreMods = NO_MODS, seqused_k=None, block_table=None, descales=None) -> None:
    """Launch a packed forward plan (a ``TMA_KV`` plan takes K and V through its descriptors too); an input
    not given stands in as ``lse`` (the plan compiles its reads out)."""
    cu_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    used = lse if seqused_k is None else seqused_k
    table = lse if block_table is None else block_table
    if mods is NO_MODS:  # the calls already checked: nothing to read
        alibi = rng = lse
        softcap, dropout_p = 1.0, 0.0
    else:
        alibi = lse if mods.alibi_slopes is None else mods.alibi_slopes
        rng = lse if mods.rng is None else mods.rng
        softcap, dropout_p = mods.cap, mods.dropout_p
    if plan.descriptors:  # TMA_KV: K and V through the interior loop's descriptors too
        plan.launch(Q=q, K=k, V=v, K_DESC=k, V_DESC=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k,
                    SEQUSED_K=used, KV_TABLE=table, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    elif descales is None:
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k, SEQUSED_K=used,
                    KV_TABLE=table, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:  # fp8 (forward only: no dropout)
        plan.launch(Q=q, K=k, V=v, O=out, LSE=lse, CU_Q=cu_seqlens_q, CU_K=cu_k, SEQUSED_K=used,
                    KV_TABLE=table, ALIBI=alibi, RNG=lse, scale=scale, softcap=softcap, dropout_p=0.0,
                    **descale_inputs(descales))  # fmt: skip


class VarlenCall:
    """A packed call (no window, softcap, ALiBi, dropout, ``seqused_k``, block table or fp8; no copy of q, k,
    v) whose metadata passed every check: what :func:`varlen_forward` does for a call with the same metadata
    (``flash_attention_varlen``'s calls already checked), without looking its plan up again: the value checks
    where ``runtime.check_values`` says, the report, the outputs and the launch. A call with no query row, no
    sequence or no key, or whose kernels cannot run on its device, keeps ``plan`` None and takes
    :func:`varlen_forward` whole."""

    __slots__ = ("plan", "shape", "lse_shape", "dtype", "device", "default_scale", "total_k")

    def __init__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 is_causal: bool, negative: bool):  # fmt: skip
        self.shape, self.dtype, self.device = q.shape, q.dtype, q.device
        self.lse_shape = (q.shape[1], q.shape[0])
        self.default_scale = check_scale(None, q)
        self.total_k = k.shape[0]
        batch = cu_seqlens_q.shape[0] - 1
        self.plan = None
        if q.shape[0] and batch and self.total_k and runtime.triton_runs_on(q.device):
            self.plan = _varlen_plan(q, k, v, batch, (CAUSAL if is_causal else NO_MODS).key, negative)

    def forward(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q: int, max_seqlen_k: int,
                is_causal: bool, scale: float, *fixed) -> tuple:  # fmt: skip
        """:func:`varlen_forward` of such a call (the op's arguments; the plan fixes the others)."""
        plan = self.plan
        if plan is None:
            return varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal,
                                  scale)  # fmt: skip
        device = self.device
        if runtime.check_values(device):
            check_seqlens_values(cu_seqlens_q, cu_seqlens_k, self.shape[0], self.total_k, max_seqlen_q,
                                 max_seqlen_k)  # fmt: skip
        runtime.report_work(
            "flash_attention_varlen", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
            is_causal=is_causal, window=None, seqused_k=None, block_table=None,
        )  # fmt: skip
        out = tensors.new_output(self.shape, self.dtype, device)
        lse = tensors.new_output(self.lse_shape, torch.float32, device)
        _launch_varlen(plan, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, scale)
        return out, lse


def varlen_backward(
    dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal: bool, scale: float,
    window_left=None, window_right=None, softcap=None, deterministic=False, alibi_slopes=None,
    dropout_p: float = 0.0, rng=None, seqused_k=None, block_table=None,
):  # fmt: skip
    """(dq, dk, dv) of :func:`varlen_forward`; the packed backward op's implementation, its flat arguments
    made one :class:`ScoreMods` (:func:`packed_backward`)."""
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)
    return packed_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, scale, mods,
                           deterministic, seqused_k, block_table)  # fmt: skip


def packed_backward(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, scale: float,
                    mods: ScoreMods, deterministic: bool, seqused_k=None, block_table=None):  # fmt: skip
    """(dq, dk, dv) of :func:`packed_forward` under ``mods``; reports its work. Never reads ``cu_seqlens``
    on the host where Triton runs; invalid bounds give NaN (or zero) gradients on the rows of their sequence,
    and nothing outside the tensors is read or written. Paths as :func:`attention_backward`'s. Key rows past
    ``seqused_k`` get zero gradients; paged K/V (``block_table``) has no backward (as in flash-attn)."""
    if block_table is not None:
        raise ValueError("block_table (paged K/V) is forward-only: no gradient flows into the pages")
    dout = tensors.last_dim_contiguous(dout)
    if dlse is not None:
        dlse = dlse.contiguous()
    batch = cu_seqlens_q.shape[0] - 1
    if q.shape[0] == 0 or k.shape[0] == 0 or batch == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    deterministic = deterministic_backward(deterministic, q.device)
    runtime.report_work(
        "flash_attention_varlen_backward", q=q, k=k, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        is_causal=mods.is_causal, window=mods.window, deterministic=deterministic, seqused_k=seqused_k,
    )  # fmt: skip
    if not runtime.triton_runs_on(q.device):
        return varlen_reference_backward(
            dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, is_causal=mods.is_causal,
            window=mods.window, softcap=mods.softcap, scale=scale, alibi_slopes=mods.alibi_slopes,
            dropout_p=mods.dropout_p, rng=mods.rng, seqused_k=seqused_k,
        )  # fmt: skip
    lse = lse.contiguous()
    dtypes = (q.dtype, out.dtype, dout.dtype, lse.dtype, None if dlse is None else dlse.dtype)
    plans = backward_plans(
        q.shape, k.shape, q.stride(), k.stride(), v.stride(), out.stride(), dout.stride(), batch, dtypes,
        dlse is not None, mods.key, True, deterministic, q.device, seqused_k is not None,
        aligned=tma_aligned(q, dout) and tma_aligned(k, v), policy=current_policy(),
    )  # fmt: skip
    return launch_backward(plans, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, scale, mods,
                           deterministic, seqused_k)  # fmt: skip
