"""GEMM launchers, ``torch.library`` registration, autograd, and the public functions.

Dispatch (see docs/gemm.md):
- tensors Triton can run on (CUDA; CPU under ``TRITON_INTERPRET=1``): the Triton kernels. On a GPU with tensor
  descriptors (TMA) and the shared memory for its tiles (H100, H200, B200; ``configs.tier_for``),
  2-D fp16/bf16 problems whose operands suit tensor descriptors take the persistent TMA kernel; everything
  else takes the tiled kernel.
- CPU tensors without the interpreter: ``reference.gemm_reference`` in float32, the same function.

fp32 inputs use TF32 tensor cores only when PyTorch allows TF32 for ``torch.matmul``
(``torch.backends.cuda.matmul.fp32_precision = "tf32"``, or the legacy ``allow_tf32 = True``, or
``torch.set_float32_matmul_precision("high")``); by default they are computed in full fp32 ("ieee").
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llm_speed.core import runtime, tensors
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.core.kernel_math import rne_by_hand
from llm_speed.matmul import configs, kernels, reference
from llm_speed.matmul.validation import (
    FLOAT_DTYPES,
    INT8_DTYPES,
    TENSOR_CORE_DTYPES,
    check_epilogue,
    check_operands,
)

TILED_KERNEL = "matmul.gemm_tiled"
PERSISTENT_TMA_KERNEL = "matmul.gemm_persistent_tma"
PATHS = ("tiled", "persistent_tma")

# CUDA caps the second grid dimension (the batch) at 65535 programs; larger batches launch in chunks.
_MAX_GRID_Y = 65535
# Tensor descriptors need 16-byte aligned base addresses and row strides.
_TMA_ALIGN_BYTES = 16
# The smallest autotuning bucket of a size: tl.dot's smallest tile side.
_SMALLEST_BUCKET = 16


def fp32_input_precision() -> str:
    """The fp32 dot precision: "tf32" when PyTorch allows TF32 for CUDA matmuls, else "ieee" (the default).

    Reads ``torch.backends.cuda.matmul.fp32_precision`` where it exists (torch >= 2.9; it reflects the legacy
    ``allow_tf32`` and ``torch.set_float32_matmul_precision`` too, whereas reading ``allow_tf32`` raises once
    the new API has set TF32), else ``allow_tf32``.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:
        return "tf32" if matmul.allow_tf32 else "ieee"
    return "tf32" if precision == "tf32" else "ieee"


def _as_batched(x: torch.Tensor) -> torch.Tensor:
    """A 3-D view of x ([1, rows, cols] for a 2-D x); no copy."""
    return x if x.dim() == 3 else x.unsqueeze(0)


def _batch_stride(x3: torch.Tensor) -> int:
    """Batch stride of a 3-D view; 0 for a batch of 1 so it broadcasts over the launch's batch."""
    return 0 if x3.shape[0] == 1 else x3.stride(0)


def _hardware(device: torch.device) -> Hardware:
    """Shared memory per block, SMs and capability of the device: they choose the configurations."""
    return hardware_of(device)


def size_bucket(size: int) -> int:
    """The autotuning bucket of a problem size: the next power of two, at least 16 (tl.dot's smallest tile).

    Shapes in one bucket share one tuning run; without buckets every new M (tokens in a batch) would pay
    a benchmark of every configuration.
    """
    return triton.next_power_of_2(max(size, _SMALLEST_BUCKET))


def _drop_oversized_tiles(candidates, named_args, **kwargs):
    """Autotuner pruning: skip tiles larger than the problem's bucket in M or N (mostly masked work).

    When every tile is too large (a small problem), the ones of the smallest area remain. The launchers pass
    every argument by keyword, so the buckets arrive in ``kwargs`` (``named_args`` holds positional ones).
    """
    args = {**named_args, **kwargs}
    fitting = [
        cfg
        for cfg in candidates
        if cfg.kwargs["BLOCK_M"] <= args["M_BUCKET"] and cfg.kwargs["BLOCK_N"] <= args["N_BUCKET"]
    ]
    if fitting:
        return fitting
    smallest = min(cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] for cfg in candidates)
    return [cfg for cfg in candidates if cfg.kwargs["BLOCK_M"] * cfg.kwargs["BLOCK_N"] == smallest]


