"""FlashAttention (Dao et al., arXiv:2205.14135 and arXiv:2307.08691) in Triton: the kernels of the whole
family (flash forward and backward, the two-pass tiled forward, packed variable-length sequences), their
launcher, and the ``flash_attention`` op.

Layout (every op module): kernels, launcher (configuration, plans, ``forward``/``backward`` implementations),
op registration, autograd, public function. ``tiled.py`` and ``varlen.py`` register their ops on the kernels
and launchers here; ``naive.py`` is plain PyTorch; the plain-PyTorch spec is
:func:`llm_speed.attention.reference.reference_attention`; the argument checks are ``checks.py``.

Kernels. All run on a 1-D grid of (row block, head) programs (see :func:`~.blocks.program_block`) and use
64-bit offsets for everything that multiplies a batch, head or row index by a stride.

Naming follows one convention: ``p_`` pointers, ``b_`` blocks held on chip, ``o_`` offsets, ``m_`` masks;
shape comments use BM (query rows per block), BN (key rows per block) and BD (head_dim padded to a power of
two). Scores are kept in base 2: ``s2 = s * log2(e)`` with ``s = q.k * scale`` (or ``softcap * tanh(s /
softcap)``), so that ``exp(s) == exp2(s2)``; ``exp2`` is the cheap instruction. The LSE stored in HBM is in
natural-log units.

Visibility (``reference.visible`` is the spec): with ``p = i + seq_kv - seq_q`` per sequence, query i sees
key j when ``p - left <= j <= p + right``; a causal mask is ``right = 0``. Each kernel splits its loop over
blocks into three: masked blocks on the left edge of the window, unmasked interior blocks every row of the
program's block fully sees, masked blocks on the right edge (the diagonal and a ragged last block). Blocks
no row may see are not visited at all, so the work grows with the window, not with the sequence.

Constexpr switches specialise one body per variant instead of near-copies:
  TWO_PASS       the tiled forward (row max first, then sums without rescaling) instead of flash's online one
  HAS_LEFT       the window has a left bound ``window_left`` (else keys reach back to the sequence start)
  HAS_RIGHT      the window has a right bound ``window_right`` (causal: 0; else keys reach the sequence end)
  SOFTCAP        scores are capped: ``softcap * tanh(s / softcap)`` (Gemma 2, arXiv:2408.00118)
  IS_VARLEN      packed sequences: rows of sequence b are ``cu_seqlens[b] .. cu_seqlens[b + 1] - 1`` of one
                 ``[total, heads, head_dim]`` tensor (flash-attn's varlen layout), bounds read on device
  MASKED         this loop over blocks applies the visibility and bounds masks to the scores
  EVEN_M/EVEN_N  seq_q / seq_kv is a multiple of the block: no row/column bounds masks on loads and stores
  EVEN_D         head_dim is already a power of two: no head_dim mask
  TMA_KV         (16-bit forward, not paged) the unmasked interior loop loads K and V through tensor
                 descriptors; the backward's kernels take descriptors of their streamed tiles (Q_DESC, ...)
  DESC_SEQ_MAJOR the descriptors are over the rows of sequence-major ``[B, S, H, D]`` tensors
  ROWS32         row offsets in 32 bits: every row of every tensor fits (``rows_fit_32``)
  FP8_GPU_CAST   (fp8) the softmax weights take the GPU's own e4m3 cast (``weights_as``)
  OVERLAP        (16-bit forward, Hopper) the unmasked interior loop issues the next block's QK^T before this
                 block's softmax, so that the two overlap (FlashAttention-3's intra-warpgroup pipelining,
                 arXiv:2407.08608 section 3.2; ``_accumulate_overlapped``)
  DOT_IN_FP32, DOT_PRECISION, RNE_BY_HAND
                 the switches of :mod:`llm_speed.core.kernel_math` (``dot_switches``): bfloat16 dots widened
                 and float32 -> bfloat16 casts rounded by hand under the interpreter only; "ieee" float32
                 products (no silent TF32).
"""

