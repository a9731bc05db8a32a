"""``torch.nn`` modules built on the fused ops: RMSNorm, gated MLPs (SwiGLU, GeGLU), the losses and
the mixture-of-experts layer.

Parameter names follow Hugging Face's (``weight``; ``gate_proj``, ``up_proj``, ``down_proj``, or Phi-3's
``gate_up_proj``), so a state dict moves between them unchanged; :mod:`llm_speed.integrations.transformers`
swaps a model's own modules for these, sharing their parameters.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .core.args import check_choice, check_flag, check_real, positive_int, type_name
from .core.tensors import FLOAT_DTYPES, dtype_names
from .fused.cross_entropy import check_loss_options, cross_entropy, fused_linear_cross_entropy
from .fused.geglu import geglu
from .fused.rms_norm import CASTINGS, rms_norm
from .fused.swiglu import swiglu

INITS = ("ones", "zeros")
ACTIVATIONS = {"silu": swiglu, "gelu_tanh": geglu}


def check_module_dtype(dtype) -> None:
    """A module's ``dtype``: None (torch's default dtype) or one the fused ops take; TypeError naming it."""
    if dtype is None:
        if torch.get_default_dtype() in FLOAT_DTYPES:
            return
        raise TypeError(
            f"dtype is None, i.e. torch's default dtype, now {torch.get_default_dtype()}; pass one of "
            f"{dtype_names(FLOAT_DTYPES)}"
        )
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be None or one of ({dtype_names(FLOAT_DTYPES)}), got {dtype!r}")


def _set_fallback(module: nn.Module, fallback: nn.Module | None) -> None:
    """``module``'s wrap fallback, outside nn.Module's registry (no submodule, no state_dict keys: the
    fallback's parameters are the wrapper's own)."""
    if fallback is not None and not isinstance(fallback, nn.Module):
        raise TypeError(f"fallback must be None or a torch.nn.Module, got {type_name(fallback)}")
    object.__setattr__(module, "_fallback", fallback)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim through :func:`llm_speed.rms_norm`: ``x * rsqrt(mean(x^2) + eps) * (offset +
    weight)``.

    Args:
        hidden_size: the normalised (last) dim.
        eps, offset, casting, in_place: as :func:`llm_speed.rms_norm` (``casting="llama"`` reproduces Llama's
            module to the bit where the weight has x's dtype; a float32 weight with 16-bit x gives x's dtype,
            where Llama's module returns float32; ``offset=1.0`` is Gemma's convention).
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
        check_module_dtype(dtype)
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

    _fallback: nn.Module | None = None  # wrap's: what inputs of a dtype the kernel does not take run

    @classmethod
    def wrap(
        cls, weight: nn.Parameter | None, eps: float, offset: float = 0.0, *, casting: str = "float32",
        in_place: bool = False, fallback: nn.Module | None = None,
    ) -> RMSNorm:  # fmt: skip
        """A module around an existing ``weight`` (shared, not copied: an optimizer holding it keeps working),
        as :mod:`llm_speed.integrations.transformers` swaps a model's own norms. ``fallback``: the module
        replaced, which inputs of a dtype the kernel does not take (float64) run instead of an error (kept
        unregistered: its weight is this one, so state_dict and parameters are unchanged)."""
        # the weight's dtype is rms_norm's to check: a model's own norm weight is wrapped as it is
        if weight is not None and not isinstance(weight, torch.Tensor):
            raise TypeError(f"weight must be None or a torch.Tensor [hidden], got {type_name(weight)}")
        if weight is not None and weight.dim() != 1:
            raise ValueError(f"weight must have 1 dim [hidden], got shape {tuple(weight.shape)}")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.hidden_size = positive_int("hidden_size", weight.shape[0]) if weight is not None else 0
        module.eps = check_real("eps", eps, minimum=0.0)
        module.offset = check_real("offset", offset)
        module.casting = check_choice("casting", casting, CASTINGS)
        module.in_place = check_flag("in_place", in_place)
        module.weight = weight
        _set_fallback(module, fallback)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fallback is not None and x.dtype not in FLOAT_DTYPES:
            return self._fallback(x)
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
        check_module_dtype(dtype)
        self.activation = check_choice("activation", activation, tuple(ACTIVATIONS))
        self.fused_gate_up = check_flag("fused_gate_up", fused_gate_up)
        kw = dict(bias=bias, device=device, dtype=dtype)
        if self.fused_gate_up:
            self.gate_up_proj = nn.Linear(hidden_size, 2 * self.intermediate_size, **kw)
        else:
            self.gate_proj = nn.Linear(hidden_size, self.intermediate_size, **kw)
            self.up_proj = nn.Linear(hidden_size, self.intermediate_size, **kw)
        self.down_proj = nn.Linear(self.intermediate_size, hidden_size, **kw)

    _fallback: nn.Module | None = None  # wrap's: what inputs of a dtype the kernel does not take run

    @classmethod
    def wrap(
        cls, down_proj: nn.Linear, *, gate_proj: nn.Linear | None = None, up_proj: nn.Linear | None = None,
        gate_up_proj: nn.Linear | None = None, activation: str = "silu", fallback: nn.Module | None = None,
    ) -> GatedMLP:  # fmt: skip
        """A module around existing projections (shared, not copied), as
        :mod:`llm_speed.integrations.transformers` swaps a model's own MLPs: ``gate_proj`` and ``up_proj``, or
        Phi-3's ``gate_up_proj``. ``fallback``: as :meth:`RMSNorm.wrap`'s (the MLP replaced)."""
        activation = check_choice("activation", activation, tuple(ACTIVATIONS))
        projections = dict(gate_proj=gate_proj, up_proj=up_proj, gate_up_proj=gate_up_proj)
        for name, projection in dict(down_proj=down_proj, **projections).items():
            if (projection is not None or name == "down_proj") and not isinstance(projection, nn.Module):
                raise TypeError(f"{name} must be a torch.nn.Module (nn.Linear), got {type_name(projection)}")
        accepted = "GatedMLP.wrap takes gate_proj and up_proj, or gate_up_proj (Phi-3's), with down_proj"
        if gate_up_proj is not None and (gate_proj is not None or up_proj is not None):
            raise ValueError(f"gate_up_proj given with gate_proj or up_proj: {accepted}")
        if gate_up_proj is None and (gate_proj is None or up_proj is None):
            missing = " and ".join(name for name in ("gate_proj", "up_proj") if projections[name] is None)
            raise TypeError(f"{missing} missing: {accepted}")
        module = GatedMLP.__new__(GatedMLP)
        nn.Module.__init__(module)
        module.activation = activation
        module.fused_gate_up = gate_up_proj is not None
        if module.fused_gate_up:
            module.gate_up_proj = gate_up_proj
        else:
            module.gate_proj, module.up_proj = gate_proj, up_proj
        module.down_proj = down_proj
        module.intermediate_size = down_proj.in_features
        _set_fallback(module, fallback)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fallback is not None and x.dtype not in FLOAT_DTYPES:
            return self._fallback(x)
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


def check_module_options(owner: str, function, options: dict, *, given_by_the_module: tuple) -> None:
    """``options`` of a loss module: keyword arguments of ``function`` (less those the module passes itself),
    each checked as ``function`` checks it; TypeError or ValueError naming the option."""
    accepted = [
        name for name, parameter in inspect.signature(function).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY and name not in given_by_the_module
    ]  # fmt: skip
    for name in options:
        if name not in accepted:
            raise TypeError(f"{owner} has no option {name!r}; accepted: {', '.join(accepted)}")
    check_loss_options(**options)  # the values, by the losses' own checks


class CrossEntropyLoss(nn.Module):
    """:func:`llm_speed.cross_entropy` as a module: ``loss(logits [N, V], target [N])``, the options fixed at
    construction (``weight`` is registered as a buffer)."""

    def __init__(self, weight: torch.Tensor | None = None, **options):
        super().__init__()
        check_module_options(type(self).__name__, cross_entropy, options, given_by_the_module=("weight",))
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
        if "weight" in options:
            raise TypeError(
                "weight is forward's argument here (the [V, H] projection: loss(hidden, weight, target)); "
                "pass the class weights [V] as ce_weight="
            )
        if "bias" in options:
            raise TypeError("bias is forward's argument here: loss(hidden, weight, target, bias)")
        check_module_options(type(self).__name__, fused_linear_cross_entropy, options,
                           given_by_the_module=("ce_weight", "bias"))  # fmt: skip
        self.register_buffer("ce_weight", ce_weight)
        self.options = options

    def forward(self, hidden, weight, target, bias=None):
        return fused_linear_cross_entropy(hidden, weight, target, bias=bias, ce_weight=self.ce_weight,
                                          **self.options)  # fmt: skip


# --- mixture of experts (llm_speed.moe) -------------------------------------------------------------------

from .moe.fused_moe import fused_moe  # noqa: E402
from .moe.routing import SCORINGS, check_groups, moe_route  # noqa: E402


class MoEExperts(nn.Module):
    """The experts' weights in vLLM's and Hugging Face's layout: ``gate_up_proj [E, 2I, H]`` (each expert's
    gate rows, then its up rows) and ``down_proj [E, H, I]``; ``forward(hidden, topk_weights, topk_ids)`` is
    :func:`llm_speed.fused_moe`."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *, device=None, dtype=None
    ):
        super().__init__()
        self.num_experts = positive_int("num_experts", num_experts)
        self.hidden_size = positive_int("hidden_size", hidden_size)
        self.intermediate_size = positive_int("intermediate_size", intermediate_size)
        check_module_dtype(dtype)
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each expert's projections as ``nn.Linear`` initialises them: uniform in ``+-1/sqrt(fan_in)``."""
        nn.init.uniform_(self.gate_up_proj, -(self.hidden_size**-0.5), self.hidden_size**-0.5)
        nn.init.uniform_(self.down_proj, -(self.intermediate_size**-0.5), self.intermediate_size**-0.5)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        return fused_moe(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)

    def extra_repr(self) -> str:
        return f"{self.num_experts}, {self.hidden_size}, {self.intermediate_size}"