_PRUNING = {"early_config_prune": _drop_oversized_tiles}


def _to_triton(cfg, pre_hook=None):
    return triton.Config(cfg.meta(), num_warps=cfg.num_warps, num_stages=cfg.num_stages, pre_hook=pre_hook)


@functools.cache
def _autotuned_tiled(hardware: Hardware):
    tuned = [_to_triton(cfg) for cfg in configs.tiled_configs(hardware)]
    # The unit strides tell the layout (the autotuner adds the dtypes to the key).
    key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "stride_ak", "stride_bn"]
    return triton.autotune(tuned, key=key, prune_configs_by=_PRUNING)(kernels.gemm_tiled_kernel)


def _set_descriptor_blocks(nargs) -> None:
    """Autotuner pre-hook: give the tensor descriptors the block shape of the configuration being run."""
    block_m, block_n, block_k = nargs["BLOCK_M"], nargs["BLOCK_N"], nargs["BLOCK_K"]
    nargs["a_desc"].block_shape = [block_m, block_k]
    nargs["b_desc"].block_shape = [block_n, block_k] if nargs["B_K_MAJOR"] else [block_k, block_n]


@functools.cache
def _autotuned_persistent_tma(hardware: Hardware):
    tuned = [
        _to_triton(cfg, _set_descriptor_blocks) for cfg in configs.persistent_tma_configs(hardware)
    ]
    key = ["M_BUCKET", "N_BUCKET", "K_BUCKET", "B_K_MAJOR"]
    return triton.autotune(tuned, key=key, prune_configs_by=_PRUNING)(kernels.gemm_persistent_tma_kernel)


def _tma_layout(op_a: torch.Tensor, op_b: torch.Tensor) -> bool | None:
    """For 2-D op(a), op(b): None if the TMA kernel cannot read them, else whether B is K-major.

    A must be row-major; B row-major [K, N] or K-major (the ``x @ W^T`` layout). Strides and base addresses
    must be 16-byte aligned, as tensor descriptors require, and rows must not overlap (kept conservative:
    anything unusual takes the tiled kernel).
    """
    item = op_a.element_size()

    def rows_fit(x: torch.Tensor, row_stride: int, row_length: int) -> bool:
        return (
            row_stride >= max(row_length, 1)
            and (row_stride * item) % _TMA_ALIGN_BYTES == 0
            and x.data_ptr() % _TMA_ALIGN_BYTES == 0
        )

    if op_a.stride(1) != 1 or not rows_fit(op_a, op_a.stride(0), op_a.shape[1]):
        return None
    if op_b.stride(1) == 1 and rows_fit(op_b, op_b.stride(0), op_b.shape[1]):
        return False
    if op_b.stride(0) == 1 and rows_fit(op_b, op_b.stride(1), op_b.shape[0]):
        return True
    return None


@functools.cache
def _has_host_tensor_descriptors() -> bool:
    """Whether this Triton has host-side tensor descriptors (``triton.tools.tensor_descriptor``, 3.4+)."""
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def _tma_suits(op_a: torch.Tensor, op_b: torch.Tensor, hardware: Hardware) -> bool:
    """Whether the persistent TMA kernel takes this problem on ``hardware`` (no device access)."""
    if not configs.has_tma(hardware) or not _has_host_tensor_descriptors():
        return False
    if op_a.dim() != 2 or op_b.dim() != 2 or op_a.dtype not in TENSOR_CORE_DTYPES:
        return False
    if op_a.shape[1] == 0:  # K == 0: a tensor descriptor needs every dimension positive
        return False
    return _tma_layout(op_a, op_b) is not None


