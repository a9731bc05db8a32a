"""Patch a Hugging Face ``transformers`` causal LM onto llm-speed's kernels: Llama, Mistral, Mixtral, Qwen2,
Qwen3, Qwen2-MoE, Qwen3-MoE, Gemma, Gemma-2, Gemma-3 (text), Phi-3, OLMo-2, Granite and DeepSeek-V3.

``apply(model)`` changes that model only:

- every RMSNorm module is replaced by an :class:`llm_speed.nn.RMSNorm` around the same weight (the family's
  casting: Llama's rounding before the weight, or float32 throughout for Gemma and OLMo-2; Gemma's ``1 +
  weight``; the in-place backward for the norms whose output feeds only linear layers);
- every gated MLP module by an :class:`llm_speed.nn.GatedMLP` around the same projections (SwiGLU, GeGLU for
  Gemma, Phi-3's fused ``gate_up_proj``; a dense layer's MLP and a shared expert alike);
- the sparse MoE blocks of Mixtral, Qwen2-MoE, Qwen3-MoE and DeepSeek-V3: routing through
  :func:`llm_speed.moe_route` and the experts through :func:`llm_speed.fused_moe`
  (:func:`llm_speed.integrations.moe_blocks.patch_moe_blocks`; the router logits, and so the load-balancing
  loss, unchanged);
- the rotary embedding: the family's module-level ``apply_rotary_pos_emb`` (and DeepSeek's
  ``apply_rotary_pos_emb_interleave``) is wrapped, and the wrapper runs :func:`llm_speed.apply_rotary_qk` (q
  and k in one launch, partial rotary dims) only while an attention module of a patched model runs (forward
  hooks, so a gradient-checkpointing recomputation takes the same path), leaving other models alone;
- attention, registered as ``"llm_speed"`` with transformers' ``AttentionInterface`` (so
  ``from_pretrained(..., attn_implementation="llm_speed")`` works once this module is imported) and with
  ``AttentionMaskInterface``. Batches without padding run :func:`llm_speed.flash_attention`; padded and
  packed batches (``attention_mask`` with zeros, position_ids that restart) run
  :func:`llm_speed.flash_attention_varlen` on the real tokens only, with zeros at padded positions; a static
  cache's decode steps under torch.compile :func:`llm_speed.flash_attention_with_kvcache`. All are causal
  with the model's scaling, GQA, sliding window (Mistral, Qwen, Gemma-2/3's local layers, Phi-3; passed by
  the layer, or the attention module's ``sliding_window`` where the layer leaves it to the mask) and
  attention logit softcap (Gemma-2); MLA's narrower values (DeepSeek) are padded to the query head dim;
- the loss: with ``labels``, the causal-LM forward runs with no logits built and returns
  :func:`llm_speed.fused_linear_cross_entropy` of the last hidden states and ``lm_head`` (shifted labels or
  ``shift_labels``, ignore_index -100, mean over tokens or sum / ``num_items_in_batch`` as transformers'
  ``ForCausalLMLoss``; the final logit softcap of Gemma-2/3, Granite's ``logits_scaling``, the MoE router's
  auxiliary loss when ``output_router_logits``) and ``logits=None`` (``return_dict=False``: transformers'
  tuple with None in the logits' place). A batch whose labels are all -100 has loss 0 and zero gradients
  (transformers: NaN). Without labels, or with ``logits_to_keep`` other than 0 (logits asked for beside
  the loss), the forward is unchanged.
  ``apply(model, cross_entropy_accum_dtype=torch.float32)`` sums the ``lm_head`` weight's gradient over the
  token chunks in float32 (Liger's ``accum_dtype``; :func:`llm_speed.fused_linear_cross_entropy`).

Padding: left, right (or inner, without a sliding window spanning it) padding of any lengths. The mask
function registered for ``"llm_speed"`` hands the attention the 2-D padding mask when transformers would use
``is_causal`` (plain causal, or a window no shorter than the keys) and for the config's sliding window (the
layers pass it to the attention, as to flash-attention-2), so no ``[batch, 1, q, kv]`` mask is built, as long
as the queries are the last keys (no cache, or a dynamic one); otherwise transformers' 4-D SDPA mask, which is
checked element by element against causal (and windowed) attention over each row's real tokens (a 2-D mask
of a windowed layer: that no window spans a pad). Either way the real tokens are found once per forward per
mask (a few small host syncs), not per layer. Attention outputs zeros at padded positions, as transformers'
flash-attention-2 path does (eager attention computes other values there): a label predicted from a padded
position (a left-padded row's first real token) is trained on a different hidden state, so set such labels
to -100.

Static cache (``generate(..., cache_implementation="static")``, a ``StaticCache``, chunked prefill): the 4-D
mask says where the queries sit in the cache (the last key a real query sees is its own). Eager, the keys
are cropped to the last query (one host read per forward) and the call is the padded case above. Under
``torch.compile`` (generate's compiled decode, ``fullgraph=True``) nothing is read on the host:
:func:`llm_speed.flash_attention_with_kvcache` attends from each row's first real key up to each query, both
taken from the mask on the device, with zeros at padded queries; that path does not check the mask element
by element: a row's real keys must be one run (left padding, what generate makes), else its outputs are NaN.

Packing (padding-free batches, as TRL's ``DataCollatorWithFlattening``): position_ids that restart inside a
row (transformers reads them when there is no cache: ``use_cache=False``, or training) or a block-diagonal
causal 4-D mask run :func:`llm_speed.flash_attention_varlen` on the packed sequences; a real token that sees
no earlier key begins a sequence.

The model's original attention (SDPA if ``apply`` replaced it, else eager; eager where the attention weights
are asked for or for a softcap) runs, with one warning per reason per process, for ``output_attentions=True``
and for masks the kernels cannot compute: other custom or bidirectional patterns, additive biases, a window
spanning an inner pad. ValueError naming what is accepted for malformed masks (a wrong shape or rank; a 2-D
mask with values other than 0/1 where it reaches the attention as such: through a model, transformers casts a
2-D mask to bool first), flash-attn style ``cu_seq_lens_*`` arguments, attention dropout in training
and non-causal configs. Inputs in dtypes the kernels do not take (float64) run the model's original code
(its norms, MLPs, attention and loss; the attention with one warning).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import threading
import warnings

import torch
from torch import nn

from ..attention import flash_attention, flash_attention_varlen, flash_attention_with_kvcache
from ..core.args import check_flag, type_name
from ..core.tensors import FLOAT_DTYPES
from ..fused.cross_entropy import check_accum_dtype, fused_linear_cross_entropy
from ..fused.rotary_qk import apply_rotary_qk
from ..nn import GatedMLP, RMSNorm
from .forwards import replace_forward
from .moe_blocks import patch_moe_blocks

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
    from transformers.utils import ModelOutput
except ImportError:  # the package imports without the optional extra; apply() says what is missing
    transformers = None
    causal_mask_function = None

ATTENTION_NAME = "llm_speed"
PRE_NORMS = ("input_layernorm", "post_attention_layernorm", "norm")  # Llama-style blocks: norm -> linears
ROTARY = ("apply_rotary_pos_emb",)


@dataclasses.dataclass(frozen=True)
class Family:
    """How one model family's modules map onto llm-speed's.

    module: the modeling module. offset, casting: its RMSNorm's (``1.0``: Gemma's ``1 + weight``; ``"llama"``:
    the normalised x rounded to the input dtype before the weight; ``"float32"``: float32 throughout). The
    norm's weight init needs no choice here: the model's own weights are kept. in_place: the norms (attribute
    names) whose output feeds linear layers only, so their backward may write dx over the output gradient
    (never a post-norm, whose gradient the residual branch shares). activation: the config field naming the
    MLP activation. rotary: the module-level functions wrapped (DeepSeek's interleaved one with
    ``interleaved=True``). moe: the family has sparse MoE blocks (:mod:`.moe_blocks` patches them).
    """

    module: str
    offset: float = 0.0
    casting: str = "llama"
    in_place: tuple[str, ...] = PRE_NORMS
    activation: str = "hidden_act"
    rotary: tuple[str, ...] = ROTARY
    moe: bool = False


def _modeling(name: str) -> str:
    return f"transformers.models.{name}.modeling_{name}"


GEMMA_PRE_NORMS = ("input_layernorm", "pre_feedforward_layernorm", "norm")  # Gemma-2/3: post-norms too
FAMILIES = {  # model_type: Family
    "llama": Family(_modeling("llama")),
    "mistral": Family(_modeling("mistral")),
    "mixtral": Family(_modeling("mixtral"), moe=True),
    "qwen2": Family(_modeling("qwen2")),
    "qwen3": Family(_modeling("qwen3")),
    "qwen2_moe": Family(_modeling("qwen2_moe"), moe=True),
    "qwen3_moe": Family(_modeling("qwen3_moe"), moe=True),
    "gemma": Family(_modeling("gemma"), 1.0, "float32"),  # GemmaMLP reads hidden_act, Gemma-2/3's MLPs not
    "gemma2": Family(_modeling("gemma2"), 1.0, "float32", GEMMA_PRE_NORMS, "hidden_activation"),
    "gemma3_text": Family(_modeling("gemma3"), 1.0, "float32", GEMMA_PRE_NORMS, "hidden_activation"),
    "phi3": Family(_modeling("phi3")),
    "olmo2": Family(_modeling("olmo2"), casting="float32", in_place=("norm",)),
    "granite": Family(_modeling("granite")),
    "deepseek_v3": Family(_modeling("deepseek_v3"), rotary=(*ROTARY, "apply_rotary_pos_emb_interleave"),
                          moe=True),  # fmt: skip
}
SUPPORTED = tuple(FAMILIES)
# transformers' activation names -> llm_speed.nn.GatedMLP's (the tanh GELU: gelu_pytorch_tanh, gelu_new)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_tanh": "gelu_tanh"}  # fmt: skip


def _require_transformers():
    if transformers is None:
        raise ImportError("llm_speed.integrations.transformers needs transformers: pip install llm-speed[hf]")


ACCEPTED_MASKS = (
    "None, a 2-D padding mask [batch, kv_len] of 0/1, or a 4-D [batch, 1, q_len, kv_len] mask (bool, or "
    "additive with 0 and large negative values) that is causal over each row's real tokens or over the "
    "packed sequences of a row (block-diagonal), with the layer's sliding window if any; a cache's empty "
    "slots after the queries"
)


class _Inexpressible(ValueError):
    """A well-formed mask that the kernels cannot compute: that call runs the model's original attention."""