class MoE(nn.Module):
    """A mixture-of-experts SwiGLU layer: a linear router (``gate``), top-k routing
    (:func:`llm_speed.moe_route`) and the fused experts (:func:`llm_speed.fused_moe`).

    Routing as Mixtral (``scoring="softmax"``, ``renormalize=True``), Qwen2/Qwen3-MoE (softmax, renormalised
    or not) or DeepSeek-V3 (``scoring="sigmoid"``, ``correction_bias=True``, ``n_group``/``topk_group``,
    ``routed_scaling_factor``). Parameter names follow Hugging Face's sparse MoE blocks (``gate.weight``,
    ``experts.gate_up_proj``, ``experts.down_proj``; the correction bias is the float32 buffer
    ``gate.e_score_correction_bias``), so their state dicts load unchanged. ``forward`` takes
    ``[..., hidden]`` and returns the layer's output; :meth:`forward_with_logits` also returns the router
    logits ``[tokens, experts]`` for a load-balancing loss.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: str = "softmax",
        renormalize: bool = True,
        correction_bias: bool = False,
        n_group: int | None = None,
        topk_group: int | None = None,
        routed_scaling_factor: float = 1.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        num_experts = positive_int("num_experts", num_experts)
        self.top_k = positive_int("top_k", top_k)
        if self.top_k > num_experts:
            raise ValueError(f"top_k ({top_k}) must be at most num_experts ({num_experts})")
        self.scoring = check_choice("scoring", scoring, SCORINGS)
        self.renormalize = check_flag("renormalize", renormalize)
        check_groups(num_experts, self.top_k, n_group, topk_group)
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = check_real("routed_scaling_factor", routed_scaling_factor, positive=True)
        check_module_dtype(dtype)
        self.experts = MoEExperts(num_experts, hidden_size, intermediate_size, device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        if check_flag("correction_bias", correction_bias):
            self.gate.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device))

    def forward_with_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output [..., hidden], router_logits [tokens, experts])``."""
        hidden = x.reshape(-1, x.shape[-1])
        logits = self.gate(hidden)
        weights, ids = moe_route(
            logits, self.top_k, scoring=self.scoring, renormalize=self.renormalize,
            bias=getattr(self.gate, "e_score_correction_bias", None), n_group=self.n_group,
            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
        )  # fmt: skip
        return self.experts(hidden, weights, ids).reshape(x.shape), logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_logits(x)[0]

    def extra_repr(self) -> str:
        return f"top_k={self.top_k}, scoring={self.scoring!r}, renormalize={self.renormalize}"


