"""Patch a Hugging Face ``transformers`` causal LM (Llama, Mistral, Qwen2, Gemma-2) onto llm-speed kernels.

``apply(model)`` swaps, on that model only:

- every RMSNorm's forward for :func:`llm_speed.rms_norm` (Gemma-2: ``offset=1.0``);
- every SwiGLU MLP's activation for :func:`llm_speed.swiglu` (Llama, Mistral, Qwen2; Gemma-2's MLP is GeGLU
  and stays);
- the rotary embedding for :func:`llm_speed.apply_rotary` (the model family's module-level
  ``apply_rotary_pos_emb`` is wrapped, and the wrapper takes the fused path only while a patched model runs
  its forward, so unpatched models of the same family are unaffected);
- attention for :func:`llm_speed.flash_attention`, registered as ``"llm_speed"`` with transformers'
  ``AttentionInterface`` (so ``from_pretrained(..., attn_implementation="llm_speed")`` works once this
  module is imported) and with ``AttentionMaskInterface`` (the SDPA mask: ``None`` for plain causal batches);
- the loss: with ``labels``, the model returns ``fused_linear_cross_entropy`` of the last hidden states and
  ``lm_head`` (shifted labels, ignore_index -100, mean over tokens or sum / ``num_items_in_batch`` as
  transformers' ``ForCausalLMLoss``; Gemma-2's final logit softcap included) and ``logits=None``: the
  ``[tokens, vocab]`` logits are never built. Without labels the forward is unchanged.

Attention that flash_attention cannot compute is refused with a ValueError, never silently changed: padding
masks (no varlen attention yet), sliding windows shorter than the sequence (the mask is then not causal),
attention dropout in training, and attention logit softcapping (Gemma-2 keeps its own attention; the report
says why). Inputs in dtypes the kernels do not take (float64) run the model's original code.
"""

from __future__ import annotations

import importlib
import types

import torch
from torch import nn

from ..attention import flash_attention
from ..fused._common import FLOAT_DTYPES
from ..fused.cross_entropy import fused_linear_cross_entropy
from ..fused.rms_norm import rms_norm as fused_rms_norm
from ..fused.rotary import apply_rotary
from ..fused.swiglu import swiglu as fused_swiglu

try:
    import transformers
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError:  # the package imports without the optional extra; apply() says what is missing
    transformers = None

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


def _is_causal_mask(mask: torch.Tensor, q_len: int, kv_len: int) -> bool:
    """True when a [batch, 1, q_len, kv_len] bool or additive mask is exactly bottom-right causal."""
    visible = mask if mask.dtype == torch.bool else mask == 0
    rows = torch.arange(q_len, device=mask.device)[:, None] + (kv_len - q_len)
    causal = torch.arange(kv_len, device=mask.device)[None, :] <= rows
    return bool((visible == causal).all())


def llm_speed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function signature over :func:`llm_speed.flash_attention` (causal, GQA).

    query ``[batch, heads, q_len, head_dim]``, key/value ``[batch, kv_heads, kv_len, head_dim]``; returns
    ``([batch, q_len, heads, head_dim], None)``. ValueError for what flash_attention cannot do (see the
    module docstring) rather than a different result.
    """
    if dropout:
        raise ValueError(f"llm_speed attention has no dropout; got attention dropout {dropout} (set it to 0)")
    if kwargs.get("softcap") is not None:
        raise ValueError("llm_speed attention has no attention logit softcapping")
    if attention_mask is not None and not _is_causal_mask(attention_mask, query.shape[2], key.shape[2]):
        raise ValueError(
            "llm_speed attention takes plain causal batches only: this mask has padding or a sliding window "
            "shorter than the sequence (no varlen attention yet); drop the padding or use "
            "attn_implementation 'sdpa'"
        )
    out = flash_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


if transformers is not None:
    AttentionInterface.register(ATTENTION_NAME, llm_speed_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


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
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "attention logit softcapping is not supported by llm_speed attention"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8 or not 8 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a multiple of 8 from 8 to 256"
    return None
