"""The launcher of :mod:`llm_speed.fused.cross_entropy`: configurations, plans, the chunking of the fused
version, the implementations ``forward`` / ``backward`` / ``linear_*`` (kernels where Triton runs, plain
PyTorch elsewhere) and the memory formula (:func:`memory_estimate`)."""

from __future__ import annotations

import functools

import torch

from ..core import runtime, tensors
from ..core.chunking import linear_cross_entropy_chunk_rows
from ..core.config import KernelConfig
from ..core.kernel_math import rne_by_hand
from ..core.launch import PLAN_CACHE_SIZE, Plan, cdiv, next_power_of_2, plan_cache
from .cross_entropy_kernels import BACKWARD, FORWARD, REDUCE, SCALE
from .reference import softcapped
from .swiglu import config as elementwise_config

REDUCTIONS = ("mean", "sum", "none")

MAX_BLOCK_V = 4096  # vocabulary entries a program holds at once (the loop walks the rest)
MAX_BLOCK_REDUCE = 1024  # rows the reduction adds per step


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def default_chunk_rows(n: int, hidden: int, vocab: int) -> int:
    """Rows per chunk so that a chunk's logits ``[C, V]`` are about as large as ``hidden [N, H]`` (Liger), but
    at least 2^16 logits and 1024 rows (the GEMMs' intensity): ``C = next_pow2(max(ceil(N / ceil(V / H)),
    ceil(2^16 / V), 1024))``, at most N (:func:`llm_speed.core.chunking.linear_cross_entropy_chunk_rows`,
    which the model prices too)."""
    return linear_cross_entropy_chunk_rows(n, hidden, vocab)


def memory_estimate(
    n: int, hidden: int, vocab: int, itemsize: int = 2, chunk_rows: int | None = None
) -> dict:
    """Bytes the loss needs beyond its inputs and gradients: eager ``2 N V b`` against fused ``C V b + 8 N``.

    Returns ``{"unfused_bytes", "fused_bytes", "chunk_rows", "saving"}`` (``saving`` = unfused / fused). A
    formula (see the module docstring), not a measurement.
    """
    chunk = chunk_rows or default_chunk_rows(n, hidden, vocab)
    unfused = 2 * n * vocab * itemsize
    fused = chunk * vocab * itemsize + 8 * n
    return {"unfused_bytes": unfused, "fused_bytes": fused, "chunk_rows": chunk, "saving": unfused / fused}


@functools.cache
def config(vocab: int) -> KernelConfig:
    """Forward and backward: one row per program (``block_m`` 1), ``block_n`` vocabulary entries per step
    (vocab padded to a power of two, at most :data:`MAX_BLOCK_V`)."""
    return KernelConfig(1, min(MAX_BLOCK_V, next_power_of_2(vocab)), num_warps=8, num_stages=1)