class _Unpadded:
    """Where the real tokens of a padded (or packed) batch are: computed once per mask, reused by the layers.

    ``starts`` (only when the queries are all the keys): [batch, kv_len] bool, the real tokens that begin a
    sequence (each row's first, and in a packed row each that sees no earlier key); without it each row is one
    sequence, its queries the last ``q_len`` keys."""

    def __init__(self, key_valid: torch.Tensor, q_len: int, starts: torch.Tensor | None = None):
        if starts is None:
            query_valid = key_valid[:, key_valid.shape[1] - q_len :]  # query i is key kv_len - q_len + i
            lengths = torch.stack([query_valid.sum(1), key_valid.sum(1)])  # [2, batch]
            cu = nn.functional.pad(lengths.cumsum(1), (1, 0)).to(torch.int32)
            self.cu_q, self.cu_k = cu[0], cu[1]
            self.q_batch, self.q_pos = query_valid.nonzero(as_tuple=True)  # host syncs (nonzero's size)
            self.k_batch, self.k_pos = key_valid.nonzero(as_tuple=True)
            self.max_q, self.max_k = lengths.max(1).values.tolist()
            return
        self.q_batch, self.q_pos = key_valid.nonzero(as_tuple=True)  # row-major: each sequence contiguous
        sequence = starts[self.q_batch, self.q_pos].cumsum(0) - 1  # of each real token
        lengths = torch.bincount(sequence)
        self.cu_q = self.cu_k = nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        self.k_batch, self.k_pos = self.q_batch, self.q_pos
        self.max_q = self.max_k = int(lengths.max()) if lengths.numel() else 0


