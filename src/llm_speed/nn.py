"""``torch.nn`` modules built on the fused ops: drop-in RMSNorm and SwiGLU MLP layers.

Parameter names follow Hugging Face's Llama (``weight``; ``gate_proj``, ``up_proj``, ``down_proj``), so a
state dict moves between them unchanged.
"""

from __future__ import annotations

import torch
from torch import nn

from .core.args import check_flag, check_real, positive_int
from .fused.rms_norm import rms_norm
from .fused.swiglu import swiglu


class RMSNorm(nn.Module):
    """RMSNorm over the last dim through :func:`llm_speed.rms_norm`: ``x * rsqrt(mean(x^2) + eps) * (offset +
    weight)``. ``offset=1.0`` is Gemma's convention; the weight starts at ``1 - offset`` so the initial scale
    is 1 either way."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0, *, device=None, dtype=None):
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.eps = check_real("eps", eps, minimum=0.0)
        self.offset = check_real("offset", offset)
        scale = torch.full((self.hidden_size,), 1.0 - self.offset, device=device, dtype=dtype)
        self.weight = nn.Parameter(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, eps=self.eps, offset=self.offset)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}"


class SwiGLUMLP(nn.Module):
    """The gated MLP of Llama, Mistral and Qwen2: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, with the
    activation and product fused into one kernel (:func:`llm_speed.swiglu`)."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, *, device=None, dtype=None
    ):
        super().__init__()
        hidden_size = positive_int("hidden_size", hidden_size)
        intermediate_size = positive_int("intermediate_size", intermediate_size)
        bias = check_flag("bias", bias)
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))
