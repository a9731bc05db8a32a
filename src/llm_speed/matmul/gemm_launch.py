"""The launch of :mod:`llm_speed.matmul.gemm`: which kernel a problem takes (TMA operands), its recipe (the
plans of one call, keyed on shapes, strides, dtypes and flags), :func:`launch_gemm` /
:func:`planned_launch`, the op's implementations ``forward`` / ``forward_int8`` and the kept call of a
repeated one (:class:`GemmCall`)."""

from __future__ import annotations

import torch
import triton.language as tl

from ..core import runtime, tensors
from ..core.config import KernelConfig
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import dot_switches, rne_by_hand
from ..core.launch import (
    TMA_ALIGN_BYTES,
    Descriptor,
    Plan,
    TensorDescriptor,
    cdiv,
    plan_cache,
    tma_aligned,
)  # fmt: skip
from ..core.policy import current_policy
from . import reference
from .checks import TENSOR_CORE_DTYPES
from .gemm_configs import (
    INTERPRETER,
    INTERPRETER_PERSISTENT_PROGRAMS,
    PATHS,
    fp32_input_precision,
    gemm_config,
    has_tma,
)
from .gemm_kernels import PERSISTENT_TMA, TILED

# CUDA caps the second grid dimension (the batch) at 65535 programs; larger batches launch in chunks.
MAX_GRID_Y = 65535


def _rows_fit(row_stride: int, row_length: int, element: int) -> bool:
    """Rows a tensor descriptor can read: 16-byte aligned and not overlapping."""
    return row_stride >= max(row_length, 1) and (row_stride * element) % TMA_ALIGN_BYTES == 0


def _tma_operands(m, n, k, a_strides, b_strides, dtype: torch.dtype, aligned: bool) -> bool | None:
    """For 2-D op(a) [M, K] and op(b) [K, N] of these strides and dtype: None if the TMA kernel cannot read
    them, else whether B is K-major. ``aligned``: both base addresses are 16-byte aligned.

    fp16/bf16 only, K > 0 (a tensor descriptor needs every dimension positive). A must be row-major; B
    row-major [K, N] or K-major (the ``x @ W^T`` layout). Base addresses and row strides must be 16-byte
    aligned, as tensor descriptors require, and rows must not overlap (kept conservative: anything unusual
    takes the tiled kernel).
    """
    if dtype not in TENSOR_CORE_DTYPES or k == 0 or not aligned or TensorDescriptor is None:
        return None
    element = dtype.itemsize
    stride_am, stride_ak = a_strides
    stride_bk, stride_bn = b_strides
    if stride_ak != 1 or not _rows_fit(stride_am, k, element):
        return None
    if stride_bn == 1 and _rows_fit(stride_bk, n, element):
        return False
    if stride_bk == 1 and _rows_fit(stride_bn, k, element):
        return True
    return None


def _tma_layout(op_a: torch.Tensor, op_b: torch.Tensor) -> bool | None:
    """:func:`_tma_operands` of 2-D tensors op(a), op(b)."""
    m, k = op_a.shape
    n = op_b.shape[1]
    aligned = tma_aligned(op_a, op_b)
    return _tma_operands(m, n, k, op_a.stride(), op_b.stride(), op_a.dtype, aligned)


def _tma_suits(op_a: torch.Tensor, op_b: torch.Tensor, hardware: Hardware) -> bool:
    """Whether the persistent TMA kernel takes this problem on ``hardware`` (no device access): the rule of
    :func:`_recipe` for a compiled launch."""
    if op_a.dim() != 2 or op_b.dim() != 2:
        return False
    return has_tma(hardware) and _tma_layout(op_a, op_b) is not None


class _Empty:
    """An empty output: nothing to launch."""

    __slots__ = ("out_shape",)

    def __init__(self, out_shape):
        self.out_shape = out_shape

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan | None, dict]:
        return None, {}

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        return None