def _refuse_mask(reason: str):
    raise ValueError(
        f"llm_speed attention got an attention_mask it cannot read ({reason}); accepted: {ACCEPTED_MASKS}"
    )


def _check_inputs(query, key, value, attention_mask) -> None:
    """The tensors of an attention call, checked before any work: q, k, v 4-D tensors, the mask None or a
    tensor with values to read."""
    for name, t, layout in (("query", query, "[batch, heads, q_len, head_dim]"),
                            ("key", key, "[batch, kv_heads, kv_len, head_dim]"),
                            ("value", value, "[batch, kv_heads, kv_len, head_dim]")):  # fmt: skip
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type_name(t)}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dims {layout}, got shape {tuple(t.shape)}")
    if attention_mask is None:
        return
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be None or a torch.Tensor, got {type_name(attention_mask)}; accepted: "
            f"{ACCEPTED_MASKS}"
        )
    if attention_mask.is_meta:  # its values are read to find the real tokens
        _refuse_mask(f"a mask on the meta device, with no values; query is on {query.device}")


def _inexpressible(reason: str):
    raise _Inexpressible(f"an attention_mask the kernels cannot compute ({reason})")


def _window_agrees(key_valid: torch.Tensor, left: int) -> torch.Tensor:
    """[batch, kv_len] bool: whether a query at each position sees the same real keys through a window of
    ``left + 1`` positions (the model's mask) as through one of ``left + 1`` real tokens (the varlen kernel,
    which counts by rank among a row's real tokens): the real keys among its last ``left + 1`` positions are
    ``min(left + 1, rank + 1)``, i.e. no pad lies inside its window after a real token. True at padding."""
    width = left + 1
    seen = key_valid.to(torch.int32).cumsum(1)  # real tokens up to and including each position
    before = nn.functional.pad(seen, (width, 0))[:, : seen.shape[1]]  # ... up to position p - width
    return ((seen - before) == seen.clamp(max=width)) | ~key_valid


def _query_offset(visible: torch.Tensor) -> torch.Tensor:
    """The key position of query 0 under a [batch, q_len, kv_len] bool mask, as a 0-d tensor (no host read):
    the last key a real query sees is its own, and the queries are consecutive; -1 if no query sees a key.
    (A padded query after the real ones sees only earlier keys: the largest such offset is the real one.)"""
    q_len, kv_len = visible.shape[1:]
    last = kv_len - 1 - visible.flip(2).to(torch.int8).argmax(2)  # [batch, q_len]
    offsets = last - torch.arange(q_len, device=visible.device)
    return torch.where(visible.any(2), offsets, -1).amax()


