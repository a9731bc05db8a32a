"""Swap the sparse mixture-of-experts blocks of Hugging Face models onto llm-speed's fused MoE kernels.

:func:`patch_moe_blocks` patches, on one model only, every sparse MoE block of Mixtral
(``MixtralSparseMoeBlock``), Qwen2-MoE (``Qwen2MoeSparseMoeBlock``), Qwen3-MoE (``Qwen3MoeSparseMoeBlock``)
and DeepSeek-V3 (``DeepseekV3MoE``), keeping each block's own ``forward`` (input jitter, the shared experts
and their sigmoid gate, the reshapes) and replacing what it calls:

- the router's forward: the same ``F.linear`` router logits (so ``output_router_logits`` and the
  load-balancing aux loss, which transformers computes from them, are unchanged), then
  :func:`llm_speed.moe_route` with the model's semantics: softmax and renormalised top-k (Mixtral), softmax
  with ``norm_topk_prob`` and the weights cast to the logits' dtype (Qwen2/Qwen3-MoE), sigmoid scores with
  ``e_score_correction_bias``, grouped top-k (``n_group``, ``topk_group``: a group scores its two best
  biased scores), ``norm_topk_prob`` and ``routed_scaling_factor`` (DeepSeek-V3; its renormalisation's
  ``+ 1e-20`` is left out: the sum of k sigmoids is never that small). The router weight's gradient flows
  through the routing weights as in the original;
- the experts' forward: :func:`llm_speed.fused_moe` on the modules' own ``gate_up_proj [E, 2I, H]`` and
  ``down_proj [E, H, I]`` (the layout vLLM's fused MoE uses) instead of the loop over experts;
- the shared experts' MLP (Qwen2-MoE's ``shared_expert``, DeepSeek-V3's ``shared_experts``): its activation
  through :func:`llm_speed.swiglu`.

Each replaced forward falls back to the original where the kernels do not apply (float64 inputs, an
activation other than SiLU, weights in another dtype than the hidden states). Top-k ties go to the lower
expert id (``torch.topk`` leaves them unspecified). ``llm_speed.integrations.transformers.apply`` calls
this function for the models it patches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..core import autocast
from ..core.tensors import FLOAT_DTYPES
from ..fused.swiglu import swiglu
from ..moe.fused_moe import fused_moe
from ..moe.routing import moe_route
from .forwards import replace_forward

# block class -> (model_type, router kind, name of its shared-expert MLP or None)
BLOCKS = {
    "MixtralSparseMoeBlock": ("mixtral", "mixtral", None),
    "Qwen2MoeSparseMoeBlock": ("qwen2_moe", "qwen", "shared_expert"),
    "Qwen3MoeSparseMoeBlock": ("qwen3_moe", "qwen", None),
    "DeepseekV3MoE": ("deepseek_v3", "deepseek_v3", "shared_experts"),
}


def _fusable(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Float x and weights of its dtype; under autocast any float dtypes (the ops cast them as F.linear)."""
    if x.dtype not in FLOAT_DTYPES:
        return False
    if all(w.dtype == x.dtype for w in weights):
        return True
    return autocast.enabled(x.device.type) and all(w.dtype in FLOAT_DTYPES for w in weights)


def _mixtral_router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    if not _fusable(hidden_states, self.weight):
        return self._llm_speed_original_forward(hidden_states)
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = moe_route(router_logits, self.top_k, scoring="softmax", renormalize=True)
    return router_logits, weights, ids.long()


def _qwen_router_forward(self, hidden_states):
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    if not _fusable(hidden_states, self.weight):
        return self._llm_speed_original_forward(hidden_states)
    router_logits = F.linear(hidden_states, self.weight)
    weights, ids = moe_route(
        router_logits, self.top_k, scoring="softmax", renormalize=bool(self.norm_topk_prob)
    )
    return router_logits, weights.to(router_logits.dtype), ids.long()


def _deepseek_v3_router_forward(self, hidden_states):
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    if hidden_states.dtype not in FLOAT_DTYPES:
        return self._llm_speed_original_forward(hidden_states)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    grouped = self.num_group > 1
    weights, ids = moe_route(
        router_logits, self.top_k, scoring="sigmoid", renormalize=bool(self.norm_topk_prob),
        bias=self.e_score_correction_bias, n_group=self.num_group if grouped else None,
        topk_group=self.topk_group if grouped else None,
        routed_scaling_factor=float(self.routed_scaling_factor),
    )  # fmt: skip
    return router_logits, weights, ids.long()


ROUTERS = {"mixtral": _mixtral_router_forward, "qwen": _qwen_router_forward,
           "deepseek_v3": _deepseek_v3_router_forward}  # fmt: skip


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    if not _fusable(hidden_states, self.gate_up_proj, self.down_proj) or not self._llm_speed_silu:
        return self._llm_speed_original_forward(hidden_states, top_k_index, top_k_weights)
    return fused_moe(hidden_states, self.gate_up_proj, self.down_proj, top_k_weights, top_k_index)


def _shared_mlp_forward(self, x):
    if not _fusable(x, self.gate_proj.weight):
        return self._llm_speed_original_forward(x)
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def _is_silu(config) -> bool:
    return getattr(config, "hidden_act", None) in ("silu", "swish")


def _block_kind(module: nn.Module):
    entry = BLOCKS.get(type(module).__name__)
    if entry is None:
        return None
    model_type = entry[0]
    if type(module).__module__ != f"transformers.models.{model_type}.modeling_{model_type}":
        return None
    return entry


def patch_moe_blocks(model: nn.Module) -> list[str]:
    """Patch every sparse MoE block of ``model`` (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3) in place onto
    llm-speed's routing and fused-experts kernels (module docstring); returns the qualified names of the
    patched blocks (e.g. ``["model.layers.0.mlp", ...]``; empty for a model without such blocks). Calling it
    again patches nothing more and returns the same names. TypeError for a non-module."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")
    names = []
    for name, block in model.named_modules():
        entry = _block_kind(block)
        if entry is None:
            continue
        if getattr(block, "_llm_speed_moe", False):
            names.append(name)
            continue
        _, router, shared = entry
        experts, gate = block.experts, block.gate
        config = getattr(experts, "config", None) or getattr(block, "config", None)
        if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False):
            continue  # not the [E, 2I, H] / [E, H, I] layout without biases that fused_moe takes
        names.append(name)
        replace_forward(gate, ROUTERS[router])
        experts._llm_speed_silu = _is_silu(config) if config is not None else False
        replace_forward(experts, _experts_forward)
        mlp = getattr(block, shared, None) if shared else None
        if mlp is not None and _is_silu(getattr(mlp, "config", config)):
            replace_forward(mlp, _shared_mlp_forward)
        block._llm_speed_moe = True
    return names


__all__ = ["BLOCKS", "patch_moe_blocks"]