from __future__ import annotations

import math

import torch

from ..core import (
    autocast,  # torch.autocast rules
    runtime,
)
from ..core.args import check_flag
from ..core.dispatch import INFERENCE, Op, plain_call
from ..matmul.fp8 import check_scale_values
from .backward_kernels import (
    ATOMIC_BACKWARD_KERNELS,
    BACKWARD_DKDV,
    BACKWARD_DQ,
    BACKWARD_DQ_CONVERT,
    BACKWARD_PREPROCESS,
    DETERMINISTIC_BACKWARD_KERNELS,
)
from .checks import (
    DESCALE_NAMES,
    FP8_DTYPES,
    check_alibi_slopes,
    check_dropout,
    check_fp8_options,
    check_options,
    is_fp8_call,
    prepare_attention_inputs,
    suggest_keywords,
    unknown_keywords,
)
from .configs import (
    COMPACT,
    FULL,
    LARGE,
    TIERS,
    AttentionTier,
    attention_config,
    padded_head_dim,
    rows_fit_32,
    shipped_configs,
    tier_dq_kernel,
    tier_for,
)
from .forward_kernels import FORWARD, TILED
from .launcher import (
    DENSE_CALLS,
    DenseCall,
    VarlenCall,
    attention_forward,
    backward,
    default_backward_kernels,
    dense_call_key,
    deterministic_backward,
    forward,
    gluon_forward_takes,
    keep_seq_major,
    launch_seq_major,
    packed_forward,
    seq_major_call,
    seq_major_inference,
    varlen_backward,
    varlen_forward,
)
from .options import CAUSAL, NO_MODS, from_op
from .plans import V_T_ALIGN, new_dense_output, seq_major, transposed_values

# The op's public function, and the family's names other modules read from the op module (the kernels,
# configuration and launcher live in the modules imported above: docs/architecture.md).
__all__ = [
    "flash_attention",
    "ATOMIC_BACKWARD_KERNELS",
    "BACKWARD_DKDV",
    "BACKWARD_DQ",
    "BACKWARD_DQ_CONVERT",
    "BACKWARD_PREPROCESS",
    "DETERMINISTIC_BACKWARD_KERNELS",
    "COMPACT",
    "FULL",
    "LARGE",
    "TIERS",
    "AttentionTier",
    "attention_config",
    "padded_head_dim",
    "rows_fit_32",
    "shipped_configs",
    "tier_dq_kernel",
    "tier_for",
    "FORWARD",
    "TILED",
    "VarlenCall",
    "default_backward_kernels",
    "deterministic_backward",
    "keep_seq_major",
    "packed_forward",
    "seq_major_autograd",
    "seq_major_inference",
    "varlen_backward",
    "varlen_forward",
    "V_T_ALIGN",
    "transposed_values",
]

# --- op registration ------------------------------------------------------------------------------------


def _empty(x: torch.Tensor, shape, dtype=None) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype or x.dtype, device=x.device)


@torch.library.custom_op("llm_speed::flash_attention_forward", mutates_args=())
def forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, is_causal, scale, window_left, window_right, softcap, deterministic, alibi_slopes,
                   dropout_p, rng)  # fmt: skip


@forward_op.register_fake
def forward_fake(q, k, v, is_causal, scale, window_left=None, window_right=None, softcap=None,
                 deterministic=False, alibi_slopes=None, dropout_p=0.0, rng=None):  # fmt: skip
    """Shapes and dtypes of (out, lse) for fake tensors; shared with the tiled forward operator."""
    batch, heads_q, seq_q, _ = q.shape
    out = new_dense_output(q.shape, seq_major(q.shape, q.stride()), q.dtype, q.device)
    return out, _empty(q, (batch, heads_q, seq_q), torch.float32)