def _classify_mask(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, left: int | None):
    """``(keys, unpadding)``: the queries use the first ``keys`` keys (fewer than ``kv_len`` with a static
    cache's empty slots after them); ``unpadding`` None for plain causal (windowed) attention over those keys,
    else an :class:`_Unpadded`. ValueError for a malformed mask, :class:`_Inexpressible` for a pattern the
    kernels do not compute.

    A 2-D mask and a 4-D one with as many queries as keys: query i is the token of key ``kv_len - q_len + i``
    (transformers' masks with no cache or a dynamic cache). A 4-D mask with fewer queries than keys says where
    the queries are (:func:`_query_offset`; a static cache). The varlen kernel is causal and windowed by each
    token's rank among the real tokens of its sequence, so left, right and inner padding all work while the
    window does not span a pad: a 4-D mask is checked element by element against that, a 2-D one of a windowed
    layer (``left`` not None) by :func:`_window_agrees`. A 4-D mask with as many queries as keys may pack
    several sequences in a row (block-diagonal causal, as transformers builds from position_ids that restart):
    a real token that sees no earlier key begins a sequence.
    """
    keys, starts = kv_len, None
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_len):
            _refuse_mask(f"2-D mask of shape {tuple(mask.shape)}, expected [{batch}, {kv_len}]")
        if mask.dtype == torch.bool:
            key_valid = mask
        else:
            key_valid = mask != 0
            if not bool(((mask == 0) | (mask == 1)).all()):
                _refuse_mask("a 2-D mask with values other than 0 and 1")
        checks = [key_valid.all(), torch.ones((), dtype=torch.bool, device=mask.device)]
        if left is not None:  # a windowed layer: the window the kernel applies over each row's real tokens
            checks.append(_window_agrees(key_valid, left)[:, kv_len - q_len :].all())
    elif mask.dim() == 4:
        if mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (1, q_len, kv_len):
            _refuse_mask(f"4-D mask of shape {tuple(mask.shape)}, expected [{batch}, 1, {q_len}, {kv_len}]")
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        visible = visible.expand(batch, q_len, kv_len)
        if mask.dtype != torch.bool and not bool(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2))
                                                 .all()):  # fmt: skip
            _inexpressible("an additive mask with values other than 0 and large negative ones: a bias")
        if q_len != kv_len:  # a static cache: its empty slots after the queries are cropped
            offset = int(_query_offset(visible))
            keys = offset + q_len if offset >= 0 else kv_len
            if keys > kv_len or bool(visible[:, :, keys:].any()):
                _inexpressible("not causal: a query sees a key after its own")
            visible = visible[:, :, :keys]
        key_valid = visible.any(1)  # a real key is visible at least to its own query
        query_valid = key_valid[:, keys - q_len :]
        rank = key_valid.cumsum(1) - 1  # position of each real key among its row's real tokens
        if q_len == keys:  # packed sequences: a real token that sees no earlier key begins one
            first = visible.to(torch.int8).argmax(2)
            starts = key_valid & (first == torch.arange(keys, device=mask.device))
        else:
            starts = key_valid & (rank == 0)
        sequence = starts.cumsum(1)
        rank_q, rank_k = rank[:, keys - q_len :, None], rank[:, None, :]
        expected = key_valid[:, None, :] & (rank_k <= rank_q)
        expected &= sequence[:, None, :] == sequence[:, keys - q_len :, None]
        if left is not None:
            expected &= rank_k >= rank_q - left
        agrees = (visible == expected) | ~query_valid[:, :, None]  # rows of padding tokens output zeros
        checks = [key_valid.all(), (starts.sum(1) <= 1).all(), agrees.all()]
        if q_len != keys:
            starts = None
    else:
        _refuse_mask(f"a {mask.dim()}-D mask")
    all_real, one_sequence, *ok = torch.stack(checks).tolist()  # one host sync for every check
    if ok and not ok[0]:
        _inexpressible("not causal over each sequence's real tokens: a custom or bidirectional pattern, or a "
                       "window that spans a pad")  # fmt: skip
    if all_real and one_sequence:
        return keys, None
    return keys, _Unpadded(key_valid, q_len, starts if not one_sequence else None)


def _unpadding(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, left: int | None):
    """:func:`_classify_mask`, cached on the mask tensor (an :class:`_Inexpressible` too): transformers passes
    one mask object to every layer of a forward, so the check and its host syncs happen once per forward (per
    mask kind), not per layer. Keyed on the tensor's version too: a user's mask buffer changed in place
    between forwards is classified again."""
    version, cache = getattr(mask, "_llm_speed_unpadding", (None, None))
    if cache is None or version != mask._version:
        cache = {}
        mask._llm_speed_unpadding = (mask._version, cache)
    key = (batch, q_len, kv_len, left)
    if key not in cache:
        try:
            cache[key] = _classify_mask(mask, batch, q_len, kv_len, left)
        except _Inexpressible as error:
            cache[key] = error
    return cache[key]


_WARNED: set[str] = set()  # fallback reasons warned about in this process (as transformers' warning_once)


def _dense_mask(attention_mask, batch: int, q_len: int, kv_len: int, left: int | None, device):
    """The [batch, 1, q_len, kv_len] bool mask that None or a 2-D padding mask stands for here: causal with
    query i at key ``kv_len - q_len + i``, the layer's window by position, the padding's keys hidden."""
    position = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    keys = torch.arange(kv_len, device=device)[None, :]
    visible = keys <= position
    if left is not None:
        visible = visible & (keys >= position - left)
    visible = visible.expand(batch, 1, q_len, kv_len)
    if attention_mask is not None:
        visible = visible & attention_mask.to(device=device, dtype=torch.bool)[:, None, None, :]
    return visible


def _original_attention(module, reason, query, key, value, attention_mask, scaling, dropout, sliding_window,
                        softcap, kwargs):  # fmt: skip
    """Run the call through the model's original attention if that was SDPA, else (and where the attention
    weights are asked for, or for a softcap) the module's eager attention, with the equivalent 4-D mask; one
    warning per reason per process."""
    # SDPA where the model had it (it takes any 4-D mask), else eager: flash-attention and flex attention
    # take no such mask, and SDPA neither returns weights nor takes a softcap
    name = getattr(module, "_llm_speed_original", "sdpa")
    if kwargs.get("output_attentions", False) or softcap is not None or name != "sdpa":
        name = "eager"
    if name == "eager":
        function = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if function is None:
            raise ValueError(f"llm_speed attention cannot run this call ({reason}) and the module of "
                             f"{type(module).__name__} has no eager_attention_forward")  # fmt: skip
    else:
        function = AttentionInterface()["sdpa"]
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"llm_speed attention: {reason}; such calls run the model's original attention "
                      f"({name}) instead", UserWarning, stacklevel=3)  # fmt: skip
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    mask = attention_mask
    if mask is None or mask.dim() == 2:
        left = None if sliding_window is None else sliding_window - 1
        mask = _dense_mask(mask, batch, q_len, kv_len, left, query.device)
    if name == "eager" and mask.dtype == torch.bool:  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min
        )  # (a where of Python floats would make a float32 mask: float64's min overflows it)
    options = {} if softcap is None else {"softcap": softcap}
    return function(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                    sliding_window=sliding_window, **options, **kwargs)  # fmt: skip


