"""SwiGLU activation (Shazeer, "GLU Variants Improve Transformer", 2020, arXiv:2002.05202) in Triton.

``silu(gate) * up`` in one kernel: reads gate and up once and writes the product once (eager PyTorch writes
and rereads ``silu(gate)`` in between). The backward kernel recomputes the sigmoid from gate instead of
saving it, as Liger-Kernel's ``ops/swiglu.py`` does, and writes both gradients in one pass.

Layout as :mod:`llm_speed.fused.rms_norm`: kernels, launcher, op registration, autograd, public function; the
plain-PyTorch spec is :func:`llm_speed.fused.reference.swiglu_reference`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..core import autocast, runtime, tensors
from ..core.config import KernelConfig
from ..core.dispatch import INFERENCE, Op, plain_call
from ..core.kernel_math import cast, rne_by_hand, tanh
from ..core.launch import CallCache, Kernel, Plan, cdiv, next_power_of_2, plan_cache
from ..core.tensors import check_same_device, check_tensor
from .reference import compute_dtype

# --- kernels --------------------------------------------------------------------------------------------


GELU_K0: tl.constexpr = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
GELU_K1: tl.constexpr = tl.constexpr(0.044715)


@triton.jit
def _activation(b_g, GELU: tl.constexpr):
    """(act(g), act'(g)) in float32: SiLU, or with GELU the tanh approximation of GELU
    (``torch.nn.functional.gelu(approximate="tanh")``, Gemma's ``gelu_pytorch_tanh``)."""
    if GELU:
        b_inner = GELU_K0 * (b_g + GELU_K1 * b_g * b_g * b_g)
        b_th = tanh(b_inner)
        b_act = 0.5 * b_g * (1.0 + b_th)
        b_dinner = GELU_K0 * (1.0 + 3.0 * GELU_K1 * b_g * b_g)
        b_dact = 0.5 * (1.0 + b_th) + 0.5 * b_g * (1.0 - b_th * b_th) * b_dinner
    else:
        b_sig = tl.sigmoid(b_g)
        b_act = b_g * b_sig
        b_dact = b_sig * (1.0 + b_g * (1.0 - b_sig))  # silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    return b_act, b_dact


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr, GELU: tl.constexpr, RNE_BY_HAND: tl.constexpr
):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_g = tl.load(gate_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + o, mask=m, other=0.0).to(tl.float32)
    if GELU:
        b_act, _ = _activation(b_g, GELU)
    else:
        b_act = b_g * tl.sigmoid(b_g)
    tl.store(out_ptr + o, cast(b_act * b_u, out_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


@triton.jit
def _swiglu_bwd_kernel(
    dout_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n,
    BLOCK: tl.constexpr, GELU: tl.constexpr, RNE_BY_HAND: tl.constexpr,
):  # fmt: skip
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    b_do = tl.load(dout_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_g = tl.load(gate_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(up_ptr + o, mask=m, other=0.0).to(tl.float32)
    b_act, b_dact = _activation(b_g, GELU)
    b_dg = b_do * b_u * b_dact
    tl.store(dgate_ptr + o, cast(b_dg, dgate_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)
    tl.store(dup_ptr + o, cast(b_do * b_act, dup_ptr.dtype.element_ty, RNE_BY_HAND=RNE_BY_HAND), mask=m)


# --- launcher -------------------------------------------------------------------------------------------

FORWARD = Kernel(_swiglu_fwd_kernel, "swiglu_fwd")
BACKWARD = Kernel(_swiglu_bwd_kernel, "swiglu_bwd")
# Elements per program: 16 per thread with 8 warps, two 128-bit accesses per 16-bit tensor. At 1024 (4 per
# thread) sm_90a got 64-bit loads and stores and 115k programs at Llama-3-8B's 8192 x 14336 (H100 2026-11-25:
# forward + backward 1.16 ms, Liger-Kernel's 16-32 per thread 1.02).
BLOCK = 4096
ELEMENTS_PER_THREAD = 16


@functools.cache
def config(n: int) -> KernelConfig:
    """``block_n`` elements per program (``block_m`` 1): :data:`BLOCK`, or ``n`` padded to a power of two
    when smaller, with a warp per 32 x :data:`ELEMENTS_PER_THREAD` elements (at most 8)."""
    block = min(BLOCK, next_power_of_2(n))
    return KernelConfig(1, block, num_warps=max(1, min(8, block // (32 * ELEMENTS_PER_THREAD))), num_stages=1)


@plan_cache
def _plan(kernel: Kernel, n: int, gelu: bool, dtypes: tuple, device: torch.device) -> Plan:
    """The forward's or the backward's launch over ``n`` elements; ``dtypes`` of its tensors, gate's the one
    its outputs round to (the forward's first, the backward's second)."""
    cfg = config(n)
    gate_dtype = dtypes[0] if kernel is FORWARD else dtypes[1]
    return kernel.plan(
        (cdiv(n, cfg.block_n),), n=n, BLOCK=cfg.block_n, GELU=gelu, RNE_BY_HAND=rne_by_hand(gate_dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _activation_torch(g, gelu):
    """(act(g), act'(g)) in g's dtype (the PyTorch fallback)."""
    if gelu:
        k0, k1 = 0.7978845608028654, 0.044715
        th = torch.tanh(k0 * (g + k1 * g**3))
        return 0.5 * g * (1 + th), 0.5 * (1 + th) + 0.5 * g * (1 - th * th) * k0 * (1 + 3 * k1 * g * g)
    sig = torch.sigmoid(g)
    return g * sig, sig * (1 + g * (1 - sig))


def _backward_torch(dout, gate, up, gelu):
    ct = compute_dtype(gate.dtype)
    g, u, do = gate.to(ct), up.to(ct), dout.to(ct)
    act, dact = _activation_torch(g, gelu)
    return (do * u * dact).to(gate.dtype), (do * act).to(up.dtype)


def launch_forward(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` (SiLU, or GELU's tanh approximation) of contiguous ``gate`` and ``up`` of one
    shape: the kernel, or the same formulas in PyTorch where Triton cannot run."""
    n = gate.numel()
    if n == 0 or not runtime.triton_runs_on(gate.device):
        ct = compute_dtype(gate.dtype)
        return (_activation_torch(gate.to(ct), gelu)[0] * up.to(ct)).to(gate.dtype)
    return _launch_plan(_plan(FORWARD, n, gelu, (gate.dtype, up.dtype), gate.device), gate, up)


def _launch_plan(plan: Plan, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Allocate the output and launch the forward ``plan``."""
    out = tensors.new_output(gate.shape, gate.dtype, gate.device)
    plan.launch(gate_ptr=gate, up_ptr=up, out_ptr=out)
    return out


def launch_backward(dout, gate, up, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of :func:`launch_forward`."""
    n = gate.numel()
    dout = dout.contiguous()
    if n == 0 or not runtime.triton_runs_on(gate.device):
        return _backward_torch(dout, gate, up, gelu)
    plan = _plan(BACKWARD, n, gelu, (dout.dtype, gate.dtype, up.dtype), gate.device)
    dgate = tensors.new_output(gate.shape, gate.dtype, gate.device)
    dup = tensors.new_output(up.shape, up.dtype, up.device)
    plan.launch(dout_ptr=dout, gate_ptr=gate, up_ptr=up, dgate_ptr=dgate, dup_ptr=dup)
    return dgate, dup


# --- op registration and autograd (one body for SwiGLU and GeGLU) ------------------------------------------


def gated_activation(gelu: bool) -> GatedActivation:
    """The op of one gated activation on the kernels above, SwiGLU or (``gelu``) GeGLU: its implementations
    (which report their work under the op-table rows "swiglu"/"geglu" and their "_backward" rows), the
    ``torch.library`` ops ``llm_speed::<row>_forward`` / ``_backward`` with their fakes, and the autograd that
    saves gate and up and recomputes the activation. Under ``torch.autocast``: no cast (SiLU, GELU and mul
    are on none of autocast's lists)."""
    row = "geglu" if gelu else "swiglu"
    backward_row = "geglu_backward" if gelu else "swiglu_backward"

    def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if gate.numel():
            runtime.report_work(row, gate=gate)
        return launch_forward(gate, up, gelu)

    def backward(dout, gate, up):
        if gate.numel():
            runtime.report_work(backward_row, gate=gate)
        return launch_backward(dout, gate, up, gelu)

    def forward_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return forward(gate, up)

    def backward_op(
        dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return backward(dout, gate, up)

    forward_op = torch.library.custom_op(f"llm_speed::{row}_forward", forward_op, mutates_args=())
    forward_op.register_fake(lambda gate, up: torch.empty_like(gate))
    backward_op = torch.library.custom_op(f"llm_speed::{backward_row}", backward_op, mutates_args=())
    backward_op.register_fake(lambda dout, gate, up: (torch.empty_like(gate), torch.empty_like(up)))
    backward_call = autocast.dispatch(Op(backward_op, backward), autocast.KEEP)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def autograd_backward(ctx, dout):
        gate, up = ctx.saved_tensors
        return backward_call(dout, gate, up)

    op = Op(forward_op, forward, setup_context=setup_context, backward=autograd_backward)
    return GatedActivation(row, gelu, op, autocast.dispatch(op, autocast.KEEP))


class GatedActivation:
    """A gated activation's public body (:func:`swiglu`, :func:`llm_speed.geglu`): the checks, then its op;
    a repeated call with the metadata of one that passed them (and was copied nothing) skips both and
    launches the plan it kept: directly, or with grad inside the op's autograd node (``Op.checked``)."""

    __slots__ = ("row", "gelu", "op", "call", "kept")

    def __init__(self, row: str, gelu: bool, op: Op, call: autocast.AutocastOp):
        self.row, self.gelu, self.op, self.call = row, gelu, op, call
        self.kept = CallCache()  # launches of checked calls, by the metadata the checks read

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        mode = plain_call(gate, up)
        if mode:
            key = (gate.shape, gate.stride(), gate.dtype, gate.device, up.shape, up.stride(), up.dtype,
                   up.device)  # fmt: skip
            run = self.kept.get(key)
            if run is not None:
                return run(gate, up) if mode == INFERENCE else self.op.checked(run, gate, up)
        _validate(gate, up)
        given = gate, up
        gate, up = gate.contiguous(), up.contiguous()
        out = self.call(gate, up)
        copied = given[0] is not gate or given[1] is not up
        if mode and not copied and gate.numel() and runtime.triton_runs_on(gate.device):
            plan = _plan(FORWARD, gate.numel(), self.gelu, (gate.dtype, up.dtype), gate.device)
            self.kept.put(key, functools.partial(_launch_kept, self.row, plan))
        return out


def _launch_kept(row: str, plan: Plan, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The forward of a call :class:`GatedActivation` kept: report, allocate, launch ``plan``."""
    runtime.report_work(row, gate=gate)
    return _launch_plan(plan, gate, up)


_forward_call = gated_activation(gelu=False)


# --- public function ------------------------------------------------------------------------------------


def _validate(gate, up):
    check_tensor("gate", gate)
    check_tensor("up", up)
    if gate.shape != up.shape:
        raise ValueError(
            f"gate and up must have the same shape, got gate {tuple(gate.shape)}, up {tuple(up.shape)}"
        )
    if gate.dtype != up.dtype:
        raise TypeError(f"gate and up must share one dtype, got gate {gate.dtype}, up {up.dtype}")
    check_same_device(gate=gate, up=up)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation ``silu(gate) * up`` (Llama, Mistral, Qwen2 MLPs), one Triton kernel each way.

    Args:
        gate, up: the same shape (any) and dtype (float16, bfloat16, float32), on one device. Non-contiguous
            inputs are copied to contiguous ones first.

    Returns a contiguous tensor of gate's shape and dtype, computed in float32. Differentiable in gate and
    up; the backward recomputes ``sigmoid(gate)`` rather than saving it. Devices as
    :func:`llm_speed.rms_norm`. Reference: :func:`llm_speed.fused.reference.swiglu_reference`.
    """
    return _forward_call(gate, up)