class _Tiled:
    """The tiled kernel in one launch (a batch of at most MAX_GRID_Y)."""

    __slots__ = ("out_shape", "plan")

    def __init__(self, out_shape, plan: Plan):
        self.out_shape = out_shape
        self.plan = plan

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        """The plan and its per-call arguments (c and bias absent: ``out`` stands in, never read)."""
        return self.plan, dict(
            a_ptr=a, b_ptr=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        """Launch: :meth:`arguments`, passed directly (no dict per call)."""
        self.plan.launch(
            a_ptr=a, b_ptr=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip


class _Chunked:
    """The tiled kernel launched once per MAX_GRID_Y batch entries; operands with a batch are sliced."""

    __slots__ = ("out_shape", "chunks", "sliced")

    def __init__(self, out_shape, chunks, sliced):
        self.out_shape = out_shape
        self.chunks = chunks  # (start, stop, plan)
        self.sliced = sliced  # whether a, b, c have a batch dim to slice (out always has)

    def _chunk(self, start, stop, plan, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        slice_a, slice_b, slice_c = self.sliced
        part = out[start:stop]
        return plan, dict(
            a_ptr=a[start:stop] if slice_a else a, b_ptr=b[start:stop] if slice_b else b,
            c_ptr=part if c is None else (c[start:stop] if slice_c else c),
            bias_ptr=part if bias is None else bias, out_ptr=part, alpha=alpha, beta=beta,
        )  # fmt: skip

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        """The first chunk's plan and per-call arguments."""
        return self._chunk(*self.chunks[0], a, b, c, bias, out, alpha, beta)

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        for chunk in self.chunks:
            plan, arguments = self._chunk(*chunk, a, b, c, bias, out, alpha, beta)
            plan.launch(**arguments)


class _PersistentTma:
    """The persistent kernel; its plan fixes the layouts of a's and b's tensor descriptors, each call passes
    the tensors."""

    __slots__ = ("out_shape", "plan")

    def __init__(self, out_shape, plan: Plan):
        self.out_shape = out_shape
        self.plan = plan

    def arguments(self, a, b, c, bias, out, alpha, beta) -> tuple[Plan, dict]:
        return self.plan, dict(
            a_desc=a, b_desc=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip

    def run(self, a, b, c, bias, out, alpha, beta) -> None:
        """Launch: :meth:`arguments`, passed directly (no dict per call)."""
        self.plan.launch(
            a_desc=a, b_desc=b, c_ptr=out if c is None else c, bias_ptr=out if bias is None else bias,
            out_ptr=out, alpha=alpha, beta=beta,
        )  # fmt: skip


def _broadcast_strides(layout, out_shape) -> tuple[int, ...]:
    """The strides of a tensor of (shape, strides) ``layout`` broadcast to ``out_shape`` (0 where it
    broadcasts), as ``expand`` would give them."""
    shape, strides = layout
    offset = len(out_shape) - len(shape)
    return tuple(
        0 if i < offset or shape[i - offset] == 1 else strides[i - offset] for i in range(len(out_shape))
    )


@plan_cache
def _recipe(
    a_shape, a_strides, b_shape, b_strides, trans_a: bool, trans_b: bool, c_layout, bias_stride,
    dtypes: tuple, activation, tf32: bool, aligned: bool, out_strides, path, config, device: torch.device,
):  # fmt: skip
    """How to launch a problem class: the plan(s) and what each call passes. Keyed on everything that fixes
    the launch: shapes and strides of a and b (and the flags that transpose them), c's shape and strides,
    bias's stride, the dtypes of a, c, bias and out, the activation, TF32, whether a and b are 16-byte
    aligned (tensor descriptors need it), out's strides (None: a fresh contiguous output), a forced path or
    configuration (tests), and the device."""
    a_dtype, c_dtype, bias_dtype, out_dtype = dtypes
    a_rows, a_cols = a_shape[-2:]
    b_rows, b_cols = b_shape[-2:]
    # op(a) [M, K] and op(b) [K, N]: a transpose swaps the sizes and strides of the last two dims
    if trans_a:
        m, k, stride_am, stride_ak = a_cols, a_rows, a_strides[-1], a_strides[-2]
    else:
        m, k, stride_am, stride_ak = a_rows, a_cols, a_strides[-2], a_strides[-1]
    if trans_b:
        n, stride_bk, stride_bn = b_rows, b_strides[-1], b_strides[-2]
    else:
        n, stride_bk, stride_bn = b_cols, b_strides[-2], b_strides[-1]
    batched = len(a_shape) == 3 or len(b_shape) == 3
    batch_a = a_shape[0] if len(a_shape) == 3 else 1
    batch_b = b_shape[0] if len(b_shape) == 3 else 1
    batch = batch_b if batch_a == 1 else batch_a
    out_shape = (batch, m, n) if batched else (m, n)
    if m == 0 or n == 0 or batch == 0:
        return _Empty(out_shape)
    if out_strides is None:
        out_strides = (m * n, n, 1) if batched else (n, 1)
    interpreted = runtime.INTERPRETED
    hardware = hardware_of(device)
    b_k_major = None  # None: the TMA kernel cannot read these operands
    if not batched:
        b_k_major = _tma_operands(m, n, k, (stride_am, stride_ak), (stride_bk, stride_bn), a_dtype, aligned)
    if path is None:
        tma = b_k_major is not None and not interpreted and has_tma(hardware)
        path = "persistent_tma" if tma else "tiled"
    elif path == "persistent_tma":
        if b_k_major is None:
            raise ValueError(
                "the persistent TMA kernel needs 2-D fp16/bf16 operands with K > 0, row-major A and row- or "
                "K-major B, 16-byte aligned"
            )
        if not interpreted and not has_tma(hardware):
            raise ValueError(f"the persistent TMA kernel is not used on {hardware.name} (see gemm.TIERS)")
    elif path != "tiled":
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    if config is None:
        if interpreted:
            config = INTERPRETER
        else:
            config = gemm_config(m, n, k, a_dtype, path, bool(b_k_major), hardware, batch=batch)
    switches = dot_switches(a_dtype, tf32=tf32)
    c_strides = _broadcast_strides(c_layout, out_shape) if c_layout is not None else (0,) * len(out_shape)
    common = dict(
        M=m, N=n, K=k, stride_bias=bias_stride or 0, stride_cm=c_strides[-2], stride_cn=c_strides[-1],
        stride_om=out_strides[-2], stride_on=out_strides[-1],
        HAS_C=c_layout is not None, HAS_BIAS=bias_stride is not None, ACTIVATION=activation,
        DOT_IN_FP32=switches["DOT_IN_FP32"], DOT_PRECISION=switches["DOT_PRECISION"],
        RNE_BY_HAND=rne_by_hand(out_dtype), **config.meta(),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if path == "persistent_tma":
        # NUM_PROGRAMS is one constant per device (a constexpr: one compilation); fewer tiles launch fewer
        # programs, each then walking one tile.
        programs = INTERPRETER_PERSISTENT_PROGRAMS if interpreted else hardware.sm_count
        tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)
        grid = (min(programs, tiles),)
        a_desc = Descriptor((m, k), (stride_am, 1), (config.block_m, config.block_k))
        if b_k_major:
            b_desc = Descriptor((n, k), (stride_bn, 1), (config.block_n, config.block_k))
        else:
            b_desc = Descriptor((k, n), (stride_bk, 1), (config.block_k, config.block_n))
        plan = PERSISTENT_TMA.plan(grid, a_desc=a_desc, b_desc=b_desc, B_K_MAJOR=b_k_major,
                                   NUM_PROGRAMS=programs, **common)  # fmt: skip
        return _PersistentTma(out_shape, plan)

    tiles = cdiv(m, config.block_m) * cdiv(n, config.block_n)

    def batch_stride(shape, strides):  # 0 broadcasts a 2-D operand, or a batch of 1, over the launch's batch
        return strides[0] if len(shape) == 3 and shape[0] != 1 else 0

    fixed = dict(
        common, stride_ab=batch_stride(a_shape, a_strides), stride_am=stride_am, stride_ak=stride_ak,
        stride_bb=batch_stride(b_shape, b_strides), stride_bk=stride_bk, stride_bn=stride_bn,
        stride_cb=c_strides[0] if batched else 0, stride_ob=out_strides[0] if batched else 0,
        ACC_DTYPE=tl.int32 if a_dtype == torch.int8 else tl.float32,
    )  # fmt: skip
    if batch <= MAX_GRID_Y:
        return _Tiled(out_shape, TILED.plan((tiles, batch), **fixed))
    chunk_plans = {}
    chunks = []
    for start in range(0, batch, MAX_GRID_Y):
        count = min(MAX_GRID_Y, batch - start)
        if count not in chunk_plans:
            chunk_plans[count] = TILED.plan((tiles, count), **fixed)
        chunks.append((start, start + count, chunk_plans[count]))
    sliced = (
        len(a_shape) == 3 and a_shape[0] != 1,
        len(b_shape) == 3 and b_shape[0] != 1,
        c_layout is not None and len(c_layout[0]) == 3 and c_layout[0][0] != 1,
    )
    return _Chunked(out_shape, tuple(chunks), sliced)


def _recipe_of(a, b, out_dtype, trans_a, trans_b, c, bias, activation, out, path, config, device):
    """The cached recipe of a problem (see :func:`_recipe` for its key)."""
    a_dtype = a.dtype
    if a_dtype is torch.float32:
        tf32, aligned = fp32_input_precision() == "tf32", True
    else:  # the alignment of a and b decides the TMA path, for 16-bit operands
        tf32, aligned = False, a_dtype is torch.int8 or tma_aligned(a, b)
    return _recipe(
        a.shape, a.stride(), b.shape, b.stride(), trans_a, trans_b,
        None if c is None else (c.shape, c.stride()), None if bias is None else bias.stride(0),
        (a_dtype, None if c is None else c.dtype, None if bias is None else bias.dtype, out_dtype),
        activation, tf32, aligned, None if out is None else out.stride(), path, config, device,
    )  # fmt: skip


def _launch(a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, activation, device, out=None,
            path=None, config=None) -> torch.Tensor:  # fmt: skip
    """Allocate ``out`` (unless given) and run the Triton kernel on a problem of checked arguments."""
    if a.dtype is torch.int8:  # (8-bit operands: read K-major, copied if they are not)
        a, b = k_major_int8(a, b)
    recipe = _recipe_of(a, b, out_dtype, trans_a, trans_b, c, bias, activation, out, path, config, device)
    return _run(recipe, a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, device, out)


def _run(recipe, a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, device, out=None) -> torch.Tensor:
    """Allocate ``out`` (unless given), report the work, and run ``recipe``."""
    if out is None:
        out = tensors.new_output(recipe.out_shape, out_dtype, device)
    if out.numel() and runtime.observed():
        _report(a, b, trans_a, trans_b, out)
    recipe.run(a, b, c, bias, out, alpha, beta)
    return out


def _report(a, b, trans_a, trans_b, out) -> None:
    """Report one GEMM to the op table (llm_speed.ops) for the profiler, whichever path computes it."""
    row = "tensor_core_gemm_int8" if a.dtype == torch.int8 else "gemm"  # tensor_core_gemm reports as gemm
    runtime.report_work(row, op_a=a.mT if trans_a else a, op_b=b.mT if trans_b else b, out=out)


def launch_gemm(
    op_a: torch.Tensor,
    op_b: torch.Tensor,
    out: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """Run a Triton GEMM kernel: ``out = act(alpha * op_a @ op_b + beta * c + bias)``, written in place.

    op_a [.., M, K] and op_b [.., K, N] are already transposed views (any strides, batch 1 broadcasts);
    ``out`` [.., M, N] is allocated by the caller; ``c`` (read only when given) broadcasts to ``out``.
    ``path`` forces "tiled" or "persistent_tma" (tests use it to run the TMA kernel under the interpreter);
    ``config`` forces a configuration (tests run each shipped one); None chooses. Inputs are not validated
    here: the public functions do that.
    """
    return _launch(op_a, op_b, out.dtype, False, False, c, bias, float(alpha), float(beta), activation,
                   out.device, out, path, config)  # fmt: skip


def planned_launch(
    op_a: torch.Tensor,
    op_b: torch.Tensor,
    out: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    path: str | None = None,
    config: KernelConfig | None = None,
) -> tuple[Plan | None, dict]:
    """The plan and per-call arguments of :func:`launch_gemm`'s (first) launch with these arguments, without
    launching (None, {} for an empty output): the tests compile exactly what a launch would run."""
    device = out.device
    if op_a.dtype is torch.int8:  # as _launch
        op_a, op_b = k_major_int8(op_a, op_b)
    recipe = _recipe_of(op_a, op_b, out.dtype, False, False, c, bias, activation, out, path, config, device)
    return recipe.arguments(op_a, op_b, c, bias, out, float(alpha), float(beta))


def forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype) -> torch.Tensor:
    """The unchecked forward behind the ``llm_speed::gemm`` op (Triton, or the PyTorch fallback); reports
    its work."""
    device = a.device
    if runtime.triton_runs_on(device):
        return _launch(a, b, out_dtype, trans_a, trans_b, c, bias, alpha, beta, activation, device)
    out = reference.gemm_reference(
        a, b, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
        activation=activation, out_dtype=out_dtype, compute_dtype=torch.float32,
    )  # fmt: skip
    if out.numel() and runtime.observed():
        _report(a, b, trans_a, trans_b, out)
    return out


def k_major_int8(a, b) -> tuple[torch.Tensor, torch.Tensor]:
    """op(a) and op(b) as the int8 kernel reads them: K-major (copies where they are not; wgmma's 8-bit
    layout, :func:`llm_speed.core.tensors.k_major`). int8 launches never transpose through flags."""
    return tensors.k_major(a, -1), tensors.k_major(b, -2)


def gluon_takes_int8(a, b) -> bool:
    """Whether the warp-specialized Gluon kernel runs this int8 call (``a`` and ``b`` K-major): only under a
    policy that turns it on (off as shipped: one attribute read, the Gluon package not imported), and only
    for the calls :func:`llm_speed.gluon.gemm_int8_select.gluon_gemm_int8_applies` takes (2-D, TMA rows,
    sm_90)."""
    if not current_policy().gluon_gemm_int8:
        return False
    from ..gluon.gemm_int8_select import gluon_gemm_int8_applies

    return gluon_gemm_int8_applies(a, b)


def forward_int8(a, b) -> torch.Tensor:
    """The unchecked forward behind the ``llm_speed::gemm_int8`` op; reports its work."""
    device = a.device
    if runtime.triton_runs_on(device):
        if current_policy().gluon_gemm_int8:  # (as shipped: off, and the operands go to _launch as given)
            a, b = k_major_int8(a, b)
            if gluon_takes_int8(a, b):
                from ..gluon.gemm import gemm_int8

                out = gemm_int8(a, b.mT)  # b K-major: b.mT is [N, K] row-major, the nn.Linear layout
                if runtime.observed():
                    _report(a, b, False, False, out)
                return out
        return _launch(a, b, torch.int32, False, False, None, None, 1.0, 0.0, None, device)
    out = reference.gemm_int8_reference(a, b)
    if out.numel():
        _report(a, b, False, False, out)
    return out


class GemmCall:
    """A 16-bit :func:`gemm` call without ``c`` (beta 0) or ``out_dtype``, or a
    :func:`tensor_core_gemm_int8` call (``out_dtype`` int32), whose metadata passed every check before: what
    a repeated call with the same metadata does, the output, the report and the launch
    (``llm_speed.matmul.gemm._GEMM_CALLS``)."""

    __slots__ = ("recipe", "trans_a", "trans_b", "dtype", "device", "copies")

    def __init__(self, a, b, out_dtype, trans_a=False, trans_b=False, bias=None, activation=None, *,
                 copies=False):  # fmt: skip
        self.trans_a, self.trans_b, self.dtype, self.device = trans_a, trans_b, out_dtype, a.device
        self.copies = copies  # int8 operands of this metadata are copied K-major before the launch
        self.recipe = _recipe_of(a, b, out_dtype, trans_a, trans_b, None, bias, activation, None, None, None,
                                 a.device)  # fmt: skip

    def __call__(self, a, b, bias, alpha: float) -> torch.Tensor:
        return _run(self.recipe, a, b, self.dtype, self.trans_a, self.trans_b, None, bias, alpha, 0.0,
                    self.device)  # fmt: skip

    def forward(self, a, b, c, bias, alpha, *fixed) -> torch.Tensor:
        """:func:`forward` of such a call (the op's arguments; the recipe fixes the others)."""
        return self(a, b, bias, alpha)