def _static_cache_attention(query, key, value, mask, options):
    """Queries over a static cache under torch.compile, with no host read: the queries' position and each
    row's first real key come from the 4-D mask on the device, and
    :func:`llm_speed.flash_attention_with_kvcache` attends over the keys from that first one up to each query
    (zeros at padded queries). The mask is not checked element by element here (that needs the host); a row
    whose real keys up to the last query are not one run (a pad after its first real key: a right-padded
    prompt) gets NaN outputs, as the decode kernel marks invalid rows, not a result over the pads."""
    batch, _, q_len, _ = query.shape
    kv_len = key.shape[2]
    visible = (mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0).expand(batch, q_len, kv_len)
    offset = _query_offset(visible).clamp(min=0)
    key_valid = visible.any(1)
    first = key_valid.to(torch.int8).argmax(1).to(torch.int32)
    used = (offset + q_len).to(torch.int32).expand(batch).contiguous()
    positions = (offset + torch.arange(q_len, device=query.device)).clamp(max=kv_len - 1)
    query_valid = key_valid.gather(1, positions.expand(batch, q_len))
    out = flash_attention_with_kvcache(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), cache_seqlens=used,
        cache_leftpad=first, is_causal=True, scale=options["scale"], window=options["window"],
        softcap=options["softcap"],
    )  # fmt: skip
    slots = torch.arange(kv_len, device=query.device)
    inside = (slots >= first[:, None]) & (slots < used[:, None])
    one_run = (key_valid | ~inside).all(1)
    out = torch.where(query_valid[:, :, None, None], out, 0)
    return torch.where(one_run[:, None, None, None], out, float("nan"))


_NOT_PASSED = object()


def _layer_window(module, sliding_window):
    """The layer's sliding window: as passed, else (a layer that leaves it to the mask, as Qwen2-MoE's) the
    attention module's own ``sliding_window``. :func:`llm_speed_mask` builds no windowed mask, so a window
    the attention is not told of would be lost."""
    if sliding_window is _NOT_PASSED:
        return getattr(module, "sliding_window", None)
    return sliding_window


def llm_speed_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=_NOT_PASSED,
    softcap=None, **kwargs,
):  # fmt: skip
    """transformers' attention-function signature over llm-speed's causal FlashAttention.

    query ``[batch, heads, q_len, head_dim]``, key/value ``[batch, kv_heads, kv_len, head_dim]`` (value's
    head_dim may differ: MLA's narrower values are padded with zeros, the output cropped, as transformers'
    flash-attention path does); returns ``([batch, q_len, heads, v_head_dim], None)``. GQA, the model's
    ``scaling``, a ``sliding_window`` of W tokens (``window=(W - 1, 0)``; not passed: the module's own
    ``sliding_window`` attribute, if any) and attention logit ``softcap`` are passed on. No mask, or a plain
    causal one: :func:`llm_speed.flash_attention`. A padding mask, or packed sequences: the real tokens are
    packed and run through :func:`llm_speed.flash_attention_varlen` (causal per sequence), and the output is
    scattered back with zeros at padded positions (as transformers' flash-attention-2 path). A static cache:
    the keys up to the last query (eager), or :func:`llm_speed.flash_attention_with_kvcache` over the cache
    (under torch.compile). ``output_attentions=True``, masks the kernels cannot compute and inputs of a dtype
    they do not take (float64) run the model's original attention, with one warning; ValueError for
    malformed masks, dropout and non-causal configs.
    """
    _check_inputs(query, key, value, attention_mask)
    sliding_window = _layer_window(module, sliding_window)
    if dropout:
        raise ValueError(f"llm_speed attention has no dropout; got attention dropout {dropout} (set it to 0)")
    if getattr(getattr(module, "config", None), "is_causal", True) is False:
        raise ValueError("llm_speed attention is causal only; this model's config has is_causal=False")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            "llm_speed attention does not take packed sequences as cu_seq_lens_q/cu_seq_lens_k; pass "
            "position_ids that restart at each sequence, or a padded batch with an attention_mask"
        )
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):  # fmt: skip
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    original = (module, query, key, value, attention_mask, scaling, dropout, sliding_window, softcap, kwargs)
    if kwargs.get("output_attentions", False):
        return _original_attention(module, "output_attentions=True asks for the attention weights, which the "
                                   "kernels never form", *original[1:])  # fmt: skip
    device_type = query.device.type
    if not (query.dtype == key.dtype == value.dtype) and torch.is_autocast_enabled(device_type):
        # under autocast, as SDPA: q, k, v in the autocast dtype (Qwen3's and OLMo-2's q/k norms give float32
        # q and k beside a bf16 v); the op's own autocast rule casts only after its dtype checks
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) if t.dtype in FLOAT_DTYPES else t for t in (query, key, value))
    if query.dtype not in FLOAT_DTYPES:
        return _original_attention(module, f"{query.dtype} inputs, which the kernels do not take (float16, "
                                   "bfloat16, float32)", *original[1:])  # fmt: skip
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"llm_speed attention needs q_len <= kv_len, got {q_len} queries and {kv_len} keys")
    keys, unpadded = kv_len, None
    compiled_cache = (
        attention_mask is not None and attention_mask.dim() == 4 and q_len != kv_len
        and torch.compiler.is_compiling()
    )  # fmt: skip
    if attention_mask is not None and not compiled_cache:
        plan = _unpadding(attention_mask, batch, q_len, kv_len, None if window is None else window[0])
        if isinstance(plan, _Inexpressible):
            return _original_attention(module, str(plan), *original[1:])
        keys, unpadded = plan
    v_head_dim = value.shape[-1]
    if v_head_dim != head_dim:  # MLA (DeepSeek): zeros pad the narrower side (no score or output changes)
        scaling = head_dim**-0.5 if scaling is None else scaling
        if v_head_dim < head_dim:
            value = nn.functional.pad(value, (0, head_dim - v_head_dim))
        else:
            query, key = (nn.functional.pad(t, (0, v_head_dim - head_dim)) for t in (query, key))
    options = dict(scale=scaling, window=window, softcap=softcap)
    if compiled_cache:
        return _static_cache_attention(query, key, value, attention_mask, options)[..., :v_head_dim], None
    if keys < kv_len:  # a static cache's empty slots
        key, value = key[:, :, :keys], value[:, :, :keys]
    if unpadded is None:
        out = flash_attention(query, key, value, is_causal=True, **options)
        return out.transpose(1, 2)[..., :v_head_dim], None
    u = unpadded
    q = query.transpose(1, 2)[u.q_batch, u.q_pos]  # [real queries, heads, head_dim]
    k, v = (t.transpose(1, 2)[u.k_batch, u.k_pos] for t in (key, value))
    packed = flash_attention_varlen(q, k, v, u.cu_q, u.cu_k, u.max_q, u.max_k, is_causal=True, **options)
    out = packed.new_zeros(batch, q_len, heads, packed.shape[-1]).index_put((u.q_batch, u.q_pos), packed)
    return out[..., :v_head_dim], None