# --- fp8 training linears (llm_speed.matmul.fp8) ----------------------------------------------------------

from collections.abc import Callable, Collection  # noqa: E402

from .matmul.fp8 import LINEAR_GRANULARITIES, float8_linear  # noqa: E402


class Float8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` computed in fp8 (:func:`llm_speed.matmul.fp8.float8_linear`): the input and
    weight quantized dynamically to e4m3 each call (``granularity`` "tensor": one scale each; "row": one per
    row of the input and of the weight), the output gradient to e5m2, and the input and weight gradients
    through the same fp8 GEMM kernel. The parameters stay in their own dtype (the master weights), so a state
    dict moves to and from ``nn.Linear`` unchanged. torchao's float8 training (``Float8Linear`` with dynamic
    scaling) is the reference for these semantics."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, granularity: str = "tensor",
                 device=None, dtype=None):  # fmt: skip
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.granularity = check_choice("granularity", granularity, LINEAR_GRANULARITIES)

    @classmethod
    def from_linear(cls, linear: nn.Linear, *, granularity: str = "tensor") -> Float8Linear:
        """A Float8Linear sharing ``linear``'s parameters (no copy)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.granularity = check_choice("granularity", granularity, LINEAR_GRANULARITIES)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return float8_linear(x, self.weight, self.bias, granularity=self.granularity)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, granularity={self.granularity!r}"


def convert_to_float8(
    model: nn.Module,
    *,
    granularity: str = "tensor",
    skip: Collection[str] | Callable[[str, nn.Module], bool] | None = None,
) -> list[str]:
    """Swap every ``nn.Linear`` of ``model`` (in place) for a :class:`Float8Linear` sharing its parameters;
    return the qualified names of the swapped modules, in ``named_modules`` order.

    ``skip``: names to leave alone (a module named, or any module under a named one, e.g. ``{"lm_head"}``),
    or ``skip(name, module) -> bool`` (torchao's ``module_filter_fn`` with the opposite sense). Already
    converted modules are left as they are. As torchao advises, the output projection (``lm_head``) is
    usually best skipped: its logits are the most sensitive to rounding.
    """
    granularity = check_choice("granularity", granularity, LINEAR_GRANULARITIES)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if skip is None:
        skipped: Callable[[str, nn.Module], bool] = lambda name, module: False  # noqa: E731
    elif callable(skip):
        skipped = skip
    elif isinstance(skip, str):
        raise TypeError("skip must be a collection of module names or a function, not a single str")
    else:
        names = set(skip)
        skipped = lambda name, module: any(name == s or name.startswith(s + ".") for s in names)  # noqa: E731
    swaps = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear and name and not skipped(name, module)
    ]
    for name, module in swaps:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Float8Linear.from_linear(module, granularity=granularity))
    return [name for name, _ in swaps]
