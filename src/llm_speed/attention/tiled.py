"""Tiled attention: K/V tiles stream through on-chip memory in two passes. The middle step of the lesson.

The kernel is FlashAttention's forward with ``TWO_PASS`` on (``flash.py``, launched as ``flash.TILED``); the
backward is FlashAttention's (it needs only Q, K, V, O and the LSE). This module registers the operator
``llm_speed::tiled_attention_forward`` and holds the public function.
"""

from __future__ import annotations

import torch

from ..core import autocast
from ..core.args import check_flag
from ..core.dispatch import Op
from . import flash
from .checks import check_options, prepare_attention_inputs, suggest_keywords, unknown_keywords
from .options import from_op

# --- op registration ------------------------------------------------------------------------------------


def forward(
    q, k, v, is_causal: bool, scale: float, window_left=None, window_right=None, softcap=None,
    deterministic=False,
):  # fmt: skip
    """(out, lse) of the two-pass forward; the op's implementation (``deterministic``: the backward's)."""
    mods = from_op(is_causal, window_left, window_right, softcap)
    return flash.attention_forward(q, k, v, scale, mods, two_pass=True)


@torch.library.custom_op("llm_speed::tiled_attention_forward", mutates_args=())
def _forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    scale: float,
    window_left: int | None = None,
    window_right: int | None = None,
    softcap: float | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    return forward(q, k, v, is_causal, scale, window_left, window_right, softcap)


# Same outputs as the flash forward.
_forward_op.register_fake(flash.forward_fake)

# --- autograd: the flash backward -----------------------------------------------------------------------

_forward_call = Op(_forward_op, forward, setup_context=flash.setup_context, backward=flash.autograd_backward)
_forward_call = autocast.dispatch(_forward_call, autocast.LOWER, (0, 1, 2))  # torch.autocast: as SDPA

# --- public function ------------------------------------------------------------------------------------


@suggest_keywords
def tiled_attention(
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
    **unknown,
):
    """Attention that tiles K/V through on-chip memory in two passes, without online softmax.

    Same signature and semantics as :func:`llm_speed.flash_attention` (shapes, GQA, bottom-right causal mask,
    ``window`` and ``softcap``, rows with no visible key -> 0 and LSE -inf, dtypes, strides, zero sizes,
    validation, and ``deterministic``, which chooses the backward's path).

    Each Triton program holds one block of query rows. Pass 1 streams every K tile to find the row max of the
    scores; pass 2 streams K again together with V, summing exp(s - max) and exp(s - max) @ V; the output is
    the ratio. Nothing of size seq_q x seq_kv is written: memory O(batch * heads * seq * head_dim).
    HBM traffic per (batch, head): Q and O once, V once and K twice per query block, i.e.
    O(seq_q * head_dim + (seq_q / BLOCK_M) * seq_kv * head_dim * 3) elements, against O(seq_q * seq_kv) for
    naive attention; FlashAttention's online softmax removes the second read of K.

    Autograd: the backward is FlashAttention's backward kernels (they recompute from Q, K, V, O, LSE), on
    the default path or, with ``deterministic=True`` or PyTorch's deterministic mode, the deterministic one.
    CPU tensors run the Triton kernel under the interpreter, otherwise the PyTorch reference in float32.
    Registered as the ``torch.library`` operator ``llm_speed::tiled_attention_forward`` (fake
    implementation and autograd included), so ``torch.compile(fullgraph=True)`` captures it.
    """
    if unknown:
        unknown_keywords(tiled_attention, unknown)
    is_causal, return_lse, (left, right), softcap = check_options(is_causal, return_lse, window, softcap)
    deterministic = check_flag("deterministic", deterministic)
    q, k, v = autocast.cast_inputs(autocast.LOWER, q, k, v)  # as SDPA: mixed dtypes meet under autocast
    q, k, v, scale = prepare_attention_inputs(q, k, v, scale)
    out, lse = _forward_call(q, k, v, is_causal, scale, left, right, softcap, deterministic)
    return (out, lse) if return_lse else out
