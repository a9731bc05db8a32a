"""Patch a Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Gemma-2) onto llm-speed kernels.

``apply(model)`` swaps, on that model only:

- every RMSNorm's forward for :func:`llm_speed.rms_norm` (Gemma-2: ``offset=1.0``);
- every SwiGLU MLP's activation for :func:`llm_speed.swiglu` (Llama, Mistral, Qwen2; Gemma-2's MLP is GeGLU
  and stays);
- the rotary embedding for :func:`llm_speed.apply_rotary` (the model family's module-level
  ``apply_rotary_pos_emb`` is wrapped, and the wrapper takes the fused path only while a patched model runs
  its forward, so unpatched models of the same family are unaffected);
- attention, registered as ``"llm_speed"`` with transformers' ``AttentionInterface`` (so
  ``from_pretrained(..., attn_implementation="llm_speed")`` works once this module is imported) and with
  ``AttentionMaskInterface``. Batches without padding run :func:`llm_speed.flash_attention`; padded batches
  (``attention_mask`` with zeros) run :func:`llm_speed.flash_attention_varlen` on the real tokens only, with
  zeros at padded positions. Both are causal with the model's scaling, GQA, sliding window (Mistral, Gemma-2's
  local layers) and attention logit softcap (Gemma-2);
- the loss: with ``labels``, the model returns ``fused_linear_cross_entropy`` of the last hidden states and
  ``lm_head`` (shifted labels, ignore_index -100, mean over tokens or sum / ``num_items_in_batch`` as
  transformers' ``ForCausalLMLoss``; Gemma-2's final logit softcap included) and ``logits=None``: the
  ``[tokens, vocab]`` logits are never built. Without labels the forward is unchanged.

Padding: left, right (or inner, without a sliding window spanning it) padding of any lengths. The mask
function registered for ``"llm_speed"`` hands the attention the 2-D padding mask when transformers would use
``is_causal`` (plain causal, or a window no shorter than the keys), so no ``[batch, 1, q, kv]`` mask is built;
otherwise transformers' 4-D SDPA mask, which is checked element by element against causal (and windowed)
attention over each row's real tokens. Either way the real tokens are found once per forward per mask (a few
small host syncs), not per layer. Query i is taken as the token of key ``kv_len - q_len + i`` (no cache, or a
dynamic cache in generation); a token whose own key no query sees is a padded one. Attention outputs zeros at
padded positions, as transformers' flash-attention-2 path does (eager attention computes other values there):
a label predicted from a padded position (a left-padded row's first real token) is trained on a different
hidden state, so set such labels to -100.

Refused with a ValueError naming what is accepted, never silently changed: masks that are neither causal
nor padding (packed sequences in one row, custom or bidirectional patterns, additive biases), padded
queries after a cache (a static cache's empty slots), packed ``cu_seq_lens_*`` arguments, attention dropout
in training, and non-causal configs. Inputs in dtypes the kernels do not take (float64) run the model's
original code.
"""

from __future__ import annotations

import importlib
import types

import torch
from torch import nn

from ..attention import flash_attention, flash_attention_varlen
from ..core.tensors import FLOAT_DTYPES
from ..fused.cross_entropy import fused_linear_cross_entropy
from ..fused.rms_norm import rms_norm as fused_rms_norm
from ..fused.rotary import apply_rotary
from ..fused.swiglu import swiglu as fused_swiglu

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # the package imports without the optional extra; apply() says what is missing
    transformers = None
    causal_mask_function = None

ATTENTION_NAME = "llm_speed"
SUPPORTED = {  # model_type: (modeling module, RMSNorm offset, SwiGLU MLP)
    "llama": ("transformers.models.llama.modeling_llama", 0.0, True),
    "mistral": ("transformers.models.mistral.modeling_mistral", 0.0, True),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", 0.0, True),
    "gemma2": ("transformers.models.gemma2.modeling_gemma2", 1.0, False),
}

_running = [0]  # patched model forwards in progress (the rotary wrapper takes the fused path only then)


def _require_transformers():
    if transformers is None:
        raise ImportError("llm_speed.integrations.transformers needs transformers: pip install llm-speed[hf]")


ACCEPTED_MASKS = (
    "None, a 2-D padding mask [batch, kv_len] of 0/1, or a 4-D [batch, 1, q_len, kv_len] mask (bool, or "
    "additive with 0 and large negative values) that is causal, with the layer's sliding window if any, "
    "restricted to the real tokens of a padding mask"
)