@torch.library.custom_op("llm_speed::flash_attention_backward", mutates_args=())
def backward_op(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    rng: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward(dout, q, k, v, out, lse, dlse, is_causal, scale, window_left, window_right, softcap,
                    deterministic, alibi_slopes, dropout_p, rng)  # fmt: skip


@backward_op.register_fake
def _backward_fake(dout, q, k, v, out, lse, dlse, is_causal, scale, window_left=None, window_right=None,
                   softcap=None, deterministic=False, alibi_slopes=None, dropout_p=0.0,
                   rng=None):  # fmt: skip
    return _empty(q, q.shape), _empty(k, k.shape), _empty(v, v.shape)


_backward_call = Op(backward_op, backward)
_backward_call = autocast.dispatch(_backward_call, autocast.KEEP)  # torch.autocast: as saved (issue 34)


# --- autograd -------------------------------------------------------------------------------------------


def setup_context(ctx, inputs, output):
    """Save what the backward recomputes from; shared with the tiled forward operator."""
    q, k, v, is_causal, scale, *rest = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (is_causal, scale, *rest)


def autograd_backward(ctx, dout, dlse):
    """Gradients for (q, k, v) through the flash backward; shared with the tiled forward operator."""
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = _backward_call(dout, q, k, v, out, lse, dlse, *ctx.args)
    return (dq, dk, dv) + (None,) * len(ctx.args)


_forward_plain = Op(forward_op, forward, setup_context=setup_context, backward=autograd_backward)
_forward_call = autocast.dispatch(_forward_plain, autocast.LOWER, (0, 1, 2))  # torch.autocast: as SDPA


class _SeqMajorForward(torch.autograd.Function):
    """The op's autograd node for a kept call on flash-attn's ``[batch, seq, heads, dim]`` tensors as given
    (:func:`seq_major_autograd`): the node :func:`flash_attention` records on their ``transpose(1, 2)``
    views, with the transposes made inside it, where autograd records none."""

    @staticmethod
    def forward(ctx, q, k, v, call, is_causal, scale, deterministic):
        out, lse = launch_seq_major(call, q, k, v, scale, True)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (is_causal, scale, None, None, None, deterministic)
        return out

    @staticmethod
    def backward(ctx, dout):
        if dout is None:
            return (None,) * 7
        q, k, v, out, lse = ctx.saved_tensors
        views = (t.transpose(1, 2) for t in (dout, q, k, v, out))
        dq, dk, dv = _backward_call(*views, lse, None, *ctx.args)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None, None, None, None


def seq_major_autograd(q, k, v, is_causal: bool, scale: float | None, deterministic: bool):
    """For flash-attn's interface: the ``[batch, seq_q, heads_q, dim]`` output, with the op's autograd node,
    of a plain call with grad (:func:`llm_speed.core.dispatch.plain_call` says ``AUTOGRAD``) on ``[batch,
    seq, heads, dim]`` tensors that an earlier call of the same metadata made through
    :func:`flash_attention` (and :func:`keep_seq_major` with ``lse``); None when there is none. The
    arguments as for :func:`seq_major_inference`, ``deterministic`` a bool."""
    call = seq_major_call(q, k, v, is_causal, scale, True)
    if call is None:
        return None
    scale = call.default_scale if scale is None else scale
    return _SeqMajorForward.apply(q, k, v, call, is_causal, scale, deterministic)


def fp8_forward(q, k, v, descale_q, descale_k, descale_v, is_causal: bool, scale: float, window_left=None,
                window_right=None, softcap=None, alibi_slopes=None):  # fmt: skip
    """(out bfloat16, lse) of fp8 attention (e4m3 q, k, v); the fp8 op's implementation. The descales'
    values (finite, > 0) are checked on the host where ``runtime.check_values`` allows; elsewhere the kernel
    writes NaN over the rows a bad one scales."""
    if runtime.check_values(q.device):
        check_scale_values(*zip(DESCALE_NAMES, (descale_q, descale_k, descale_v), strict=True))
    mods = from_op(is_causal, window_left, window_right, softcap, alibi_slopes)
    return attention_forward(q, k, v, scale, mods, descales=(descale_q, descale_k, descale_v))


@torch.library.custom_op("llm_speed::flash_attention_fp8_forward", mutates_args=())
def _fp8_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descale_q: torch.Tensor | None,
    descale_k: torch.Tensor | None,
    descale_v: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_forward(q, k, v, descale_q, descale_k, descale_v, is_causal, scale, window_left, window_right,
                       softcap, alibi_slopes)  # fmt: skip


@_fp8_forward_op.register_fake
def _fp8_forward_fake(q, k, v, descale_q, descale_k, descale_v, is_causal, scale, window_left=None,
                      window_right=None, softcap=None, alibi_slopes=None):  # fmt: skip
    batch, heads_q, seq_q, _ = q.shape
    out = new_dense_output(q.shape, seq_major(q.shape, q.stride()), torch.bfloat16, q.device)
    return out, _empty(q, (batch, heads_q, seq_q), torch.float32)


_fp8_forward_call = Op(_fp8_forward_op, fp8_forward)  # forward only: no gradient formula


def _fp8_attention(q, k, v, descales, is_causal, scale, left, right, softcap, alibi_slopes, dropout_p):
    """:func:`flash_attention` with e4m3 q, k, v: (out, lse)."""
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale, FP8_DTYPES)
    batch, heads_kv = q.shape[0], k.shape[1]
    check_fp8_options(q, k, v, descales, dropout_p, batch, heads_kv)
    alibi_slopes = check_alibi_slopes(alibi_slopes, batch, q.shape[1], q.device)
    return _fp8_forward_call(q, k, v, *descales, is_causal, scale, left, right, softcap, alibi_slopes)