def _choose_path(op_a: torch.Tensor, op_b: torch.Tensor) -> str:
    """The kernel for a problem Triton runs: persistent TMA where the device has it and the operands suit
    it, else tiled."""
    if runtime.INTERPRETED or op_a.device.type != "cuda":
        return "tiled"
    return "persistent_tma" if _tma_suits(op_a, op_b, _hardware(op_a.device)) else "tiled"


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
) -> torch.Tensor:
    """Run a Triton GEMM kernel: ``out = act(alpha * op_a @ op_b + beta * c + bias)``, written in place.

    op_a [.., M, K] and op_b [.., K, N] are already transposed views (any strides, batch 1 broadcasts);
    ``out`` [.., M, N] is freshly allocated; ``c`` (read only when given) broadcasts to ``out``. ``path``
    forces "tiled" or "persistent_tma" (tests use it to run the TMA kernel under the interpreter); None
    chooses. Inputs are not validated here: the public functions do that.
    """
    if out.numel() == 0:
        return out
    _report_gemm(op_a, op_b, out)
    path = path or _choose_path(op_a, op_b)
    if path not in PATHS:
        raise ValueError(f"path must be None or one of {PATHS}, got {path!r}")
    with runtime.on_device_of(out):
        _launch_on_device(op_a, op_b, out, alpha, beta, c, bias, activation, path)
    return out


def _launch_on_device(op_a, op_b, out, alpha, beta, c, bias, activation, path) -> None:
    """The body of :func:`launch_gemm` (arguments already checked), on the tensors' device."""
    M, N = out.shape[-2], out.shape[-1]
    K = op_a.shape[-1]
    integer = op_a.dtype == torch.int8
    epilogue = {
        "HAS_C": c is not None,
        "HAS_BIAS": bias is not None,
        "ACTIVATION": activation,
        # The interpreter's tl.dot gets bf16 wrong; fp32 tiles give the GPU's exact bf16 products.
        "DOT_IN_FP32": runtime.INTERPRETED and op_a.dtype == torch.bfloat16,
        # The interpreter truncates fp32 -> bf16; round the output to nearest even by hand there.
        "RNE_BY_HAND": rne_by_hand(out.dtype),
    }
    # Pointer arguments that are not read (HAS_C / HAS_BIAS False) still need a tensor: out stands in.
    bias_arg = bias if bias is not None else out
    scalars = {
        "M": M, "N": N, "K": K,
        "stride_bias": bias_arg.stride(-1), "alpha": alpha, "beta": beta,
        "M_BUCKET": size_bucket(M), "N_BUCKET": size_bucket(N), "K_BUCKET": size_bucket(K),
    }  # fmt: skip
    if path == "persistent_tma":
        _launch_persistent_tma(op_a, op_b, out, c, bias_arg, scalars, epilogue)
        return

    out3 = _as_batched(out)
    a3, b3 = _as_batched(op_a), _as_batched(op_b)
    c3 = _as_batched(c.expand(out.shape)) if c is not None else out3
    input_precision = fp32_input_precision() if op_a.dtype == torch.float32 else "ieee"
    if epilogue["DOT_IN_FP32"]:
        input_precision = "ieee"
    if runtime.INTERPRETED:
        kernel, meta = kernels.gemm_tiled_kernel, configs.INTERPRETER.meta()
    else:
        kernel, meta = _autotuned_tiled(_hardware(out.device)), {}
    batch = out3.shape[0]
    for start in range(0, batch, _MAX_GRID_Y):
        stop = min(start + _MAX_GRID_Y, batch)
        a_part, b_part, c_part = (x3 if x3.shape[0] == 1 else x3[start:stop] for x3 in (a3, b3, c3))
        out_part = out3[start:stop]

        def grid(meta_args, count=stop - start):
            return (triton.cdiv(M, meta_args["BLOCK_M"]) * triton.cdiv(N, meta_args["BLOCK_N"]), count)

        kernel[grid](
            a_ptr=a_part, b_ptr=b_part, c_ptr=c_part, bias_ptr=bias_arg, out_ptr=out_part,
            stride_ab=_batch_stride(a_part), stride_am=a_part.stride(1), stride_ak=a_part.stride(2),
            stride_bb=_batch_stride(b_part), stride_bk=b_part.stride(1), stride_bn=b_part.stride(2),
            stride_cb=_batch_stride(c_part), stride_cm=c_part.stride(1), stride_cn=c_part.stride(2),
            stride_ob=out_part.stride(0), stride_om=out_part.stride(1), stride_on=out_part.stride(2),
            **scalars,
            ACC_DTYPE=tl.int32 if integer else tl.float32,
            INPUT_PRECISION=input_precision,
            **epilogue,
            **meta,
        )  # fmt: skip
        runtime.record_launch(TILED_KERNEL)