class _Unpadded:
    """Where the real tokens of a padded batch are: computed once per mask, reused by the layers."""

    def __init__(self, key_valid: torch.Tensor, q_len: int):
        query_valid = key_valid[:, key_valid.shape[1] - q_len :]  # query i is key kv_len - q_len + i
        lengths = torch.stack([query_valid.sum(1), key_valid.sum(1)])  # [2, batch]
        cu = nn.functional.pad(lengths.cumsum(1), (1, 0)).to(torch.int32)
        self.cu_q, self.cu_k = cu[0], cu[1]
        self.q_batch, self.q_pos = query_valid.nonzero(as_tuple=True)  # host syncs (nonzero's size)
        self.k_batch, self.k_pos = key_valid.nonzero(as_tuple=True)
        self.max_q, self.max_k = lengths.max(1).values.tolist()


def _refuse_mask(reason: str):
    raise ValueError(
        f"llm_speed attention got an attention_mask it cannot compute ({reason}); accepted: "
        f"{ACCEPTED_MASKS}. Use attn_implementation 'sdpa' for other masks"
    )


def _classify_mask(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, left: int | None):
    """None for a plain causal (windowed) mask; the unpadding of a padding mask; ValueError otherwise.

    Query i is the token of key ``kv_len - q_len + i`` (transformers' masks with no cache or a dynamic
    cache). A 4-D mask is checked element by element against what the varlen kernel computes: causal and
    windowed by each token's rank among the real tokens of its row, so left, right and inner padding all
    work while the window does not span a pad.
    """
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, kv_len):
            _refuse_mask(f"2-D mask of shape {tuple(mask.shape)}, expected [{batch}, {kv_len}]")
        if mask.dtype == torch.bool:
            key_valid = mask
        else:
            key_valid = mask != 0
            if not bool(((mask == 0) | (mask == 1)).all()):
                _refuse_mask("a 2-D mask with values other than 0 and 1")
        checks = [key_valid.all(), key_valid[:, kv_len - q_len :].all()]
    elif mask.dim() == 4:
        if mask.shape[0] not in (1, batch) or tuple(mask.shape[1:]) != (1, q_len, kv_len):
            _refuse_mask(f"4-D mask of shape {tuple(mask.shape)}, expected [{batch}, 1, {q_len}, {kv_len}]")
        visible = mask[:, 0] if mask.dtype == torch.bool else mask[:, 0] == 0
        visible = visible.expand(batch, q_len, kv_len)
        key_valid = visible.any(1)  # a real key is visible at least to its own query
        query_valid = key_valid[:, kv_len - q_len :]
        rank = key_valid.cumsum(1) - 1  # position of each real key among its row's real tokens
        rank_q, rank_k = rank[:, kv_len - q_len :, None], rank[:, None, :]
        expected = key_valid[:, None, :] & (rank_k <= rank_q)
        if left is not None:
            expected &= rank_k >= rank_q - left
        agrees = (visible == expected) | ~query_valid[:, :, None]  # rows of padding tokens output zeros
        checks = [key_valid.all(), query_valid.all(), agrees.all()]
        if mask.dtype != torch.bool:
            checks.append(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all())
    else:
        _refuse_mask(f"a {mask.dim()}-D mask")
    all_real, queries_real, *ok = torch.stack(checks).tolist()  # one host sync for every check
    if len(ok) > 1 and not ok[1]:
        _refuse_mask("an additive mask with values other than 0 and large negative ones (a bias)")
    if ok and not ok[0]:
        _refuse_mask("not causal: packed sequences, a custom pattern, or a window that spans a pad")
    if all_real:
        return None
    if q_len != kv_len and not queries_real:
        _refuse_mask("padding among the queries after a cache, as a static cache's empty slots give")
    return _Unpadded(key_valid, q_len)


def _unpadding(mask: torch.Tensor, batch: int, q_len: int, kv_len: int, left: int | None) -> _Unpadded | None:
    """:func:`_classify_mask`, cached on the mask tensor: transformers passes one mask object to every layer
    of a forward, so the check and its host syncs happen once per forward (per mask kind), not per layer."""
    cache = getattr(mask, "_llm_speed_unpadding", None)
    if cache is None:
        cache = mask._llm_speed_unpadding = {}
    key = (batch, q_len, kv_len, left)
    if key not in cache:
        cache[key] = _classify_mask(mask, batch, q_len, kv_len, left)
    return cache[key]