def llm_speed_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
    attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs,
):  # fmt: skip
    """The mask function registered for ``"llm_speed"`` (transformers' ``AttentionMaskInterface``).

    When the caller allows replacing the mask by ``is_causal`` (plain causal, a sliding window no shorter
    than the keys, or the config's sliding window, which the layers apply) and the queries are the last keys
    (no cache, or a dynamic one: ``q_offset + q_length == kv_offset + kv_length``): ``None`` without padding,
    else the 2-D bool padding mask ``[batch, kv_length]`` (no ``[batch, 1, q, kv]`` mask is built). Otherwise
    (a static cache, whose ``q_offset`` is a tensor and whose empty slots follow the queries; packed
    sequences; custom mask functions) transformers' 4-D SDPA mask, which :func:`llm_speed_attention` reads
    once per forward.
    """
    # A sliding window of the model's config: the layers pass it to the attention, which applies it (as
    # transformers' flash-attention-2 mask does), so the [batch, 1, q, kv] mask need not be built either.
    # (local_size is also a chunk size for chunked attention, which is not a window.)
    config = kwargs.get("config")
    sliding = (
        local_size is not None and getattr(config, "sliding_window", None) == local_size
        and getattr(config, "attention_chunk_size", None) is None
    )  # fmt: skip
    structure_is_causal = (
        allow_is_causal_skip and isinstance(q_offset, int) and q_offset + q_length == kv_offset + kv_length
        and (local_size is None or kv_length < local_size or sliding)
    )  # fmt: skip
    if structure_is_causal:
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        padding = padding[:, kv_offset : kv_offset + kv_length]
        return None if bool(padding.all()) else padding
    return sdpa_mask(
        batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset, kv_offset=kv_offset,
        mask_function=mask_function, attention_mask=attention_mask, local_size=local_size,
        allow_is_causal_skip=False, **kwargs,
    )  # fmt: skip


if transformers is not None:
    AttentionInterface.register(ATTENTION_NAME, llm_speed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, llm_speed_mask)


# --- rotary: the family's functions, fused while a patched attention module runs -------------------------

_state = threading.local()  # .active: patched attention modules running in this thread


def _active() -> bool:
    return getattr(_state, "active", 0) > 0


def _rotary_wrapper(original, interleaved: bool):
    parameters = inspect.signature(original).parameters

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if _active():
            bound = dict(zip(list(parameters)[4:], args, strict=False), **kwargs)
            unsqueeze_dim = bound.get("unsqueeze_dim", 1)
            if (
                q.dtype in FLOAT_DTYPES and k.dtype == q.dtype and cos.dtype in FLOAT_DTYPES
                and q.dim() == 4 and k.dim() == 4 and cos.dim() in (2, 3) and unsqueeze_dim in (1, 2)
                and cos.shape[-1] % 2 == 0 and cos.shape[-1] <= q.shape[-1]
            ):  # fmt: skip
                return apply_rotary_qk(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb._llm_speed_original = original
    return apply_rotary_pos_emb


def _patch_rotary(modeling, names: tuple[str, ...]) -> None:
    for name in names:
        current = getattr(modeling, name)
        if not hasattr(current, "_llm_speed_original"):
            setattr(modeling, name, _rotary_wrapper(current, interleaved="interleave" in name))


def _track(module: nn.Module) -> None:
    """Count ``module``'s forwards in progress (recomputations under gradient checkpointing included)."""

    def enter(_module, _args):
        _state.active = getattr(_state, "active", 0) + 1

    def leave(_module, _args, _output):
        _state.active -= 1

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)  # also when the forward raises


# --- norms and MLPs: llm_speed.nn modules around the model's own parameters --------------------------------


def _children(model: nn.Module, module_name: str, suffix: str):
    """(parent, attribute, module) of every module of the family's module whose class name ends with
    ``suffix``."""
    found = []
    for parent in model.modules():
        for attribute, child in parent.named_children():
            if type(child).__module__ == module_name and type(child).__name__.endswith(suffix):
                found.append((parent, attribute, child))
    return found