def _launch_persistent_tma(op_a, op_b, out, c, bias_arg, scalars, epilogue) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    b_k_major = _tma_layout(op_a, op_b)
    if op_a.dim() != 2 or op_b.dim() != 2 or b_k_major is None:
        raise ValueError(
            "the persistent TMA kernel needs 2-D, row-major A and row- or K-major B, 16-byte aligned"
        )
    if runtime.INTERPRETED:
        cfg = configs.INTERPRETER
        num_programs = configs.INTERPRETER_PERSISTENT_PROGRAMS
        kernel, meta = kernels.gemm_persistent_tma_kernel, cfg.meta()
        a_block = [cfg.block_m, cfg.block_k]
        b_block = [cfg.block_n, cfg.block_k] if b_k_major else [cfg.block_k, cfg.block_n]
    else:
        hardware = _hardware(out.device)
        if not configs.has_tma(hardware):
            raise ValueError(f"the persistent TMA kernel is not used on {hardware.name} (matmul/configs.py)")
        num_programs = hardware.sm_count
        kernel, meta = _autotuned_persistent_tma(hardware), {}
        a_block = b_block = [1, 1]  # placeholders: the autotuner's pre-hook sets each configuration's blocks
    a_desc = TensorDescriptor.from_tensor(op_a, a_block)
    b_desc = TensorDescriptor.from_tensor(op_b.mT if b_k_major else op_b, b_block)
    c_arg = c.expand(out.shape) if c is not None else out

    def grid(meta_args):
        tile_rows = triton.cdiv(scalars["M"], meta_args["BLOCK_M"])
        tile_cols = triton.cdiv(scalars["N"], meta_args["BLOCK_N"])
        return (min(num_programs, tile_rows * tile_cols),)

    kernel[grid](
        a_desc=a_desc, b_desc=b_desc, c_ptr=c_arg, bias_ptr=bias_arg, out_ptr=out,
        stride_cm=c_arg.stride(0), stride_cn=c_arg.stride(1),
        stride_om=out.stride(0), stride_on=out.stride(1),
        **scalars,
        B_K_MAJOR=b_k_major, NUM_PROGRAMS=num_programs,
        **epilogue,
        **meta,
    )  # fmt: skip
    runtime.record_launch(PERSISTENT_TMA_KERNEL)


def _output_shape(a: torch.Tensor, b: torch.Tensor, trans_a: bool, trans_b: bool) -> tuple[int, ...]:
    m = a.shape[-1] if trans_a else a.shape[-2]
    n = b.shape[-2] if trans_b else b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:
        return (m, n)
    batch_a = a.shape[0] if a.dim() == 3 else 1
    batch_b = b.shape[0] if b.dim() == 3 else 1
    return (batch_b if batch_a == 1 else batch_a, m, n)


def _report_gemm(op_a: torch.Tensor, op_b: torch.Tensor, out: torch.Tensor) -> None:
    """Report one GEMM to the op table (llm_speed.ops) for the profiler, whichever path computes it."""
    row = "tensor_core_gemm_int8" if op_a.dtype == torch.int8 else "gemm"  # tensor_core_gemm reports as gemm
    runtime.report_work(row, op_a=op_a, op_b=op_b, out=out)