def llm_speed_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, softcap=None,
    **kwargs,
):  # fmt: skip
    """transformers' attention-function signature over llm-speed's causal FlashAttention.

    query ``[batch, heads, q_len, head_dim]``, key/value ``[batch, kv_heads, kv_len, head_dim]``; returns
    ``([batch, q_len, heads, head_dim], None)``. GQA, the model's ``scaling``, a ``sliding_window`` of W
    tokens (``window=(W - 1, 0)``) and attention logit ``softcap`` are passed on. No mask, or a plain causal
    one: :func:`llm_speed.flash_attention`. A padding mask: the real tokens are packed and run through
    :func:`llm_speed.flash_attention_varlen` (causal per sequence), and the output is scattered back with
    zeros at padded positions (as transformers' flash-attention-2 path). ValueError for other masks, dropout
    and non-causal configs rather than a different result.
    """
    if dropout:
        raise ValueError(f"llm_speed attention has no dropout; got attention dropout {dropout} (set it to 0)")
    if getattr(getattr(module, "config", None), "is_causal", True) is False:
        raise ValueError("llm_speed attention is causal only; this model's config has is_causal=False")
    if kwargs.get("cu_seq_lens_q") is not None or kwargs.get("cu_seq_lens_k") is not None:
        raise ValueError(
            "llm_speed attention does not take packed sequences (cu_seq_lens_q/cu_seq_lens_k); pass padded "
            "batches with an attention_mask"
        )
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):  # fmt: skip
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    window = None if sliding_window is None else (sliding_window - 1, 0)
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    if q_len > kv_len:
        raise ValueError(f"llm_speed attention needs q_len <= kv_len, got {q_len} queries and {kv_len} keys")
    unpadded = None
    options = dict(is_causal=True, scale=scaling, window=window, softcap=softcap)
    if attention_mask is not None:
        unpadded = _unpadding(attention_mask, batch, q_len, kv_len, None if window is None else window[0])
    if unpadded is None:
        out = flash_attention(query, key, value, **options)
        return out.transpose(1, 2), None
    u = unpadded
    q = query.transpose(1, 2)[u.q_batch, u.q_pos]  # [real queries, heads, head_dim]
    k, v = (t.transpose(1, 2)[u.k_batch, u.k_pos] for t in (key, value))
    packed = flash_attention_varlen(q, k, v, u.cu_q, u.cu_k, u.max_q, u.max_k, **options)
    out = packed.new_zeros(batch, q_len, heads, head_dim).index_put((u.q_batch, u.q_pos), packed)
    return out, None


def llm_speed_mask(
    batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=causal_mask_function,
    attention_mask=None, local_size=None, allow_is_causal_skip=True, **kwargs,
):  # fmt: skip
    """The mask function registered for ``"llm_speed"`` (transformers' ``AttentionMaskInterface``).

    When the caller allows replacing the mask by ``is_causal`` (plain causal, or a sliding window no shorter
    than the keys) and queries and keys line up (``q_length`` 1 or ``kv_length``): ``None`` without padding,
    else the 2-D bool padding mask ``[batch, kv_length]`` (no ``[batch, 1, q, kv]`` mask is built). Otherwise
    transformers' 4-D SDPA mask, which :func:`llm_speed_attention` checks once per forward.
    """
    structure_is_causal = (
        allow_is_causal_skip and q_length in (1, kv_length) and (local_size is None or kv_length < local_size)
    )
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


def _fused_rms_norm_forward(offset):
    def forward(self, x):
        if x.dtype not in FLOAT_DTYPES:
            return self._llm_speed_original_forward(x)
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", 1e-6))
        return fused_rms_norm(x, self.weight, eps=eps, offset=offset)

    return forward


def _swiglu_mlp_forward(self, x):
    if x.dtype not in FLOAT_DTYPES:
        return self._llm_speed_original_forward(x)
    return self.down_proj(fused_swiglu(self.gate_proj(x), self.up_proj(x)))


def _rotary_wrapper(original):
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        fused = (
            _running[0] > 0
            and unsqueeze_dim == 1
            and q.dtype in FLOAT_DTYPES
            and k.dtype == q.dtype
            and cos.dim() in (2, 3)
            and cos.shape[-1] % 2 == 0
        )
        if not fused:
            return original(q, k, cos, sin, unsqueeze_dim)
        # transformers' cos/sin are cat(freqs, freqs): the first half holds one value per rotated pair
        half = cos.shape[-1] // 2
        c, s = cos[..., :half], sin[..., :half]
        return apply_rotary(q, c, s), apply_rotary(k, c, s)

    apply_rotary_pos_emb._llm_speed_original = original
    return apply_rotary_pos_emb


def _patch_rotary(modeling) -> None:
    current = modeling.apply_rotary_pos_emb
    if not hasattr(current, "_llm_speed_original"):
        modeling.apply_rotary_pos_emb = _rotary_wrapper(current)


