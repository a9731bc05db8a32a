"""``cuda_llm_ops``: the module of the old CUDA project, running on llm-speed's kernels.

Code written for the old project runs unchanged: same names, same positional signatures
(``flash_attention(q, k, v, scale=0.0, is_causal=False)`` with scale 0 meaning ``1/sqrt(head_dim)``;
``gemm(a, b, alpha=1.0, beta=0.0, trans_a=False, trans_b=False)``), errors that are ``RuntimeError`` as the
old project raised (and also the ``ValueError`` / ``TypeError`` llm_speed raises, so either ``except`` works),
plus its helpers and :mod:`cuda_llm_ops.profiler`. docs/compat.md lists what differs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import llm_speed
from cuda_llm_ops import memory as _memory
from llm_speed import helpers as _helpers
from llm_speed.attention import flash as _flash
from llm_speed.attention import naive as _naive
from llm_speed.attention import tiled as _tiled
from llm_speed.attention.checks import validate_attention_inputs as _validate_attention_inputs
from llm_speed.core.args import check_flag as _check_flag
from llm_speed.matmul.checks import check_scalar as _check_scalar
from llm_speed.matmul.checks import validate_gemm_inputs as _validate_gemm_inputs
from llm_speed.matmul.gemm import gemm as _gemm
from llm_speed.matmul.gemm import tensor_core_gemm as _tensor_core_gemm
from llm_speed.matmul.gemm import tensor_core_gemm_int8 as _tensor_core_gemm_int8

__version__ = llm_speed.__version__

__all__ = [
    "AttentionMemoryPool",
    "CudaLlmOpsError",
    "InvalidInputError",
    "InvalidTypeError",
    "analyze_memory_hierarchy",
    "calculate_attention_vram",
    "estimate_attention_memory",
    "find_optimal_batch_size",
    "flash_attention",
    "gemm",
    "naive_attention",
    "optimal_attention",
    "pad_to_alignment",
    "safe_flash_attention",
    "tensor_core_gemm",
    "tensor_core_gemm_int8",
    "tiled_attention",
    "validate_attention_inputs",
    "validate_gemm_inputs",
]


class CudaLlmOpsError(RuntimeError):
    """Base of the input errors of ``cuda_llm_ops`` (the old project raised RuntimeError for bad input)."""


class InvalidInputError(CudaLlmOpsError, ValueError):
    """A bad value or shape: a RuntimeError for old code, a ValueError like llm_speed's."""


class InvalidTypeError(CudaLlmOpsError, TypeError):
    """A bad type or dtype: a RuntimeError for old code, a TypeError like llm_speed's."""


_F = TypeVar("_F", bound=Callable[..., Any])


def _old_errors(function: _F) -> _F:
    """Re-raise llm_speed's ValueError/TypeError as the matching :class:`CudaLlmOpsError` (same message)."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except CudaLlmOpsError:
            raise
        except TypeError as error:
            raise InvalidTypeError(str(error)) from error
        except ValueError as error:
            raise InvalidInputError(str(error)) from error

    return wrapper  # type: ignore[return-value]


def _scale_or_default(scale: Any) -> Any:
    """The old API's ``scale=0.0`` (and None) means ``1/sqrt(head_dim)``; other values pass through."""
    if scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale == 0):
        return None
    return scale


# The old module's error phrases: code that matched them keeps working (our messages contain them).
OLD_RANK_PHRASE = "must be 4D"
OLD_DTYPE_PHRASE = "Only float32 and float16 supported"
OLD_INNER_PHRASE = "Inner dimensions must match"
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _old_dtype_check(name: str, x: Any) -> None:
    if isinstance(x, torch.Tensor) and x.dtype not in _FLOAT_DTYPES:
        raise InvalidTypeError(
            f"{name} has dtype {x.dtype}; accepted: float16, bfloat16, float32 "
            f"(the old module's words: {OLD_DTYPE_PHRASE})"
        )


def _old_attention_checks(q: Any, k: Any, v: Any) -> None:
    """Rank and dtype errors worded as before (with the old phrases); the rest is llm_speed's check."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if isinstance(x, torch.Tensor) and x.dim() != 4:
            raise InvalidInputError(
                f"{name} must have 4 dims [batch, heads, seq_len, head_dim] ({name} {OLD_RANK_PHRASE}), "
                f"got shape {tuple(x.shape)}"
            )
        _old_dtype_check(name, x)


def _old_gemm_checks(a: Any, b: Any, trans_a: Any, trans_b: Any) -> None:
    """The float dtype and inner-dimension errors worded as before; the rest is llm_speed's check."""
    for name, x in (("a", a), ("b", b)):
        _old_dtype_check(name, x)
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or min(a.dim(), b.dim()) < 2:
        return
    trans_a, trans_b = _check_flag("trans_a", trans_a), _check_flag("trans_b", trans_b)
    inner_a = a.shape[-2] if trans_a else a.shape[-1]
    inner_b = b.shape[-1] if trans_b else b.shape[-2]
    if inner_a != inner_b:
        raise InvalidInputError(
            f"{OLD_INNER_PHRASE}: op(a) has {inner_a} columns and op(b) has {inner_b} rows "
            f"(a {tuple(a.shape)}, b {tuple(b.shape)}, trans_a={trans_a}, trans_b={trans_b})"
        )


def _attention(kernel: Callable, impl: str, q, k, v, scale, is_causal) -> torch.Tensor:
    is_causal = _check_flag("is_causal", is_causal)
    _old_attention_checks(q, k, v)
    return kernel(q, k, v, is_causal=is_causal, scale=_scale_or_default(scale))


