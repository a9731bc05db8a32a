"""``torch.nn`` modules built on the fused ops: RMSNorm, gated MLPs (SwiGLU, GeGLU) and the losses.

Parameter names follow Hugging Face's (``weight``; ``gate_proj``, ``up_proj``, ``down_proj``, or Phi-3's
``gate_up_proj``), so a state dict moves between them unchanged; :mod:`llm_speed.integrations.transformers`
swaps a model's own modules for these, sharing their parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from .core.args import check_choice, check_flag, check_real, positive_int
from .fused.cross_entropy import cross_entropy, fused_linear_cross_entropy
from .fused.geglu import geglu
from .fused.rms_norm import CASTINGS, rms_norm
from .fused.swiglu import swiglu

INITS = ("ones", "zeros")
ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu}


class RMSNorm(nn.Module):
    """RMSNorm over the last dim through :func:`llm_speed.rms_norm`: ``x * rsqrt(mean(x^2) + eps) * (offset +
    weight)``.

    Args:
        hidden_size: the normalised (last) dim.
        eps, offset, casting, in_place: as :func:`llm_speed.rms_norm` (``casting="llama"`` reproduces Llama's
            module to the bit; ``offset=1.0`` is Gemma's convention).
        elementwise_affine: False for a norm without weight (OLMo's, T5's), as ``torch.nn.RMSNorm``.
        init: the weight's initial value, ``"ones"`` or ``"zeros"``; None (default) starts at scale 1 whatever
            the offset: ones with ``offset=0``, zeros with ``offset=1`` (Hugging Face's Gemma). Liger's
            ``LigerRMSNorm(h, offset=1.0)`` starts at ones (scale 2): pass ``init="ones"`` to keep that.
    """

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        offset: float = 0.0,
        *,
        elementwise_affine: bool = True,
        init: str | None = None,
        casting: str = "float32",
        in_place: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.eps = check_real("eps", eps, minimum=0.0)
        self.offset = check_real("offset", offset)
        self.casting = check_choice("casting", casting, CASTINGS)
        self.in_place = check_flag("in_place", in_place)
        if init is not None:
            check_choice("init", init, INITS)
        if check_flag("elementwise_affine", elementwise_affine):
            start = {"ones": 1.0, "zeros": 0.0, None: 1.0 - self.offset}[init]
            self.weight = nn.Parameter(torch.full((self.hidden_size,), start, device=device, dtype=dtype))
        else:
            if self.offset != 0.0:
                raise ValueError(f"offset ({self.offset}) scales a weight; elementwise_affine=False has none")
            self.register_parameter("weight", None)

    @classmethod
    def wrap(
        cls, weight: nn.Parameter | None, eps: float, offset: float = 0.0, *, casting: str = "float32",
        in_place: bool = False,
    ) -> RMSNorm:  # fmt: skip
        """A module around an existing ``weight`` (shared, not copied: an optimizer holding it keeps working),
        as :mod:`llm_speed.integrations.transformers` swaps a model's own norms."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.hidden_size = positive_int("hidden_size", weight.shape[0]) if weight is not None else 0
        module.eps = check_real("eps", eps, minimum=0.0)
        module.offset = check_real("offset", offset)
        module.casting = check_choice("casting", casting, CASTINGS)
        module.in_place = check_flag("in_place", in_place)
        module.weight = weight
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(
            x, self.weight, eps=self.eps, offset=self.offset, casting=self.casting, in_place=self.in_place
        )

    def extra_repr(self) -> str:
        extras = "" if self.casting == "float32" else f", casting={self.casting!r}"
        extras += ", in_place=True" if self.in_place else ""
        extras += ", elementwise_affine=False" if self.weight is None else ""
        return f"{self.hidden_size}, eps={self.eps}, offset={self.offset}{extras}"


class GatedMLP(nn.Module):
    """The gated MLP of Llama-style models, ``down_proj(act(gate_proj(x)) * up_proj(x))``, with ``act(gate) *
    up`` fused into one kernel: SwiGLU (``activation="silu"``, :func:`llm_speed.swiglu`) or GeGLU
    (``"gelu_tanh"``, :func:`llm_speed.geglu`, Gemma's). ``fused_gate_up=True``: one ``gate_up_proj`` of
    ``2 * intermediate_size`` outputs, gate first (Phi-3's layout)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        *,
        activation: str = "silu",
        fused_gate_up: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        hidden_size = positive_int("hidden_size", hidden_size)
        self.intermediate_size = positive_int("intermediate_size", intermediate_size)
        bias = check_flag("bias", bias)
        self.activation = check_choice("activation", activation, tuple(ACTIVATIONS))
        self.fused_gate_up = check_flag("fused_gate_up", fused_gate_up)
        kw = dict(bias=bias, device=device, dtype=dtype)
        if self.fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, self.intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, self.intermediate_size, **kw)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, **kw)

    @classmethod
    def wrap(
        cls, down_proj: nn.Linear, *, gate_proj: nn.Linear | None = None, up_proj: nn.Linear | None = None,
        gate_up_proj: nn.Linear | None = None, activation: str = "silu",
    ) -> GatedMLP:  # fmt: skip
        """A module around existing projections (shared, not copied), as
        :mod:`llm_speed.integrations.transformers` swaps a model's own MLPs: ``gate_proj`` and ``up_proj``, or
        Phi-3's ``gate_up_proj``."""
        module = GatedMLP.__new__(GatedMLP)
        nn.Module.__init__(module)
        module.activation = check_choice("activation", activation, tuple(ACTIVATIONS))
        module.fused_gate_up = gate_up_proj is not None
        if module.fused_gate_up:
            module.gate_up_proj = gate_up_proj
        else:
            module.gate_proj, module.up_proj = gate_proj, up_proj
        module.down_proj = down_proj
        module.intermediate_size = down_proj.in_features
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ACTIVATIONS[self.activation](gate, up))

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}" + (", fused_gate_up=True" if self.fused_gate_up else "")