@functools.cache
def reduce_config(n: int) -> KernelConfig:
    """The reduction: one program adding ``block_n`` rows per step (``n`` padded to a power of two, at most
    :data:`MAX_BLOCK_REDUCE`)."""
    block = min(MAX_BLOCK_REDUCE, next_power_of_2(n))
    return KernelConfig(1, block, num_warps=max(1, min(4, block // 256)), num_stages=1)


@functools.lru_cache(maxsize=PLAN_CACHE_SIZE)
def _chunk_sizes(n: int, chunk_rows: int) -> tuple[int, ...]:
    """Rows of each chunk: ``chunk_rows``, the last one what is left."""
    return (chunk_rows,) * (n // chunk_rows) + ((n % chunk_rows,) if n % chunk_rows else ())


def _row_chunks(t: torch.Tensor, sizes: tuple[int, ...]):
    """Views of ``t``'s rows, one per chunk (``t`` itself for a single chunk)."""
    return (t,) if len(sizes) == 1 else t.split_with_sizes(sizes)


def stats_size(n: int, reduced: bool, has_z: bool) -> int:
    """Entries of the float32 statistics the forward keeps for the backward (what they are:
    :mod:`llm_speed.fused.cross_entropy_kernels`)."""
    return (3 * n + (n if has_z else 0) + 2) if reduced else 2 * n


@plan_cache
def _forward_plans(
    n: int, chunk_rows: int, vocab: int, stride_l: int, ignore_index: int, flags: tuple, reduction: str,
    dtypes: tuple, device: torch.device, divisors_first: bool = False,
) -> tuple[tuple[int, ...], tuple[Plan, ...], Plan | None, Plan | None]:  # fmt: skip
    """(chunk sizes, one plan per chunk, the reduction's plan or None, the plan writing the divisors alone
    before the chunks or None): one lookup per call. A chunk's plan fixes the chunk's first row, so a launch
    takes whole target, loss and stats tensors (no per-call views). flags: softcap, class weights, z-loss,
    z-loss returned. dtypes: logits, target, class weights, loss, z. divisors_first: a reduced loss whose
    forward also computes the gradients of more than one chunk (all but the last chunk's read the divisors
    before the reduction runs)."""
    has_softcap, has_weight, has_z, store_z = flags
    reduced = reduction != "none"
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(FORWARD.plan(
            (rows,), row0=start, n=n, stride_l=stride_l, vocab=vocab, ignore_index=ignore_index,
            BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap, HAS_WEIGHT=has_weight, HAS_Z=has_z, REDUCED=reduced,
            STORE_Z=store_z, RNE_BY_HAND=rne_by_hand(dtypes[3]), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ))  # fmt: skip
    reduce = divisors = None
    if reduced:
        rcfg = reduce_config(n)
        reduce, divisors = (REDUCE.plan(
            (1,), n=n, vocab=vocab, ignore_index=ignore_index, MEAN=reduction == "mean",
            HAS_WEIGHT=has_weight, HAS_Z=has_z, STORE_Z=store_z, SUMS=sums, BLOCK=rcfg.block_n,
            RNE_BY_HAND=rne_by_hand(dtypes[3]), num_warps=rcfg.num_warps, num_stages=rcfg.num_stages,
        ) if sums or divisors_first else None for sums in (True, False))  # fmt: skip
    return _chunk_sizes(n, chunk_rows), tuple(plans), reduce, divisors


@plan_cache
def _backward_plans(
    n: int, chunk_rows: int, vocab: int, strides: tuple, ignore_index: int, flags: tuple, reduced: bool,
    dtypes: tuple, device: torch.device, unit_grad: bool = False,
) -> tuple[Plan, ...]:  # fmt: skip
    """One plan per chunk. strides: logits, dlogits, grad rows. flags: softcap, class weights, z-loss. dtypes:
    logits, dlogits, target, class weights, grad. unit_grad: the gradient of a reduced loss taken as 1 (the
    forward that computes the gradients; the backward scales them)."""
    has_softcap, has_weight, has_z = flags
    stride_l, stride_d, stride_g = strides
    cfg = config(vocab)
    plans = []
    for start, rows in zip(range(0, n, chunk_rows), _chunk_sizes(n, chunk_rows), strict=True):
        plans.append(BACKWARD.plan(
            (rows,), row0=start, n=n, stride_l=stride_l, stride_d=stride_d, stride_g=stride_g, vocab=vocab,
            ignore_index=ignore_index, BLOCK_V=cfg.block_n, HAS_SOFTCAP=has_softcap, HAS_WEIGHT=has_weight,
            HAS_Z=has_z, REDUCED=reduced, UNIT_GRAD=unit_grad, RNE_BY_HAND=rne_by_hand(dtypes[1]),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        ))  # fmt: skip
    return tuple(plans)


def _chunk_logits(hidden_rows, weight_t, bias):
    """The logits ``[C, V]`` of a chunk of rows of hidden (contiguous, in the inputs' dtype); ``weight_t`` is
    the head transposed, ``[H, V]``."""
    return torch.mm(hidden_rows, weight_t) if bias is None else torch.addmm(bias, hidden_rows, weight_t)


def _check_targets(target, vocab, ignore_index):
    """ValueError naming the first target outside ``[0, vocab)`` that is not ``ignore_index`` (reads the
    targets on the host: only where :func:`llm_speed.core.runtime.check_values` allows it)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab))
    if bool(bad.any()):
        first = int(target[bad][0])
        raise ValueError(
            f"target holds {first}; accepted: 0 <= target < {vocab} (vocab) or ignore_index {ignore_index}"
        )


# PyTorch on the CPU (no interpreter): the kernels' formulas, chunk by chunk, in float32.


def _rows_torch(logits, t, class_weight, ignore_index, smoothing, softcap, z_scale):
    """(cross-entropy rows, z-loss rows, largest logit m, log(sum exp(z - m))) of a chunk, float32."""
    z = softcapped(logits, softcap)
    w = None if class_weight is None else class_weight.to(z.dtype)
    ce = torch.nn.functional.cross_entropy(
        z, t, weight=w, ignore_index=ignore_index, reduction="none", label_smoothing=smoothing
    )
    m = z.amax(-1)
    log_s = torch.logsumexp(z - m[:, None], -1)
    zl = torch.where(t != ignore_index, z_scale * (m + log_s).square(), 0.0)
    return ce.float(), zl.float(), m.float(), log_s.float()


def _forward_torch(chunks, target, class_weight, ignore_index, smoothing, softcap, z_scale, reduction,
                   sizes, loss_dtype, return_z):  # fmt: skip
    n = target.shape[0]
    device = target.device
    ce_rows = torch.empty(n, dtype=torch.float32, device=device)
    z_rows = torch.empty(n, dtype=torch.float32, device=device)
    lse = torch.empty(2, n, dtype=torch.float32, device=device)  # m, then log(s): the kernels' stats
    chunks = iter(chunks)  # one chunk alive at a time (see _forward)
    for t, c, zz, mm, ll in zip(
        _row_chunks(target, sizes), _row_chunks(ce_rows, sizes), _row_chunks(z_rows, sizes),
        _row_chunks(lse[0], sizes), _row_chunks(lse[1], sizes), strict=True,
    ):  # fmt: skip
        logits = next(chunks)
        for out, value in zip((c, zz, mm, ll), _rows_torch(logits, t, class_weight, ignore_index, smoothing,
                                                           softcap, z_scale), strict=True):  # fmt: skip
            out.copy_(value)
        del logits, value
    if reduction == "none":
        z = z_rows.to(loss_dtype) if return_z else z_rows.new_empty(0, dtype=loss_dtype)
        return (ce_rows + z_rows).to(loss_dtype), z, lse.reshape(-1)
    kept = target != ignore_index
    if reduction == "mean":
        ce_div = kept.sum().to(torch.float32)
        if class_weight is not None:
            safe = torch.where(kept, target, 0)
            ce_div = torch.where(kept, class_weight.float()[safe], 0.0).sum()
        ce_div = torch.where(ce_div == 0, float("inf"), ce_div)  # a divisor of 0: loss 0, zero gradients
        z_div = kept.sum().clamp(min=1).to(torch.float32)
    else:
        ce_div = z_div = torch.ones((), dtype=torch.float32, device=device)
    z = z_rows.sum() / z_div
    loss = (ce_rows.sum() / ce_div + z).to(loss_dtype)
    has_z = z_scale > 0
    stats = torch.cat((lse.reshape(-1), ce_rows, *((z_rows,) if has_z else ()), ce_div.reshape(1),
                       z_div.reshape(1)))  # fmt: skip
    return loss, (z.to(loss_dtype) if return_z else z.new_empty(0, dtype=loss_dtype)), stats


def _dlogits_torch(logits, t, class_weight, m, log_s, g_ce, g_z, ignore_index, smoothing, softcap, z_scale):
    vocab = logits.shape[1]
    z = softcapped(logits, softcap)
    p = torch.exp((z - m[:, None].to(z.dtype)) - log_s[:, None].to(z.dtype))
    lse = m + log_s
    keep = t != ignore_index
    g_ce = torch.where(keep, g_ce, 0.0).to(z.dtype)[:, None]
    g_z = torch.where(keep, g_z, 0.0).to(z.dtype)[:, None]
    if class_weight is None:
        w = torch.ones(vocab, dtype=z.dtype, device=z.device)
    else:
        w = class_weight.to(z.dtype)
    w_t = w[torch.where(keep, t, 0)][:, None]
    dz = g_ce * (((1 - smoothing) * w_t + smoothing * w.sum() / vocab) * p - smoothing / vocab * w)
    dz = dz + g_z * 2 * z_scale * lse[:, None].to(z.dtype) * p
    rows = torch.arange(len(t), device=t.device)[keep]
    dz[rows, t[keep]] -= (g_ce * (1 - smoothing) * w_t)[keep, 0]
    if softcap > 0:
        dz = dz * (1 - (z / softcap).square())
    return dz.to(logits.dtype)


def _torch_row_gradients(grad, stats, n, reduced, has_z):
    """(g_ce, g_z) per row, float32, of the loss gradient ``grad`` (PyTorch fallback)."""
    if not reduced:
        g = grad.float()
        return g, g
    div_at = 3 * n + (n if has_z else 0)
    g = grad.float()
    return (g / stats[div_at]).expand(n), (g / stats[div_at + 1]).expand(n)


def _forward(
    chunks, n, vocab, stride_l, logits_dtype, target, class_weight, ignore_index, smoothing, softcap, z_scale,
    chunk_rows, reduction, loss_dtype, return_z, device, after_chunk=None,
):  # fmt: skip
    """The kernels' forward over the logits chunks ``chunks`` (an iterable, each made when asked for):
    (loss, z, stats). Targets are checked on the host only where
    :func:`llm_speed.core.runtime.check_values` allows it (and always by the PyTorch fallback); otherwise an
    invalid one makes its row's loss NaN. ``after_chunk(i, logits, stats)`` (a reduced loss, the kernels
    only) runs after chunk i's row kernel, the reduction's divisors already in stats (the last chunk's: after
    the whole reduction)."""
    triton_runs = runtime.triton_runs_on(device)
    if not triton_runs or runtime.check_values(device):
        _check_targets(target, vocab, ignore_index)
    reduced = reduction != "none"
    has_z = z_scale > 0
    if n == 0 or not triton_runs:
        sizes = _chunk_sizes(n, chunk_rows) if n else ()
        if n == 0:  # nothing to compute: loss 0 (an all-ignored batch's), no statistics to keep but divisors
            empty = torch.zeros(0, dtype=torch.float32, device=device)
            loss = torch.zeros(() if reduced else (0,), dtype=loss_dtype, device=device)
            z = loss.clone() if return_z else loss.new_empty(0)
            stats = torch.ones(stats_size(0, reduced, has_z), dtype=torch.float32, device=device)
            return loss, z, stats if reduced else empty
        return _forward_torch(chunks, target, class_weight, ignore_index, smoothing, softcap, z_scale,
                              reduction, sizes, loss_dtype, return_z)  # fmt: skip
    stats = tensors.new_output((stats_size(n, reduced, has_z),), torch.float32, device)
    loss = tensors.new_output(() if reduced else (n,), loss_dtype, device)
    z = tensors.new_output((() if reduced else (n,)) if return_z else (0,), loss_dtype, device)
    has_weight = class_weight is not None
    weight_arg = class_weight if has_weight else stats  # never read without class weights
    dtypes = (logits_dtype, target.dtype, class_weight.dtype if has_weight else None, loss_dtype)
    flags = (softcap > 0, has_weight, has_z, return_z)
    # A chunk's gradients divide by the reduction's divisors: the reduction writes them after the last
    # chunk's row kernel, before that chunk's gradients; earlier chunks need them first (one launch more).
    sizes, plans, reduce, divisors = _forward_plans(
        n, chunk_rows, vocab, stride_l, ignore_index, flags, reduction, dtypes, device,
        after_chunk is not None and n > chunk_rows,
    )  # fmt: skip
    z_arg = z if return_z else loss
    if divisors is not None:
        divisors.launch(stats_ptr=stats, target_ptr=target, weight_ptr=weight_arg, out_ptr=loss, z_ptr=z_arg)
    # One chunk alive at a time: each is dropped before the next one's GEMM (a zip over the chunks would
    # hold the last one in its reused result tuple while making the next).
    chunks = iter(chunks)
    last = len(plans) - 1
    for i, plan in enumerate(plans):
        logits = next(chunks)
        plan.launch(
            logits_ptr=logits, target_ptr=target, weight_ptr=weight_arg, loss_ptr=loss, z_ptr=z_arg,
            stats_ptr=stats, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        if i == last and reduce is not None:
            reduce.launch(
                stats_ptr=stats, target_ptr=target, weight_ptr=weight_arg, out_ptr=loss, z_ptr=z_arg
            )  # fmt: skip
        if after_chunk is not None:
            after_chunk(i, logits, stats)
        del logits
    return loss, z, stats


def _dlogits(
    plan, logits, dlogits, rows, target, class_weight, stats, grad, g_rows, ignore_index, smoothing, softcap,
    z_scale,
):  # fmt: skip
    """d loss / d logits of one chunk into ``dlogits``: the kernel (``plan``), or PyTorch (``g_rows``: the
    per-row gradients of the fallback); returns the gradient tensor."""
    if plan is not None:
        weight_arg = class_weight if class_weight is not None else stats
        plan.launch(
            logits_ptr=logits, dlogits_ptr=dlogits, target_ptr=target, weight_ptr=weight_arg, stats_ptr=stats,
            grad_ptr=grad, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        return dlogits
    g_ce, g_z = g_rows
    n = target.shape[0]
    return _dlogits_torch(logits, target[rows], class_weight, stats[:n][rows], stats[n : 2 * n][rows],
                          g_ce[rows], g_z[rows], ignore_index, smoothing, softcap, z_scale)  # fmt: skip


def _backward_setup(grad, n, vocab, strides, target, class_weight, stats, ignore_index, softcap, z_scale,
                    chunk_rows, reduction, dtypes, device):  # fmt: skip
    """(plans or None per chunk, the fallback's per-row gradients or None)."""
    reduced = reduction != "none"
    has_z = z_scale > 0
    sizes = _chunk_sizes(n, chunk_rows)
    if runtime.triton_runs_on(device):
        flags = (softcap > 0, class_weight is not None, has_z)
        plans = _backward_plans(n, chunk_rows, vocab, strides, ignore_index, flags, reduced, dtypes, device)
        return plans, None
    return (None,) * len(sizes), _torch_row_gradients(grad, stats, n, reduced, has_z)


def linear_forward(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float,
    z_scale: float, chunk_rows: int, reduction: str, loss_dtype: torch.dtype, return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, z-loss, stats) of ``cross_entropy(hidden @ weight.T + bias, target)``, chunk by chunk; reports
    its work. loss and z-loss (empty unless ``return_z``) in ``loss_dtype``, ``[N]`` for ``reduction="none"``,
    else scalars; stats as :mod:`llm_speed.fused.cross_entropy_kernels` says."""
    n, vocab = hidden.shape[0], weight.shape[0]
    target = target.contiguous()
    if n:
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
    sizes = _chunk_sizes(n, chunk_rows) if n else ()
    weight_t = weight.t()
    chunks = (_chunk_logits(h, weight_t, bias) for h in (_row_chunks(hidden, sizes) if n else ()))
    return _forward(
        chunks, n, vocab, vocab, hidden.dtype, target, class_weight, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction, loss_dtype, return_z, hidden.device,
    )  # fmt: skip


def zero_bias_grad(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A dbias no row contributes to: zeros of ``[vocab]``, or without a bias an empty tensor (the autograd
    node returns None for it: no memset of ``[vocab]`` per backward)."""
    return weight.new_empty(0) if bias is None else weight.new_zeros((weight.shape[0],))


def linear_backward(
    grad: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
    bias: torch.Tensor | None, class_weight: torch.Tensor | None, stats: torch.Tensor, ignore_index: int,
    label_smoothing: float, softcap: float, z_scale: float, chunk_rows: int, reduction: str,
    accum_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dhidden, dweight, dbias) of :func:`linear_forward` for the gradient ``grad`` of its loss; reports its
    work. Without a bias, dbias is an empty tensor (nobody reads it: no memset of ``[vocab]``).
    ``accum_float32``: dweight summed over the chunks in float32 (:func:`add_chunk`)."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    target = target.contiguous()
    if n:
        runtime.report_work("fused_linear_cross_entropy_backward", hidden=hidden, weight=weight)
    dhidden = tensors.new_output(hidden.shape, hidden.dtype, device)
    if n == 0:
        return dhidden, torch.zeros_like(weight), zero_bias_grad(weight, bias)
    sizes = _chunk_sizes(n, chunk_rows)
    stride_g = 0 if reduction != "none" else grad.stride(0)
    dtypes = (hidden.dtype, hidden.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              grad.dtype)  # fmt: skip
    plans, g_rows = _backward_setup(
        grad, n, vocab, (vocab, vocab, stride_g), target, class_weight, stats, ignore_index, softcap, z_scale,
        chunk_rows, reduction, dtypes, device,
    )  # fmt: skip
    dweight = dbias = None
    weight_t = weight.t()
    for i, (h, dh) in enumerate(zip(_row_chunks(hidden, sizes), _row_chunks(dhidden, sizes), strict=True)):
        logits = _chunk_logits(h, weight_t, bias)
        rows = slice(i * chunk_rows, i * chunk_rows + sizes[i])
        dlogits = _dlogits(plans[i], logits, logits, rows, target, class_weight, stats, grad, g_rows,
                           ignore_index, label_smoothing, softcap, z_scale)  # fmt: skip
        torch.mm(dlogits, weight, out=dh)
        dweight = add_chunk(dweight, dlogits, h, accum_float32)
        if bias is not None:
            part = dlogits.sum(0, dtype=torch.float32)
            dbias = part if dbias is None else dbias.add_(part)
        del logits, dlogits  # before the next chunk's GEMM (else two chunks are alive at it)
    dweight = dweight.to(weight.dtype)  # (accumulated in float32: one rounding at the end)
    return dhidden, dweight, zero_bias_grad(weight, bias) if bias is None else dbias.to(weight.dtype)


def add_chunk(summed: torch.Tensor | None, dlogits: torch.Tensor, h: torch.Tensor,
              accum_float32: bool) -> torch.Tensor:  # fmt: skip
    """The weight gradient summed over the chunks so far plus this chunk's ``dlogits^T h``. In weight's dtype
    (Liger's default): one GEMM epilogue a chunk (float32 inside), the sum rounded to 16 bits at every chunk,
    so its error grows with their number. ``accum_float32`` (Liger's ``accum_dtype=torch.float32``): each
    chunk's product rounded once, added to a float32 sum (V x H x 4 bytes more while it is made)."""
    if accum_float32 and h.dtype != torch.float32:
        part = torch.mm(dlogits.t(), h)
        return part.float() if summed is None else summed.add_(part)
    return torch.mm(dlogits.t(), h) if summed is None else summed.addmm_(dlogits.t(), h)


def linear_forward_grads(
    hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: torch.Tensor | None,
    class_weight: torch.Tensor | None, ignore_index: int, label_smoothing: float, softcap: float,
    z_scale: float, chunk_rows: int, reduction: str, loss_dtype: torch.dtype, return_z: bool,
    need_dhidden: bool, need_dweight: bool, need_dbias: bool, accum_float32: bool = False,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """(loss, z-loss, stats, dhidden, dweight, dbias): :func:`linear_forward`'s three, and for a reduced loss
    the gradients asked for (``need_*``) of a loss gradient of 1, made chunk by chunk while each chunk's
    logits exist (three GEMMs a chunk, where :func:`linear_forward` then :func:`linear_backward` take four:
    the backward makes the logits again); :func:`scale_grads` turns them into the gradients of the loss
    gradient. A gradient not asked for is an empty tensor and costs no GEMM; dbias is float32. Reports its
    work."""
    n, vocab = hidden.shape[0], weight.shape[0]
    device = hidden.device
    if (need_dhidden or need_dweight or need_dbias) and reduction == "none":
        raise ValueError(
            "need_dhidden, need_dweight, need_dbias: the forward makes the gradients of a reduced loss only "
            "('mean' or 'sum'); reduction='none' takes its per-row gradient in the backward"
        )
    if not (need_dhidden or need_dweight or need_dbias):  # the plain forward (any reduction)
        loss = linear_forward(hidden, weight, target, bias, class_weight, ignore_index, label_smoothing,
                              softcap, z_scale, chunk_rows, reduction, loss_dtype, return_z)  # fmt: skip
        return (*loss, hidden.new_empty(0), weight.new_empty(0), weight.new_empty(0, dtype=torch.float32))
    target = target.contiguous()
    if n == 0 or not runtime.triton_runs_on(device):
        # nothing to chunk, or the PyTorch fallback: the forward, then the backward of a loss gradient of 1
        loss, z, stats = linear_forward(
            hidden, weight, target, bias, class_weight, ignore_index, label_smoothing, softcap, z_scale,
            chunk_rows, reduction, loss_dtype, return_z,
        )  # fmt: skip
        one = torch.ones((), dtype=loss_dtype, device=device)
        dhidden, dweight, dbias = linear_backward(
            one, hidden, weight, target, bias, class_weight, stats, ignore_index, label_smoothing, softcap,
            z_scale, chunk_rows, reduction, accum_float32,
        )  # fmt: skip
        return (loss, z, stats, dhidden if need_dhidden else hidden.new_empty(0),
                dweight if need_dweight else weight.new_empty(0),
                dbias.float() if need_dbias else weight.new_empty(0, dtype=torch.float32))  # fmt: skip
    runtime.report_work(
        "fused_linear_cross_entropy", hidden=hidden, weight=weight, gradients=(need_dhidden, need_dweight)
    )  # fmt: skip
    sizes = _chunk_sizes(n, chunk_rows)
    flags = (softcap > 0, class_weight is not None, z_scale > 0)
    dtypes = (hidden.dtype, hidden.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              torch.float32)  # fmt: skip
    plans = _backward_plans(
        n, chunk_rows, vocab, (vocab, vocab, 0), ignore_index, flags, True, dtypes, device, unit_grad=True
    )  # fmt: skip
    hidden_rows = _row_chunks(hidden, sizes)
    dhidden = tensors.new_output(hidden.shape, hidden.dtype, device) if need_dhidden else hidden.new_empty(0)
    dhidden_rows = _row_chunks(dhidden, sizes) if need_dhidden else None
    summed = [None, None]  # dweight, dbias: the first chunk's product, then the sum so far

    def gradients(i, logits, stats):
        # d loss / d logits in place of the logits (grad_ptr unread: UNIT_GRAD)
        _dlogits(plans[i], logits, logits, None, target, class_weight, stats, stats, None, ignore_index,
                 label_smoothing, softcap, z_scale)  # fmt: skip
        if need_dhidden:
            torch.mm(logits, weight, out=dhidden_rows[i])
        if need_dweight:  # as linear_backward
            summed[0] = add_chunk(summed[0], logits, hidden_rows[i], accum_float32)
        if need_dbias:
            part = logits.sum(0, dtype=torch.float32)
            summed[1] = part if summed[1] is None else summed[1].add_(part)

    weight_t = weight.t()
    chunks = (_chunk_logits(h, weight_t, bias) for h in hidden_rows)
    loss, z, stats = _forward(
        chunks, n, vocab, vocab, hidden.dtype, target, class_weight, ignore_index, label_smoothing, softcap,
        z_scale, chunk_rows, reduction, loss_dtype, return_z, device, after_chunk=gradients,
    )  # fmt: skip
    dweight = summed[0].to(weight.dtype) if need_dweight else weight.new_empty(0)
    dbias = summed[1] if need_dbias else weight.new_empty(0, dtype=torch.float32)
    return loss, z, stats, dhidden, dweight, dbias


@plan_cache
def _scale_plan(numel: int, dtypes: tuple, device: torch.device) -> Plan:
    """The scaling of ``numel`` elements (the elementwise ops' blocks: :func:`llm_speed.fused.swiglu.config`);
    dtypes: in, out."""
    cfg = elementwise_config(numel)
    return SCALE.plan(
        (cdiv(numel, cfg.block_n),), numel=numel, BLOCK=cfg.block_n, RNE_BY_HAND=rne_by_hand(dtypes[1]),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def _scaled(grad: torch.Tensor, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = x * grad (float32 maths, one rounding to out's dtype); out may be x."""
    if x.numel() == 0:
        return out
    if runtime.triton_runs_on(x.device):
        _scale_plan(x.numel(), (x.dtype, out.dtype), x.device).launch(x_ptr=x, out_ptr=out, grad_ptr=grad)
    else:
        out.copy_(x.float() * grad.float())
    return out


def scale_grads(
    grad: torch.Tensor, dhidden: torch.Tensor, dweight: torch.Tensor, dbias: torch.Tensor,
    in_place: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(dhidden, dweight, dbias) of :func:`linear_forward_grads` times the loss gradient ``grad`` (a scalar),
    in float32 maths rounded once: new tensors, or (``in_place``) dhidden and dweight themselves; dbias (kept
    in float32) in weight's dtype, as :func:`linear_backward` gives it. Empty tensors (gradients not needed)
    stay empty. Reports its work."""
    runtime.report_work("fused_linear_cross_entropy_backward", scaled=(dhidden, dweight, dbias))
    device = dweight.device

    def out(x, dtype):
        return x if in_place and dtype == x.dtype else tensors.new_output(x.shape, dtype, device)

    return (_scaled(grad, dhidden, out(dhidden, dhidden.dtype)),
            _scaled(grad, dweight, out(dweight, dweight.dtype)),
            _scaled(grad, dbias, out(dbias, dweight.dtype)))  # fmt: skip


def forward(
    logits: torch.Tensor, target: torch.Tensor, class_weight: torch.Tensor | None, ignore_index: int,
    label_smoothing: float, softcap: float, z_scale: float, reduction: str, loss_dtype: torch.dtype,
    return_z: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """(loss, z-loss, stats) of ``cross_entropy(logits, target)`` (logits ``[N, V]``, last dim contiguous) in
    one launch over the rows (and one for a reduction); reports its work."""
    n, vocab = logits.shape
    target = target.contiguous()
    if n:
        runtime.report_work("cross_entropy", logits=logits)
    return _forward(
        (logits,) if n else (), n, vocab, logits.stride(0), logits.dtype, target, class_weight, ignore_index,
        label_smoothing, softcap, z_scale, max(n, 1), reduction, loss_dtype, return_z, logits.device,
    )  # fmt: skip


def backward(
    grad: torch.Tensor, logits: torch.Tensor, target: torch.Tensor, class_weight: torch.Tensor | None,
    stats: torch.Tensor, ignore_index: int, label_smoothing: float, softcap: float, z_scale: float,
    reduction: str,
) -> torch.Tensor:  # fmt: skip
    """d loss / d logits of :func:`forward`, a new contiguous tensor in logits' dtype; reports its work."""
    n, vocab = logits.shape
    device = logits.device
    target = target.contiguous()
    if n:
        runtime.report_work("cross_entropy_backward", logits=logits)
    dlogits = tensors.new_output((n, vocab), logits.dtype, device)
    if n == 0:
        return dlogits
    stride_g = 0 if reduction != "none" else grad.stride(0)
    dtypes = (logits.dtype, logits.dtype, target.dtype, None if class_weight is None else class_weight.dtype,
              grad.dtype)  # fmt: skip
    plans, g_rows = _backward_setup(
        grad, n, vocab, (logits.stride(0), vocab, stride_g), target, class_weight, stats, ignore_index,
        softcap, z_scale, n, reduction, dtypes, device,
    )  # fmt: skip
    out = _dlogits(plans[0], logits, dlogits, slice(0, n), target, class_weight, stats, grad, g_rows,
                   ignore_index, label_smoothing, softcap, z_scale)  # fmt: skip
    if out is not dlogits:
        dlogits.copy_(out)
    return dlogits


class LinearCall:
    """A :func:`~llm_speed.fused.cross_entropy.fused_linear_cross_entropy` call without bias, class weights or
    softcap whose metadata passed every check before (``llm_speed.fused.cross_entropy._LINEAR_CALLS``): its
    numbers as the op takes them (ignore_index, label_smoothing, softcap, z_scale, chunk_rows) and, where its
    rows make one chunk (1 <= N <= chunk_rows) on a device the kernels run on, the plans of a lean path: one
    GEMM and the row and reduction kernels, and for a reduced loss with grad the gradient kernel and two
    GEMMs, without the chunk loop's machinery or a plan lookup (host time on the development CPU, launch
    stubbed, 8 x 16 x 64: with grad 40-46 -> 28.5-31 us, inference 14.5 -> 12.4 us; docs/guides/host-path.md).
    The same launches, GEMMs and dtypes as the chunk loop: bit for bit its results."""

    __slots__ = ("numbers", "loss_dtype", "return_z", "loss_shape", "device", "forward_plan", "reduce_plan",
                 "gradient_plan", "stats_size")  # fmt: skip

    def __init__(self, hidden, weight, target, numbers, reduction, loss_dtype, return_z):
        ignore_index, _, softcap, z_scale, chunk_rows = numbers
        n, vocab = hidden.shape[0], weight.shape[0]
        reduced = reduction != "none"
        self.numbers, self.loss_dtype, self.return_z = numbers, loss_dtype, return_z
        self.loss_shape = () if reduced else (n,)
        self.device = device = hidden.device
        self.forward_plan = self.reduce_plan = self.gradient_plan = None
        if not (0 < n <= chunk_rows and runtime.triton_runs_on(device)):
            return
        has_z = z_scale > 0
        _, (self.forward_plan,), self.reduce_plan, _ = _forward_plans(
            n, chunk_rows, vocab, vocab, ignore_index, (softcap > 0, False, has_z, return_z), reduction,
            (hidden.dtype, target.dtype, None, loss_dtype), device,
        )  # fmt: skip
        if reduced:  # the gradients read the divisors the reduction leaves in stats
            dtypes = (hidden.dtype, hidden.dtype, target.dtype, None, torch.float32)
            (self.gradient_plan,) = _backward_plans(
                n, chunk_rows, vocab, (vocab, vocab, 0), ignore_index, (softcap > 0, False, has_z), True,
                dtypes, device, unit_grad=True,
            )  # fmt: skip
        self.stats_size = stats_size(n, reduced, has_z)

    def _loss(self, hidden, weight, target, z_alone):
        """(loss, z, stats, logits); z the loss itself unless asked for or ``z_alone``."""
        ignore_index, smoothing, softcap, z_scale, _ = self.numbers
        device = self.device
        if runtime.check_values(device):
            _check_targets(target, weight.shape[0], ignore_index)
        stats = tensors.new_output((self.stats_size,), torch.float32, device)
        loss = tensors.new_output(self.loss_shape, self.loss_dtype, device)
        z = z_arg = loss  # (z_ptr: the loss when unasked, as _forward)
        if self.return_z:
            z = z_arg = tensors.new_output(loss.shape, self.loss_dtype, device)
        elif z_alone:
            z = tensors.new_output((0,), self.loss_dtype, device)
        logits = _chunk_logits(hidden, weight.t(), None)
        self.forward_plan.launch(
            logits_ptr=logits, target_ptr=target, weight_ptr=stats, loss_ptr=loss, z_ptr=z_arg,
            stats_ptr=stats, smoothing=smoothing, softcap=softcap, z_scale=z_scale,
        )  # fmt: skip
        if self.reduce_plan is not None:
            self.reduce_plan.launch(
                stats_ptr=stats, target_ptr=target, weight_ptr=stats, out_ptr=loss, z_ptr=z_arg
            )  # fmt: skip
        return loss, z, stats, logits

    def __call__(self, hidden, weight, target):
        """:func:`linear_forward`'s loss (with ``return_z``, (loss, z-loss)): the inference call."""
        runtime.report_work("fused_linear_cross_entropy", hidden=hidden, weight=weight)
        loss, z, _, _ = self._loss(hidden, weight, target.contiguous(), False)
        return (loss, z) if self.return_z else loss

    def forward(self, hidden, weight, target, bias, class_weight, *args):
        """:func:`linear_forward_grads` of a reduced loss with a gradient asked for (the op's arguments;
        without a bias never ``need_dbias``)."""
        need_dhidden, need_dweight, _ = args[-3:]
        ignore_index, smoothing, softcap, z_scale, _ = self.numbers
        runtime.report_work(
            "fused_linear_cross_entropy", hidden=hidden, weight=weight, gradients=(need_dhidden, need_dweight)
        )  # fmt: skip
        target = target.contiguous()
        loss, z, stats, logits = self._loss(hidden, weight, target, True)
        # d loss / d logits in place of the logits (grad_ptr unread: UNIT_GRAD), then its two GEMMs
        _dlogits(self.gradient_plan, logits, logits, None, target, None, stats, stats, None, ignore_index,
                 smoothing, softcap, z_scale)  # fmt: skip
        dhidden = torch.mm(logits, weight) if need_dhidden else hidden.new_empty(0)
        dweight = torch.mm(logits.t(), hidden) if need_dweight else weight.new_empty(0)
        return loss, z, stats, dhidden, dweight, weight.new_empty(0, dtype=torch.float32)