def gemm_forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype) -> torch.Tensor:
    """The unchecked forward behind the ``llm_speed::gemm`` op (Triton, or the PyTorch fallback)."""
    op_a = a.mT if trans_a else a
    op_b = b.mT if trans_b else b
    if not runtime.triton_runs_on(a.device):
        out = reference.gemm_reference(
            a, b, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
            activation=activation, out_dtype=out_dtype, compute_dtype=torch.float32,
        )  # fmt: skip
        _report_gemm(op_a, op_b, out)
        return out
    out = tensors.new_output(_output_shape(a, b, trans_a, trans_b), out_dtype, a.device)
    return launch_gemm(op_a, op_b, out, alpha=alpha, beta=beta, c=c, bias=bias, activation=activation)


@torch.library.custom_op("llm_speed::gemm", mutates_args=())
def _gemm_op(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    bias: torch.Tensor | None,
    alpha: float,
    beta: float,
    trans_a: bool,
    trans_b: bool,
    activation: str | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    return gemm_forward(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype)


@_gemm_op.register_fake
def _gemm_fake(a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype):
    return a.new_empty(_output_shape(a, b, trans_a, trans_b), dtype=out_dtype)


def _gemm_setup_context(ctx, inputs, output) -> None:
    a, b, c, bias, alpha, beta, trans_a, trans_b, activation, out_dtype = inputs
    ctx.save_for_backward(a, b, c, bias)
    ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation = alpha, beta, trans_a, trans_b, activation


def _sum_to_shape(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum a gradient over the dims that were broadcast to reach it from ``shape``."""
    extra = grad.dim() - len(shape)
    if extra > 0:
        grad = grad.sum(dim=tuple(range(extra)))
    dims = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _gemm_backward(ctx, grad_out):
    """Gradients with the same GEMM kernel. With an activation, the pre-activation z is recomputed by one
    more forward GEMM (in fp32, no activation) instead of being saved: the forward keeps its single write.
    """
    a, b, c, bias = ctx.saved_tensors
    alpha, beta, trans_a, trans_b, activation = ctx.alpha, ctx.beta, ctx.trans_a, ctx.trans_b, ctx.activation
    grad_z = grad_out  # without an activation, used as is: no copy when it has the operands' dtype
    if activation is not None:
        z = _gemm_op(a, b, c, bias, alpha, beta, trans_a, trans_b, None, torch.float32)
        grad_z = grad_out.float() * reference.activation_derivative(z, activation)
    grad_z_in = grad_z.to(a.dtype)  # the kernel's operands share one dtype

    def operand_grad(x, y, trans_x, trans_y, like):
        """alpha * op(x) @ op(y), summed to like's shape; a sum over the batch (like was broadcast) is done on
        fp32 products, so the gradient is rounded to like's dtype once."""
        summed = _output_shape(x, y, trans_x, trans_y) != tuple(like.shape)
        grad = _gemm_op(x, y, None, None, alpha, 0.0, trans_x, trans_y, None,
                        torch.float32 if summed else like.dtype)  # fmt: skip
        return _sum_to_shape(grad, like.shape).to(like.dtype)

    need_a, need_b, need_c, need_bias = ctx.needs_input_grad[:4]
    grad_a = grad_b = grad_c = grad_bias = None
    if need_a:
        if trans_a:  # a holds op(a)^T: grad = op(b) @ grad_z^T
            grad_a = operand_grad(b, grad_z_in, trans_b, True, a)
        else:  # grad = grad_z @ op(b)^T
            grad_a = operand_grad(grad_z_in, b, False, not trans_b, a)
    if need_b:
        if trans_b:  # b holds op(b)^T: grad = grad_z^T @ op(a)
            grad_b = operand_grad(grad_z_in, a, True, trans_a, b)
        else:  # grad = op(a)^T @ grad_z
            grad_b = operand_grad(a, grad_z_in, not trans_a, False, b)
    if need_c and c is not None:
        grad_c = _sum_to_shape(beta * grad_z.float(), c.shape).to(c.dtype)
    if need_bias and bias is not None:
        grad_bias = grad_z.sum(dim=tuple(range(grad_z.dim() - 1)), dtype=torch.float32).to(bias.dtype)
    return grad_a, grad_b, grad_c, grad_bias, None, None, None, None, None, None


_gemm_op.register_autograd(_gemm_backward, setup_context=_gemm_setup_context)


@torch.library.custom_op("llm_speed::gemm_int8", mutates_args=())
def _gemm_int8_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not runtime.triton_runs_on(a.device):
        out = reference.gemm_int8_reference(a, b)
        _report_gemm(a, b, out)
        return out
    out = tensors.new_output(_output_shape(a, b, False, False), torch.int32, a.device)
    return launch_gemm(a, b, out)


@_gemm_int8_op.register_fake
def _gemm_int8_fake(a, b):
    return a.new_empty(_output_shape(a, b, False, False), dtype=torch.int32)


def _checked_gemm(a, b, dtypes, *, alpha, beta, c, trans_a, trans_b, bias, activation, out_dtype):
    """Validate the arguments of a float GEMM (operand dtypes in ``dtypes``) and run the op."""
    shape = check_operands(a, b, trans_a, trans_b, dtypes)
    check_epilogue(
        shape, a, alpha=alpha, beta=beta, c=c, bias=bias, activation=activation, out_dtype=out_dtype
    )
    alpha, beta = float(alpha), float(beta)
    trans_a, trans_b = bool(trans_a), bool(trans_b)  # numpy bools: the op's schema takes Python bools
    c_used = c if beta != 0 else None  # with beta == 0, c is not an input: never read, no gradient
    return _gemm_op(a, b, c_used, bias, alpha, beta, trans_a, trans_b, activation, out_dtype or a.dtype)


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
    trans_a: bool = False,
    trans_b: bool = False,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``activation(alpha * op(a) @ op(b) + beta * c + bias)`` in one Triton kernel; differentiable.

    a, b: 2-D [M, K] @ [K, N] or 3-D batched (a batch of 1, or a 2-D operand, broadcasts like
    ``torch.matmul``);
    op(x) is x, or its transpose over the last two dims when ``trans_x``. Any strides are read in place.
    dtypes float16, bfloat16, float32 (a and b equal), accumulated in fp32; fp32 uses TF32 only when
    PyTorch allows it for CUDA matmuls (:func:`fp32_input_precision`). ``c`` (broadcastable to the output)
    is required when beta != 0 and never read when beta == 0. ``bias`` has shape [N] (any stride);
    ``activation`` is None, "relu", "gelu", "gelu_tanh" or "silu". The output has ``out_dtype`` (default:
    the dtype of a). M, N or K of 0 is allowed: an empty output, or with K == 0 the epilogue applied to a
    zero product.
    """
    return _checked_gemm(
        a, b, FLOAT_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=trans_a, trans_b=trans_b, bias=bias,
        activation=activation, out_dtype=out_dtype,
    )  # fmt: skip


def tensor_core_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    alpha: float = 1.0,
    beta: float = 0.0,
    c: torch.Tensor | None = None,
) -> torch.Tensor:
    """``alpha * a @ b + beta * c`` for float16/bfloat16 a and b, returned in float32 (tensor-core GEMM).

    Same shapes, strides, batching and c rules as :func:`gemm`; differentiable.
    """
    return _checked_gemm(
        a, b, TENSOR_CORE_DTYPES, alpha=alpha, beta=beta, c=c, trans_a=False, trans_b=False, bias=None,
        activation=None, out_dtype=torch.float32,
    )  # fmt: skip


def tensor_core_gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 a and b (2-D or 3-D batched, any strides), accumulated and returned in int32.

    Exact whenever the true result fits in int32, which is guaranteed for K <= 131071 (|a*b| <= 2**14 per
    product); int32 arithmetic wraps, so overflowing partial sums do not spoil a representable result.
    """
    check_operands(a, b, False, False, INT8_DTYPES)
    return _gemm_int8_op(a, b)


__all__ = [
    "fp32_input_precision",
    "gemm",
    "launch_gemm",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
]