class SwiGLUMLP(GatedMLP):
    """:class:`GatedMLP` with SiLU: the MLP of Llama, Mistral, Qwen, Phi-3, OLMo-2, Granite, DeepSeek."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, **kwargs):
        super().__init__(hidden_size, intermediate_size, bias, activation="silu", **kwargs)


class GeGLUMLP(GatedMLP):
    """:class:`GatedMLP` with GELU's tanh approximation: the MLP of Gemma 1, 2 and 3."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, **kwargs):
        super().__init__(hidden_size, intermediate_size, bias, activation="gelu_tanh", **kwargs)


class CrossEntropyLoss(nn.Module):
    """:func:`llm_speed.cross_entropy` as a module: ``loss(logits [N, V], target [N])``, the options fixed at
    construction (``weight`` is registered as a buffer)."""

    def __init__(self, weight: torch.Tensor | None = None, **options):
        super().__init__()
        self.register_buffer("weight", weight)
        self.options = options

    def forward(self, logits: torch.Tensor, target: torch.Tensor):
        return cross_entropy(logits, target, weight=self.weight, **self.options)


class FusedLinearCrossEntropyLoss(nn.Module):
    """:func:`llm_speed.fused_linear_cross_entropy` as a module: ``loss(hidden [N, H], weight [V, H], target
    [N], bias=None)`` (Liger's ``LigerFusedLinearCrossEntropyLoss`` takes ``(lin_weight, _input, target)``:
    weight first), the options fixed at construction (``ce_weight`` registered as a buffer)."""

    def __init__(self, ce_weight: torch.Tensor | None = None, **options):
        super().__init__()
        self.register_buffer("ce_weight", ce_weight)
        self.options = options

    def forward(self, hidden, weight, target, bias=None):
        return fused_linear_cross_entropy(hidden, weight, target, bias=bias, ce_weight=self.ce_weight,
                                          **self.options)  # fmt: skip