def _fused_loss_forward(
    self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
    inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0, **kwargs,
):  # fmt: skip
    if labels is None:
        return self._llm_speed_original_forward(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            logits_to_keep=logits_to_keep, **kwargs,
        )  # fmt: skip
    num_items = kwargs.pop("num_items_in_batch", None)
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs,
    )  # fmt: skip
    hidden = outputs.last_hidden_state
    # as transformers' ForCausalLMLoss: position t predicts label t + 1; the last position predicts nothing
    shift = nn.functional.pad(labels, (0, 1), value=-100)[..., 1:].reshape(-1).to(hidden.device)
    loss = fused_linear_cross_entropy(
        hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight, shift, bias=self.lm_head.bias,
        reduction="mean" if num_items is None else "sum",
        softcap=getattr(self.config, "final_logit_softcapping", None),
    )  # fmt: skip
    if num_items is not None:
        loss = loss / num_items
    return CausalLMOutputWithPast(
        loss=loss, logits=None, past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states, attentions=outputs.attentions,
    )  # fmt: skip


def _replace_forward(module: nn.Module, forward) -> None:
    module._llm_speed_original_forward = module.forward
    module.forward = types.MethodType(forward, module)


def _track_running(model: nn.Module) -> None:
    def enter(_module, _args):
        _running[0] += 1

    def leave(_module, _args, _output):
        _running[0] -= 1

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)  # also when the forward raises


def apply(
    model,
    *,
    rms_norm: bool = True,
    swiglu: bool = True,
    rotary: bool = True,
    attention: bool = True,
    cross_entropy: bool = True,
) -> dict:
    """Patch ``model`` (a Llama, Mistral, Qwen2 or Gemma-2 model from transformers) in place; see the module
    docstring for what each switch swaps. Returns what was patched: ``{"rms_norm": n modules, "swiglu": n
    modules, "rotary": bool, "attention": bool, "cross_entropy": bool, "skipped": {part: reason}}``.

    Padded batches (an ``attention_mask`` with zeros, left or right padding) run the varlen attention on their
    real tokens, with zeros at padded positions; masks that are neither causal nor padding (packed
    sequences, custom patterns, biases) raise a ValueError naming what is accepted (module docstring).

    ``cross_entropy`` needs a ``*ForCausalLM`` model (``lm_head`` and ``model``). Calling apply twice returns
    the first report and patches nothing more. ValueError for other model types; ImportError without
    transformers.
    """
    _require_transformers()
    switches = dict(rms_norm=rms_norm, swiglu=swiglu, rotary=rotary, attention=attention)
    for name, value in {**switches, "cross_entropy": cross_entropy}.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        kind = type(model).__name__
        raise TypeError(f"model must be a transformers model (an nn.Module with .config), got {kind}")
    if getattr(model, "_llm_speed_report", None) is not None:
        return model._llm_speed_report
    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ValueError(f"model_type {model_type!r} is not supported; accepted: {', '.join(SUPPORTED)}")
    module_name, offset, has_swiglu = SUPPORTED[model_type]
    modeling = importlib.import_module(module_name)
    skipped: dict[str, str] = {}
    report = {"rms_norm": 0, "swiglu": 0, "rotary": False, "attention": False, "cross_entropy": False}
    report["skipped"] = skipped
    for module in model.modules():
        name = type(module).__name__
        if rms_norm and name.endswith("RMSNorm") and type(module).__module__ == module_name:
            _replace_forward(module, _fused_rms_norm_forward(offset))
            report["rms_norm"] += 1
        elif swiglu and name.endswith("MLP") and type(module).__module__ == module_name:
            if has_swiglu and getattr(model.config, "hidden_act", None) == "silu":
                _replace_forward(module, _swiglu_mlp_forward)
                report["swiglu"] += 1
            else:
                skipped["swiglu"] = f"{model_type}'s MLP activation is not SiLU (SwiGLU)"
    if rotary:
        _patch_rotary(modeling)
        report["rotary"] = True
    if attention:
        reason = _attention_unsupported(model.config)
        if reason:
            skipped["attention"] = reason
        else:
            model.set_attn_implementation(ATTENTION_NAME)
            report["attention"] = True
    if cross_entropy:
        if hasattr(model, "lm_head") and hasattr(model, "model"):
            _replace_forward(model, _fused_loss_forward)
            report["cross_entropy"] = True
        else:
            skipped["cross_entropy"] = f"{type(model).__name__} has no lm_head (not a *ForCausalLM model)"
    _track_running(model)
    model._llm_speed_report = report
    return report


def _attention_unsupported(config) -> str | None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a multiple of 8 from 8 to 256"
    return None