@_old_errors
def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 0.0,
                    is_causal: bool = False) -> torch.Tensor:
    """Attention with the score matrix in memory (:func:`llm_speed.naive_attention`); scale 0 = default."""
    return _attention(_naive.naive_attention, "naive", q, k, v, scale, is_causal)


@_old_errors
def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 0.0,
                    is_causal: bool = False) -> torch.Tensor:
    """Tiled attention (:func:`llm_speed.tiled_attention`); scale 0 means ``1/sqrt(head_dim)``."""
    return _attention(_tiled.tiled_attention, "tiled", q, k, v, scale, is_causal)


@_old_errors
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float = 0.0,
                    is_causal: bool = False) -> torch.Tensor:
    """FlashAttention (:func:`llm_speed.flash_attention`); scale 0 means ``1/sqrt(head_dim)``.

    q, k, v ``[batch, heads, seq_len, head_dim]``; the output has q's shape and dtype. Beyond the old
    project: bfloat16, GQA/MQA (fewer k/v heads), seq_q != seq_kv (causal mask aligned bottom-right),
    strided inputs, CPU tensors, autograd.
    """
    return _attention(_flash.flash_attention, "flash", q, k, v, scale, is_causal)


def _no_beta(beta: Any, function_name: str) -> None:
    _check_scalar("beta", beta)
    if beta != 0:
        raise ValueError(
            f"beta must be 0 in cuda_llm_ops.{function_name}: there is no C to scale (the old project read "
            f"uninitialised memory here); use llm_speed.{function_name}(a, b, beta=..., c=...); "
            f"got beta={beta}"
        )


@_old_errors
def gemm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0, trans_a: bool = False,
         trans_b: bool = False) -> torch.Tensor:
    """``alpha * op(a) @ op(b)`` (:func:`llm_speed.gemm`); op transposes when ``trans_a`` / ``trans_b``.

    The output has a's dtype, as before. ``beta`` must be 0: the old signature has no C (its docs said
    "currently unused"); for ``beta * c`` call ``llm_speed.gemm`` with ``c=``.
    """
    _no_beta(beta, "gemm")
    _old_gemm_checks(a, b, trans_a, trans_b)
    _validate_gemm_inputs(a, b, trans_a, trans_b)
    return _gemm(a, b, alpha=alpha, trans_a=trans_a, trans_b=trans_b)


@_old_errors
def tensor_core_gemm(a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0, beta: float = 0.0) -> torch.Tensor:
    """``alpha * a @ b`` for float16 (or bfloat16) a and b, returned in float32; ``beta`` must be 0."""
    _no_beta(beta, "tensor_core_gemm")
    _old_gemm_checks(a, b, False, False)
    return _tensor_core_gemm(a, b, alpha=alpha)


@_old_errors
def tensor_core_gemm_int8(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for int8 a and b, exact, returned in int32 (:func:`llm_speed.tensor_core_gemm_int8`)."""
    return _tensor_core_gemm_int8(a, b)


@_old_errors
def validate_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise :class:`CudaLlmOpsError` (RuntimeError and ValueError/TypeError) unless q, k, v are valid."""
    _old_attention_checks(q, k, v)
    _validate_attention_inputs(q, k, v)


@_old_errors
def validate_gemm_inputs(a: torch.Tensor, b: torch.Tensor, trans_a: bool = False,
                         trans_b: bool = False) -> None:
    """Raise :class:`CudaLlmOpsError` (RuntimeError and ValueError/TypeError) unless a, b are valid."""
    _old_gemm_checks(a, b, trans_a, trans_b)
    _validate_gemm_inputs(a, b, trans_a, trans_b)


# --- the old helpers, with this module's errors and scale convention ---

# The old formulas literally (bfloat16 counted as 4 bytes, ...): llm_speed's functions correct them.
estimate_attention_memory = _old_errors(_memory.estimate_attention_memory)
analyze_memory_hierarchy = _memory.analyze_memory_hierarchy
calculate_attention_vram = _old_errors(_memory.calculate_attention_vram)
find_optimal_batch_size = _old_errors(_helpers.find_optimal_batch_size)
pad_to_alignment = _old_errors(_helpers.pad_to_alignment)


@_old_errors
def optimal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                      scale: float = 0.0) -> torch.Tensor:
    """:func:`llm_speed.helpers.optimal_attention` (flash / tiled / naive by sequence length)."""
    is_causal = _check_flag("is_causal", is_causal)
    _old_attention_checks(q, k, v)
    return _helpers.optimal_attention(q, k, v, is_causal, scale=_scale_or_default(scale))


@_old_errors
def safe_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fallback_to_torch: bool = True, *,
                         is_causal: bool = False, scale: float = 0.0) -> torch.Tensor:
    """:func:`llm_speed.helpers.safe_flash_attention`: FlashAttention, SDPA when out of memory."""
    fallback_to_torch = _check_flag("fallback_to_torch", fallback_to_torch)
    is_causal = _check_flag("is_causal", is_causal)
    _old_attention_checks(q, k, v)
    return _helpers.safe_flash_attention(
        q, k, v, fallback_to_torch, is_causal=is_causal, scale=_scale_or_default(scale)
    )


class AttentionMemoryPool(_helpers.AttentionMemoryPool):
    """:class:`llm_speed.helpers.AttentionMemoryPool` raising this module's errors."""

    __init__ = _old_errors(_helpers.AttentionMemoryPool.__init__)
    get_tensors = _old_errors(_helpers.AttentionMemoryPool.get_tensors)


from cuda_llm_ops import profiler  # noqa: E402, F401  (a submodule, as in the old package)