def _swap_norms(model, family: Family) -> int:
    swapped = 0
    for parent, attribute, norm in _children(model, family.module, "RMSNorm"):
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
        weight = getattr(norm, "weight", None)
        offset = family.offset if weight is not None else 0.0
        replacement = RMSNorm.wrap(weight, eps, offset, casting=family.casting,
                                   in_place=attribute in family.in_place, fallback=norm)  # fmt: skip
        setattr(parent, attribute, replacement)
        swapped += 1
    return swapped


def _swap_mlps(model, family: Family, skipped: dict) -> int:
    act = getattr(model.config, family.activation, None) or getattr(model.config, "hidden_act", None)
    activation = ACTIVATIONS.get(act)
    swapped = 0
    for parent, attribute, mlp in _children(model, family.module, "MLP"):
        if activation is None:
            accepted = ", ".join(ACTIVATIONS)
            skipped["mlp"] = f"the MLP activation {act!r} has no fused kernel (accepted: {accepted})"
            return 0
        if hasattr(mlp, "gate_up_proj"):
            replacement = GatedMLP.wrap(mlp.down_proj, gate_up_proj=mlp.gate_up_proj, activation=activation,
                                        fallback=mlp)  # fmt: skip
        else:
            replacement = GatedMLP.wrap(mlp.down_proj, gate_proj=mlp.gate_proj, up_proj=mlp.up_proj,
                                        activation=activation, fallback=mlp)  # fmt: skip
        setattr(parent, attribute, replacement)
        swapped += 1
    return swapped


# --- the loss: fused linear cross-entropy, no logits built -------------------------------------------------

_NO_LOGITS = {}  # device -> an empty index tensor: logits_to_keep that keeps no position


def _keep_no_logits(device: torch.device) -> torch.Tensor:
    if device not in _NO_LOGITS:
        _NO_LOGITS[device] = torch.zeros(0, dtype=torch.long, device=device)
    return _NO_LOGITS[device]


def _capture_output(module: nn.Module, _args, output) -> None:
    """The base model's forward hook, registered once by apply: keeps its output for the fused loss's
    forward, only while that forward runs. (Registering a hook per call, as before, broke torch.compile's
    graph in two places and sent the loss's forward back to eager.)"""
    if module._llm_speed_capture:
        module._llm_speed_captured = output


def _keeps_every_logit(logits_to_keep) -> bool:
    """Whether transformers' ``logits_to_keep`` keeps every position (0, its default)."""
    return not torch.is_tensor(logits_to_keep) and logits_to_keep == 0


def _fused_loss_forward(self, *args, **kwargs):
    bound = self._llm_speed_signature.bind(self, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self")
    extra = arguments.pop("kwargs", {})
    labels = arguments.get("labels")
    keep_asked = extra.pop("logits_to_keep", arguments.pop("logits_to_keep", 0))
    # Without labels, with logits asked for beside the loss (logits_to_keep other than 0: transformers then
    # scores those positions only), or in a dtype the kernels do not take: the original forward.
    if (labels is None or not _keeps_every_logit(keep_asked)
            or self.lm_head.weight.dtype not in FLOAT_DTYPES):  # fmt: skip
        return self._llm_speed_original_forward(*args, **kwargs)
    return_dict = extra.pop("return_dict", arguments.pop("return_dict", None))
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    arguments["labels"] = None
    base_model = self.model
    base_model._llm_speed_capture = True
    try:
        device = self.lm_head.weight.device
        keep = _keep_no_logits(device)
        outputs = self._llm_speed_original_forward(
            **arguments, **extra, logits_to_keep=keep, return_dict=True
        )
        base = base_model._llm_speed_captured
    finally:
        base_model._llm_speed_capture = False
        base_model._llm_speed_captured = None
    hidden = base.last_hidden_state if isinstance(base, ModelOutput) else base[0]
    shift = extra.get("shift_labels")
    if shift is None:  # as transformers' ForCausalLMLoss: position t predicts label t + 1
        shift = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]
    num_items = extra.get("num_items_in_batch")
    hidden = hidden.reshape(-1, hidden.shape[-1])
    bias = self.lm_head.bias
    scaling = getattr(self.config, "logits_scaling", None)  # Granite: logits / logits_scaling
    if scaling not in (None, 1, 1.0):
        hidden = hidden / scaling
        bias = None if bias is None else bias / scaling
    loss = fused_linear_cross_entropy(
        hidden, self.lm_head.weight, shift.reshape(-1).to(hidden.device), bias=bias,
        reduction="mean" if num_items is None else "sum",
        softcap=getattr(self.config, "final_logit_softcapping", None),
        accum_dtype=self._llm_speed_accum_dtype,
    )  # fmt: skip
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    aux = outputs.get("aux_loss")
    if aux is not None:  # MoE: the router's load-balancing loss, as the original forward adds it
        loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
    fields = {name: value for name, value in outputs.items() if name not in ("loss", "logits")}
    result = type(outputs)(loss=loss, **fields)
    if return_dict:
        return result
    # transformers' tuple (to_tuple: the fields that are set, in order), with None where the logits were:
    # out[1] (out[2] beside an MoE's aux_loss) stays the logits' place
    names = [field.name for field in dataclasses.fields(result)]
    return tuple(result.get(name) for name in names if name in result or name == "logits")


# --- apply ------------------------------------------------------------------------------------------------