# --- public function ------------------------------------------------------------------------------------


@suggest_keywords
def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
    alibi_slopes: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    descale_q: torch.Tensor | None = None,
    descale_k: torch.Tensor | None = None,
    descale_v: torch.Tensor | None = None,
    **unknown,
):
    """FlashAttention: ``softmax(q k^T * scale) v`` without ever storing the seq_q x seq_kv matrix.

    Args:
        q: ``[batch, heads_q, seq_q, head_dim]``.
        k, v: ``[batch, heads_kv, seq_kv, head_dim]``; heads_q a multiple of heads_kv (MHA, GQA, MQA). K/V are
            shared by each group of heads_q / heads_kv query heads without being repeated in memory.
        is_causal: mask aligned bottom-right: query i sees keys j <= i + seq_kv - seq_q (as FlashAttention
            >= 2.1 and KV-cache prefill do). PyTorch SDPA aligns top-left (j <= i); they differ when
            seq_q != seq_kv. A row that sees no key outputs 0 with LSE -inf and gets zero gradients.
            Fully masked key blocks are skipped, not computed.
        scale: score scale, default ``1 / sqrt(head_dim)``; any finite real number.
        return_lse: also return the log-sum-exp of each row's scaled scores, ``[batch, heads_q, seq_q]`` fp32.
        window: ``(left, right)`` local attention, flash-attn's ``window_size`` convention but with None
            (not -1) for an unbounded side: with ``p = i + seq_kv - seq_q``, query i sees keys
            ``p - left <= j <= p + right``; ``is_causal=True`` makes right 0. A Mistral / Gemma-2 sliding
            window of W tokens is ``window=(W - 1, 0), is_causal=True``. Key blocks outside every row's
            window are skipped: the work grows with the window, not with seq_kv.
        softcap: ``c > 0``: scores ``s`` become ``c * tanh(s / c)`` before masking and softmax (Gemma 2,
            arXiv:2408.00118; Grok-1); the backward includes the derivative ``1 - tanh^2``.
        deterministic: the backward's path (see below).
        alibi_slopes: float32 ``[heads_q]`` or ``[batch, heads_q]``: ALiBi (Press et al., arXiv:2108.12409),
            ``-slope * |i + seq_kv - seq_q - j|`` added to the scores after the cap (flash-attn's rule),
            forward and backward (the slopes get no gradient).
        dropout_p: attention dropout in [0, 1): each weight is dropped with this probability and the kept
            ones scaled by ``1 / (1 - dropout_p)``, forward and backward, the mask drawn in the kernels by
            Philox from a seed and offset taken from PyTorch's generator of q's device (``torch.manual_seed``
            reproduces a call; :func:`llm_speed.attention.reference.dropout_keep` rebuilds the mask). The LSE
            is the one before dropout. Applied whenever > 0 (pass 0 in evaluation, as with flash-attn).
        descale_q, descale_k, descale_v: fp8 attention (FlashAttention-3's, arXiv:2407.08608): q, k and v
            ``torch.float8_e4m3fn`` (as :func:`llm_speed.quantize_fp8` makes them), each descale None (1) or
            float32 ``[]``/``[1]`` (per tensor), ``[heads_kv]`` or ``[batch, heads_kv]`` (query head h takes
            its KV head's, h // group, as FlashAttention-3); the dequantized inputs are ``x.float() *
            descale``. The products run on fp8 tensor cores: q.k^T with the two descales folded into the
            score scale, then the weights rounded to e4m3 (scaled by 2**8, FlashAttention-3's Max_offset, so
            that they use e4m3's range) times v, v's descale applied once to the output. Output bfloat16;
            the LSE sees only the q.k^T product, not the rounded weights (on Hopper's fp8 tensor cores that
            product is accumulated at their precision, as ``torch._scaled_mm(..., use_fast_accum=True)``
            and FlashAttention-3: about 1e-4 relative). Descales must be finite and > 0: checked on the host
            where ``runtime.check_values`` says, otherwise a bad one makes the rows it scales NaN. Forward
            only: a ValueError when grad mode is on and an input requires grad, or with ``dropout_p``.
            Causal, windows, softcap, GQA and ALiBi as for 16-bit inputs.

    dtypes float16, bfloat16, float32 (all three alike; fp8 e4m3 with the descales above); statistics and
    accumulation in float32; the output has q's dtype (bfloat16 for fp8), shape ``[batch, heads_q, seq_q,
    head_dim]`` and q's order of dims: where q is a ``[batch, seq_q, heads_q, head_dim]`` tensor viewed with
    ``.transpose(1, 2)`` (flash-attn's and Hugging Face's layout, or a slice of a packed QKV) the output is
    written so that ``out.transpose(1, 2)`` is contiguous (no copy made); otherwise the output is contiguous.
    head_dim: any from 1 to 256 (padded to a power of two >= 16 on chip by masked loads, never copied). Any
    strides with a contiguous last dim are read in place (a ``[B, S, H, D]`` tensor viewed with
    ``.transpose(1, 2)`` costs no copy); a non-contiguous last dim is copied first. Inputs are not modified.

    Zero sizes: batch 0 or seq_q 0 give empty results; seq_kv 0 gives output 0 and LSE -inf (no key is
    visible); gradients are zeros.

    Backward (autograd): recomputes the probabilities block by block from Q, K, V, O and the LSE; GQA
    gradients are summed over each query group; gradients through the returned LSE are supported. Two paths
    (PyTorch's convention, flash-attn's ``deterministic``):

    - atomic: one kernel over key blocks computes dK, dV and dQ (five matmuls per tile, FlashAttention-2's
      backward), adding each block's dQ share to an fp32 accumulator with atomics. The order of those
      additions is the GPU's, so dQ's last bits can differ from run to run (dK and dV cannot);
    - dQ kernel: dQ comes from a kernel of its own that recomputes the scores (seven matmuls per tile),
      every gradient element has one writer, and gradients are bitwise repeatable. Taken with
      ``deterministic=True``, whenever ``torch.are_deterministic_algorithms_enabled()`` when the backward
      runs, and by default on devices with Hopper's shared memory (227 KB per block: H100, H200), where it
      measured 1.7-1.9x faster than the atomic path (H100 SXM, d=128, 16k tokens). Other devices default
      to the atomic path.

    ``deterministic`` only chooses the backward's path; the forward is always bitwise repeatable.

    Devices: CUDA tensors run the Triton kernels. CPU tensors run the same Triton kernels through the
    interpreter when ``TRITON_INTERPRET=1`` was set before import (``llm_speed.core.runtime.INTERPRETED``);
    otherwise they run the PyTorch reference (``reference.py``) in float32, which stores the scores.

    Memory on the Triton path: O(batch * heads * seq * head_dim) in forward and backward, never
    O(seq_q * seq_kv).

    Flags must be real bools (NumPy bools accepted); flash-attn's and SDPA's argument names (``causal=``,
    ``softmax_scale=``, ``attn_mask=``, ...) get a TypeError naming ours.
    """
    if unknown:
        unknown_keywords(flash_attention, unknown)
    known = None  # the key of a call that DENSE_CALLS may serve: the common inference call
    if (
        window is None and softcap is None and alibi_slopes is None and type(dropout_p) is float
        and not dropout_p and descale_q is None and descale_k is None and descale_v is None
        and (is_causal is True or is_causal is False) and (return_lse is True or return_lse is False)
        and (deterministic is True or deterministic is False)
        and (scale is None or type(scale) is float and -math.inf < scale < math.inf)
        and (mode := plain_call(q, k, v))
    ):  # fmt: skip
        known = dense_call_key(q, k, v, is_causal, scale, return_lse or mode != INFERENCE)
        call = DENSE_CALLS.get(known)
        if call is not None and mode == INFERENCE:
            out, lse = call(q, k, v, is_causal, scale)
            return (out, lse) if return_lse else out
        if call is not None:  # with grad: the op's autograd node around the kept launch
            scale = call.default_scale if scale is None else scale
            out, lse = _forward_plain.checked(call.forward, q, k, v, is_causal, scale, None, None, None,
                                              deterministic)  # fmt: skip
            return (out, lse) if return_lse else out
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    if is_fp8_call(q, descale_q, descale_k, descale_v):
        out, lse = _fp8_attention(q, k, v, (descale_q, descale_k, descale_v), is_causal, scale, left, right,
                                  softcap, alibi_slopes, dropout_p)  # fmt: skip
        return (out, lse) if return_lse else out
    q, k, v = autocast.cast_inputs(autocast.LOWER, q, k, v)  # as SDPA: mixed dtypes meet under autocast
    given = q, k, v
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    keep = (
        known is not None and given[0] is q and given[1] is k and given[2] is v  # nothing copied
        and runtime.triton_runs_on(q.device) and q.shape[0] and q.shape[2] and k.shape[2]
        and not gluon_forward_takes(q, k, v, scale, CAUSAL if is_causal else NO_MODS)  # launched anew
    )  # fmt: skip
    if keep and mode == INFERENCE:
        # what the op would launch, kept for the next such call (the LSE's stores compiled out unless it is
        # asked for)
        call = DenseCall(q, k, v, is_causal, scale < 0.0, return_lse)
        DENSE_CALLS.put(known, call)
        out, lse = call(q, k, v, is_causal, scale)
    elif alibi_slopes is None and not dropout_p:  # the common call: nothing more to check
        out, lse = _forward_call(q, k, v, is_causal, scale, left, right, softcap, deterministic)
        if keep:  # with grad: the launch of forward() with its LSE, for Op.checked
            DENSE_CALLS.put(known, DenseCall(q, k, v, is_causal, scale < 0.0, True))
    else:
        alibi_slopes = check_alibi_slopes(alibi_slopes, q.shape[0], q.shape[1], q.device)
        dropout_p, rng = check_dropout(dropout_p, q.device)
        out, lse = _forward_call(
            q, k, v, is_causal, scale, left, right, softcap, deterministic, alibi_slopes, dropout_p, rng
        )
    return (out, lse) if return_lse else out