def apply(
    model,
    *,
    rms_norm: bool = True,
    mlp: bool = True,
    moe: bool = True,
    rotary: bool = True,
    attention: bool | None = None,
    cross_entropy: bool = True,
    cross_entropy_accum_dtype: torch.dtype | None = None,
) -> dict:
    """Patch ``model`` (a causal LM of one of :data:`SUPPORTED` families from transformers) in place; see the
    module docstring for what each switch swaps. Returns what was patched: ``{"model_type": str, "rms_norm":
    n modules, "mlp": n modules, "moe": n sparse MoE blocks, "rotary": bool, "attention": bool,
    "attention_replaced": the attn_implementation it replaced (None if attention was not patched),
    "cross_entropy": bool, "skipped": {part: reason}}``.

    ``attention``: None (default) replaces the model's attention unless it was built with
    ``attn_implementation="eager"`` where SDPA was available (transformers' default, so eager was asked for):
    then it is kept and ``skipped["attention"]`` says so; True replaces any; False none. The replaced
    implementation is what a call the kernels cannot compute (``output_attentions=True``, other masks) runs.

    Padded and packed batches run the varlen attention on their real tokens, with zeros at padded positions;
    a static cache its valid keys; ``output_attentions=True`` and masks the kernels cannot compute (custom
    patterns, biases) the replaced attention, with one warning (module docstring).

    ``cross_entropy`` needs a ``*ForCausalLM`` model (``lm_head`` and ``model``).
    ``cross_entropy_accum_dtype``: None (the weight's dtype) or ``torch.float32``, what the ``lm_head``
    weight's gradient is summed in over the loss's token chunks (the ``accum_dtype`` of
    :func:`llm_speed.fused_linear_cross_entropy`: a bfloat16 weight's gradient then rounds once instead of
    once per chunk); the report says it as ``"cross_entropy_accum_dtype"`` (``"float32"`` or None). Calling
    apply twice returns the first report and patches nothing more. ValueError for other model types;
    ImportError without transformers.
    """
    _require_transformers()
    switches = dict(rms_norm=rms_norm, mlp=mlp, moe=moe, rotary=rotary, attention=attention,
                    cross_entropy=cross_entropy)  # fmt: skip
    for name, value in switches.items():
        if name == "attention" and value is None:
            continue
        try:
            switches[name] = check_flag(name, value)
        except TypeError as error:
            if name != "attention":
                raise
            raise TypeError(str(error).replace("must be", "must be None (the default) or", 1)) from None
    rms_norm, mlp, moe, rotary, attention, cross_entropy = switches.values()
    check_accum_dtype("cross_entropy_accum_dtype", cross_entropy_accum_dtype)
    if cross_entropy_accum_dtype is not None and not cross_entropy:
        raise ValueError("cross_entropy_accum_dtype needs cross_entropy=True (it is the fused loss's option)")
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        kind = type(model).__name__
        raise TypeError(f"model must be a transformers model (an nn.Module with .config), got {kind}")
    if getattr(model, "_llm_speed_report", None) is not None:
        return model._llm_speed_report
    model_type = getattr(model.config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"model_type {model_type!r} is not supported; accepted: {', '.join(SUPPORTED)}")
    family = FAMILIES[model_type]
    modeling = importlib.import_module(family.module)
    skipped: dict[str, str] = {}
    report = {"model_type": model_type, "rms_norm": 0, "mlp": 0, "moe": 0, "rotary": False,
              "attention": False, "attention_replaced": None, "cross_entropy": False,
              "cross_entropy_accum_dtype": None, "skipped": skipped}  # fmt: skip
    if rms_norm:
        report["rms_norm"] = _swap_norms(model, family)
    if moe and family.moe:  # before the MLPs: the shared experts then become GatedMLPs like any MLP
        report["moe"] = len(patch_moe_blocks(model))
    if mlp:
        report["mlp"] = _swap_mlps(model, family, skipped)
    if rotary:
        _patch_rotary(modeling, family.rotary)
        for _parent, _attribute, module in _children(model, family.module, "Attention"):
            _track(module)
        report["rotary"] = True
    current = model.config._attn_implementation
    # transformers' default is SDPA, eager only for models without it (Gemma-2): eager beside SDPA was asked
    if attention is None and current == "eager" and getattr(model, "_supports_sdpa", False):
        skipped["attention"] = ("the model was built with attn_implementation='eager'; apply(model, "
                                "attention=True) replaces it")  # fmt: skip
    elif attention is not False:
        reason = _attention_unsupported(model.config)
        if reason:
            skipped["attention"] = reason
        else:
            if current != ATTENTION_NAME:  # what the calls the kernels cannot compute run instead
                for _parent, _attribute, module in _children(model, family.module, "Attention"):
                    module._llm_speed_original = current
            model.set_attn_implementation(ATTENTION_NAME)
            report["attention"] = True
            report["attention_replaced"] = current
    if cross_entropy:
        if hasattr(model, "lm_head") and hasattr(model, "model"):
            model._llm_speed_accum_dtype = cross_entropy_accum_dtype
            replace_forward(model, _fused_loss_forward)
            model.model._llm_speed_capture = False
            model.model._llm_speed_captured = None
            model.model.register_forward_hook(_capture_output)
            report["cross_entropy"] = True
            if cross_entropy_accum_dtype is not None:
                report["cross_entropy_accum_dtype"] = "float32"
        else:
            skipped["cross_entropy"] = f"{type(model).__name__} has no lm_head (not a *ForCausalLM model)"
    model._llm_speed_report = report
    return report


def _attention_unsupported(config) -> str | None:
    head_dim = (getattr(config, "qk_head_dim", None) or getattr(config, "head_dim", None)
                or config.hidden_size // config.num_attention_heads)  # fmt: skip
    head_dim = max(head_dim, getattr(config, "v_head_dim", None) or 0)
    if not 1 <= head_dim <= 256:
        return f"head_dim {head_dim} is outside 1..256"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (use_bidirectional_attention) is not causal"
    return None
