"""The attention launches: the kernels, the arguments a plan fixes (strides, grid, masks, descriptors)
and the plans of a forward and a backward problem class."""

from __future__ import annotations

import torch

from ..core import (
    runtime,
    tensors,
)
from ..core.hardware import Hardware, hardware_of
from ..core.kernel_math import dot_switches, uniform_switch
from ..core.launch import (
    TMA_ALIGN_BYTES,
    Descriptor,
    Plan,
    cdiv,
    next_power_of_2,
    plan_cache,
)
from ..core.policy import LaunchPolicy
from .backward_kernels import BACKWARD_DKDV, BACKWARD_DQ, BACKWARD_DQ_CONVERT, BACKWARD_PREPROCESS
from .configs import (
    CONVERT_BLOCK,
    CONVERT_WARPS,
    FP8_DTYPE,
    PREPROCESS_STAGES,
    PREPROCESS_WARPS,
    attention_config,
    dq_in_halves,
    launch_order,
    padded_head_dim,
    rows_fit_32,
)
from .decode_launch import descale_strides
from .forward_kernels import FORWARD, TILED
from .options import MaskKey, ScoreMods

# Plans. A plan's key holds everything that fixes its arguments: shapes, strides, dtypes, the mask and score
# options' MaskKey (causal flag, window sizes, whether scores are capped, ALiBi's dims, dropout on), the
# layout and the device. Per call: the tensors, the scale and the cap (floats). Outputs are allocated
# contiguous, so their strides follow from the shapes.

_ROW_LETTER = {"q": "m", "o": "m", "do": "m", "dq": "m", "k": "n", "v": "n", "dk": "n", "dv": "n"}


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(1, size)
    return tuple(reversed(strides))


def seq_major(shape: tuple, stride: tuple) -> bool:
    """Whether a dense ``[B, H, S, D]`` tensor steps over heads faster than over positions: a
    ``[B, S, H, D]`` one (flash-attn's and Hugging Face's layout, or a slice of a packed QKV) viewed with
    ``.transpose(1, 2)``. With one head both layouts are the same."""
    return shape[1] > 1 and stride[2] > stride[1]


def new_dense_output(shape: tuple, like_seq_major: bool, dtype: torch.dtype, device) -> torch.Tensor:
    """The ``[B, H, S, D]`` output of a dense forward in q's order of dims: sequence-major when q is (then
    ``out.transpose(1, 2)`` is a contiguous ``[B, S, H, D]`` tensor, no copy), else contiguous."""
    if like_seq_major:
        batch, heads, seq, head_dim = shape
        return tensors.new_output((batch, seq, heads, head_dim), dtype, device).transpose(1, 2)
    return tensors.new_output(shape, dtype, device)


def _output_strides(q_shape: tuple, q_stride: tuple, varlen: bool) -> tuple:
    if not varlen and seq_major(q_shape, q_stride):
        batch, heads, seq, head_dim = q_shape
        return (seq * heads * head_dim, head_dim, heads * head_dim, 1)
    return _contiguous_strides(q_shape)


def _stride_args(varlen: bool, **strides: tuple) -> dict:
    """Keyword arguments ``stride_<name>b/h/<row>`` of each named tensor's strides: (batch, head, row) of a
    dense ``[B, H, S, D]`` tensor, or of a packed ``[T, H, D]`` one as a single batch."""
    args = {}
    for name, stride in strides.items():
        stride_b, stride_h, stride_row = (0, stride[1], stride[0]) if varlen else stride[:3]
        args.update({f"stride_{name}b": stride_b, f"stride_{name}h": stride_h})
        args[f"stride_{name}{_ROW_LETTER[name]}"] = stride_row
    return args


def _lse_stride_args(lse_shape: tuple, varlen: bool) -> dict:
    """(batch, head) strides of a contiguous row statistic: dense ``[B, H, S]``, packed ``[H, T]``."""
    strides = _contiguous_strides(lse_shape)
    if varlen:
        return {"stride_lb": 0, "stride_lh": strides[0]}
    return {"stride_lb": strides[0], "stride_lh": strides[1]}


def _mask_args(mask: MaskKey, heads_q: int) -> dict:
    """The fixed arguments of the scores (:class:`MaskKey`): the causal flag folded into the window's right
    side; the ALiBi slopes' batch stride (``[batch, heads_q]`` slopes only); dropout on or off."""
    return {
        "stride_ab": heads_q if mask.alibi == 2 else 0,
        "HAS_ALIBI": mask.alibi > 0,
        "DROPOUT": mask.dropout,
        "window_left": mask.left if mask.left is not None else 0,
        "window_right": mask.right_bound,
        "HAS_LEFT": mask.has_left,
        "HAS_RIGHT": mask.has_right,
        "SOFTCAP": mask.capped,
    }


def _sizes(q_shape, k_shape, varlen: bool):
    """(heads_q, heads_kv, seq_q, seq_kv, head_dim); packed: seq_* are the totals."""
    if varlen:
        return q_shape[1], k_shape[1], q_shape[0], k_shape[0], q_shape[2]
    return q_shape[1], k_shape[1], q_shape[2], k_shape[2], q_shape[3]


def _grid(n_rows: int, block: int, batch: int, heads: int, varlen: bool) -> tuple[tuple[int], dict]:
    """1-D grid and the arguments that let each program find its rows (:func:`program_block`).

    Dense: ``cdiv(seq, block)`` programs per (batch, head). Packed: ``cdiv(total, block) + batch`` per head,
    an upper bound on the real block count (each sequence wastes at most one partial block) known without
    reading the lengths back to the host; each program finds its sequence from ``cu_seqlens`` on the device.
    Spare programs exit having written nothing. A second grid axis would cap batch * heads at 65535 on CUDA.
    """
    if not varlen:
        return (cdiv(n_rows, block) * batch * heads,), {"batch": batch, "grid_blocks": 0, "BLOCK_B": 1}
    blocks = cdiv(n_rows, block) + batch
    return (blocks * heads,), {"batch": batch, "grid_blocks": blocks, "BLOCK_B": next_power_of_2(batch)}


def _paged_args(k_stride, v_stride, table_shape, table_stride) -> dict:
    """The fixed arguments of paged K/V ``[num_pages, page_size, heads_kv, head_dim]`` read through a block
    table ``[batch, max_pages]``: strides (page, head, slot) and the table's."""
    return {
        "stride_kb": k_stride[0], "stride_kh": k_stride[2], "stride_kn": k_stride[1],
        "stride_vb": v_stride[0], "stride_vh": v_stride[2], "stride_vn": v_stride[1],
        "stride_tb": table_stride[0], "stride_tp": table_stride[1],
    }  # fmt: skip


def _tma_rows(shape, strides, block_rows, block_d: int, dtype, hardware: Hardware, aligned: bool,
              varlen: bool = False):  # fmt: skip
    """(tensor descriptors, sequence-major) over the rows of tensors of ``shape`` ``[B, H, S, D]`` with
    ``strides`` (one each; blocks ``[block_rows[i], block_d]``), for loops over whole blocks inside one
    (sequence, head), which then never reach the next one's rows; or None where they keep their pointer
    loads. Head-major tensors (each the ``[B * H * S, D]`` rows of one allocation), or sequence-major ones
    (each the ``[B * S, H * D]`` rows of a ``[B, S, H, D]`` layout, rows possibly longer: a slice of a
    packed QKV; head dim unpadded, as a block's columns are the head's own), all of one kind: the kernels
    find a head's first row and column by :func:`desc_origin`. ``varlen``: packed ``[T, H, D]`` tensors
    (``shape`` and ``strides`` those of :func:`_sizes`' order), sequence-major only. Hopper or later,
    fp16/bf16, ``aligned`` (the base addresses 16-byte aligned), rows 16-byte aligned, fewer than 2**31."""
    if not (aligned and hardware.has_tma) or dtype not in (torch.float16, torch.bfloat16):
        return None
    if varlen:  # as one sequence-major sequence of T rows
        shape = (1, shape[1], shape[0], shape[2])
        strides = [(0, stride[1], stride[0], stride[2]) for stride in strides]
    batch, heads, seq, head_dim = shape
    if seq < max(block_rows):
        return None
    kinds, layouts = set(), []
    for (stride_b, stride_h, stride_n, stride_d), rows_per_block in zip(strides, block_rows, strict=True):
        if stride_d != 1 or stride_n * dtype.itemsize % TMA_ALIGN_BYTES:
            return None
        if not varlen and stride_n >= head_dim and (heads == 1 or stride_h == seq * stride_n) and (
            batch == 1 or stride_b == heads * seq * stride_n
        ):  # head-major (with one head, either kind: taken as this one)
            kinds.add(False)
            rows, width = batch * heads * seq, head_dim
        elif (
            (heads == 1 or stride_h == head_dim) and head_dim == block_d and stride_n >= heads * head_dim
            and (batch == 1 or stride_b == seq * stride_n)
        ):  # sequence-major (packed sequences: always)
            kinds.add(True)
            rows, width = batch * seq, heads * head_dim
        else:
            return None
        if rows >= 2**31:
            return None
        layouts.append(Descriptor((rows, width), (stride_n, 1), (rows_per_block, block_d)))
    if len(kinds) != 1:
        return None
    return tuple(layouts), kinds.pop()


def _tma_kv(k_shape, k_stride, v_stride, dtype, block_n: int, block_d: int, hardware: Hardware,
            aligned: bool, v_block_n: int | None = None, varlen: bool = False):  # fmt: skip
    """((K's, V's) tensor descriptors, sequence-major) of a forward's interior loop (``TMA_KV``;
    :func:`_tma_rows`), or None where it keeps its pointer loads. V's blocks are ``[v_block_n, BLOCK_D]``
    when given (the overlapped loop loads V in half blocks)."""
    return _tma_rows(k_shape, (k_stride, v_stride), (block_n, v_block_n or block_n), block_d, dtype, hardware,
                     aligned, varlen)  # fmt: skip


@plan_cache
def forward_plan(
    q_shape, k_shape, q_stride, k_stride, v_stride, batch, dtype, mask: MaskKey, two_pass, varlen,
    negative_scale, device, sequsage=False, table_shape=None, table_stride=None, descales=None,
    v_transposed=False, aligned=False, *, lse: bool, policy: LaunchPolicy,
) -> Plan:  # fmt: skip
    """The forward (flash, or with ``two_pass`` tiled) plan of one problem class; ``batch``: the number of
    sequences (packed: ``len(cu_seqlens) - 1``); ``mask``: the call's :attr:`ScoreMods.key`;
    ``negative_scale``: the scale is below 0 (q is negated in the kernel, so that the base-2 factor of the
    scores is positive). Packed only: ``sequsage``, keys per sequence from ``seqused_k``;
    ``table_shape``/``table_stride``, the block table's of paged K/V (k's shape then ``[num_pages,
    page_size, heads_kv, head_dim]``). fp8 (e4m3 q, k, v): ``descales``, the (batch stride, head stride)
    of descale_q, descale_k and descale_v, None for one not given; ``v_transposed``, V comes as
    :func:`transposed_values` makes it (``v_stride`` then V^T's: batch, head, head-dim stride).
    ``aligned`` (16-bit, not paged): K's and V's base addresses are 16-byte aligned, so that the interior
    loop may load through tensor descriptors (:func:`_tma_kv`; the plan then takes ``K_DESC=k, V_DESC=v``
    per call). ``lse`` False (flash only): the LSE is not stored (its pointer compiled out; no ``LSE`` per
    call); every caller spells it, so that a class's plan has one key however it is asked for. ``policy``:
    the launch choices (:mod:`llm_speed.core.policy`; every caller passes the current one)."""
    paged = table_shape is not None
    alibi, dropout = mask.alibi, mask.dropout
    if paged:
        num_pages, page_size, heads_kv, head_dim = k_shape
        heads_q, seq_q, seq_kv = q_shape[1], q_shape[0], table_shape[1] * page_size  # seq_kv: the capacity
    else:
        heads_q, heads_kv, seq_q, seq_kv, head_dim = _sizes(q_shape, k_shape, varlen)
        num_pages, page_size = 0, 1
    block_d = padded_head_dim(head_dim, dtype)
    hardware = hardware_of(device)
    cfg = attention_config("forward", block_d, dtype, hardware)
    grid, grid_args = _grid(seq_q, cfg.block_m, batch, heads_q, varlen)
    order = launch_order(mask.is_causal, mask.left, mask.right, hardware,
                         heads_q if varlen else batch * heads_q, 2 * seq_kv * head_dim * dtype.itemsize,
                         heads_q // heads_kv, seq_q, policy)  # fmt: skip
    lse_shape = (heads_q, seq_q) if varlen else (batch, heads_q, seq_q)
    o_stride = _output_strides(q_shape, q_stride, varlen)
    strides = _stride_args(varlen, q=q_stride, k=k_stride, v=v_stride, o=o_stride)
    strides.update(_paged_args(k_stride, v_stride, table_shape, table_stride) if paged else
                   {"stride_tb": 0, "stride_tp": 0})  # fmt: skip
    switches = dot_switches(dtype)
    descales = descales or (None, None, None)
    for name, given in zip(("DESCALE_Q", "DESCALE_K", "DESCALE_V"), descales, strict=True):
        letter = name[-1].lower()
        strides[f"stride_d{letter}b"], strides[f"stride_d{letter}h"] = given or (0, 0)
        if given is None:
            strides[name] = None  # compiled out
    if dtype == FP8_DTYPE:  # bfloat16 output and e4m3 weights: both casts rounded by hand when interpreted
        switches["RNE_BY_HAND"] = runtime.INTERPRETED
    # The overlapped interior loop (``OVERLAP``: :func:`_accumulate_overlapped`) needs Hopper's wgmma and
    # 128-row query blocks (a 64-row wgmma per warpgroup).
    overlap = (
        block_d in policy.forward_overlap_head_dims and hardware.has_tma and cfg.block_m >= 128
        and dtype in (torch.float16, torch.bfloat16) and not (two_pass or dropout or paged or v_transposed)
    )  # fmt: skip
    tma = None
    tma_kv_dims = policy.forward_tma_kv_head_dims
    if not (paged or two_pass or alibi or dropout or v_transposed) and block_d in tma_kv_dims:
        tma = _tma_kv(k_shape, k_stride, v_stride, dtype, cfg.block_n, block_d, hardware, aligned,
                      cfg.block_n // 2 if overlap else None, varlen)  # fmt: skip
    descs, desc_seq_major = tma or ((None, None), False)
    strides.update(K_DESC=descs[0], V_DESC=descs[1], DESC_SEQ_MAJOR=desc_seq_major)
    # 32-bit row offsets for the row-loaded tensors (paged K/V and V^T address their own way, 64-bit); not
    # for float32, whose packed kernels spilled with them (sm_90a: d = 128 78 loop spill instructions, d = 256
    # 1682), as the backward's took more registers
    rows = [(seq_q, q_stride), (seq_q, o_stride)]
    if not paged:
        rows += [(seq_kv, k_stride)] + ([] if v_transposed else [(seq_kv, v_stride)])
    rows32 = policy.rows32 and dtype != torch.float32 and rows_fit_32(
        varlen, rows, max(cfg.block_m, cfg.block_n), block_d
    )
    if not varlen:  # pointers a dense class never reads are compiled out: a call passes only its tensors
        strides.update(CU_Q=None, CU_K=None, SEQUSED_K=None, KV_TABLE=None)
        strides.update({} if alibi else {"ALIBI": None}, **({} if dropout else {"RNG": None}))
    if not lse:
        strides["LSE"] = None
    return (TILED if two_pass else FORWARD).plan(
        grid, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **strides,
        **_lse_stride_args(lse_shape, varlen), **grid_args, **order,
        heads_q=heads_q, group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
        page_size=page_size, num_pages=num_pages,
        **_mask_args(mask, heads_q), TWO_PASS=two_pass,
        IS_VARLEN=varlen, UNIFORM=varlen and policy.uniform_bounds and uniform_switch(hardware),
        SEQUSED=sequsage, PAGED=paged,
        NEG_SCALE=negative_scale and not mask.capped,
        EVEN_M=not varlen and seq_q % cfg.block_m == 0, EVEN_N=not varlen and seq_kv % cfg.block_n == 0,
        EVEN_D=head_dim == block_d, **switches, V_TRANSPOSED=v_transposed,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, TMA_KV=tma is not None,
        OVERLAP=overlap, ROWS32=rows32, FP8_GPU_CAST=dtype == FP8_DTYPE and policy.fp8_weights_gpu_cast,
    )  # fmt: skip


@plan_cache
def backward_plans(
    q_shape, k_shape, q_stride, k_stride, v_stride, out_stride, dout_stride, batch, dtypes, has_dlse,
    mask: MaskKey, varlen, deterministic, device, sequsage=False, aligned=False, *, policy: LaunchPolicy,
) -> tuple[Plan, Plan, Plan]:  # fmt: skip
    """(preprocess, dK/dV, dQ) plans of one backward problem class; ``dtypes``: those of q, out, dout, lse
    and dlse (None without); ``mask``: the forward call's :attr:`ScoreMods.key`. The default path's third
    plan is the dQ conversion (dQ added by atomics in the dK/dV kernel); ``deterministic``: the dQ kernel.
    ``aligned`` (16-bit): q's, dout's, k's and v's base addresses are 16-byte aligned, so that the dK/dV
    kernel may load Q and dO and the dQ kernel K and V through tensor descriptors (:func:`_tma_rows`; the
    plans then take ``Q_DESC=q, DO_DESC=dout`` and ``K_DESC=k, V_DESC=v`` per call). ``policy``: the
    launch choices."""
    heads_q, heads_kv, seq_q, seq_kv, head_dim = _sizes(q_shape, k_shape, varlen)
    dtype = dtypes[0]
    block_d = padded_head_dim(head_dim)
    even_d = head_dim == block_d
    hardware = hardware_of(device)
    lse_shape = (heads_q, seq_q) if varlen else (batch, heads_q, seq_q)
    lse_strides = _lse_stride_args(lse_shape, varlen)
    atomic = not deterministic
    # the fp32 dQ accumulator (default path): contiguous, q's shape
    dq_strides = _stride_args(varlen, dq=_contiguous_strides(q_shape) if atomic else (0, 0, 0, 0))
    fwd = attention_config("forward", block_d, dtype, hardware)  # the preprocess takes the forward's rows
    cfg = attention_config("backward", block_d, dtype, hardware)
    # 32-bit row offsets (dQ, dK, dV and the accumulator are contiguous); not for float32, whose packed dK/dV
    # kernel took 48 more registers with them (sm_90a: two blocks per SM to one)
    rows32 = policy.rows32 and dtype != torch.float32 and rows_fit_32(
        varlen,
        [*[(seq_q, st) for st in (q_stride, out_stride, dout_stride, _contiguous_strides(q_shape))],
         *[(seq_kv, st) for st in (k_stride, v_stride, _contiguous_strides(k_shape))]],
        max(fwd.block_m, cfg.block_m, cfg.block_n), block_d,
    )  # fmt: skip

    # delta: packed rows run as one batch of total_q rows (rows are independent here).
    preprocess = BACKWARD_PREPROCESS.plan(
        (cdiv(seq_q, fwd.block_m) * (1 if varlen else batch) * heads_q,),
        num_warps=PREPROCESS_WARPS, num_stages=PREPROCESS_STAGES,
        **_stride_args(varlen, o=out_stride, do=dout_stride), **dq_strides, **lse_strides,
        heads_q=heads_q, seq_q=seq_q, head_dim=head_dim, HAS_DLSE=has_dlse, ZERO_DQ=atomic,
        EVEN_M=seq_q % fwd.block_m == 0, EVEN_D=even_d, ROWS32=rows32, BLOCK_M=fwd.block_m, BLOCK_D=block_d,
    )  # fmt: skip

    # What the dK/dV and dQ kernels share: strides, sizes, masking and dtype switches.
    common = dict(
        **_stride_args(varlen, q=q_stride, k=k_stride, v=v_stride, do=dout_stride), **lse_strides,
        group=heads_q // heads_kv, seq_q=seq_q, seq_kv=seq_kv, head_dim=head_dim,
        **_mask_args(mask, heads_q), IS_VARLEN=varlen,
        UNIFORM=varlen and policy.uniform_bounds and uniform_switch(hardware), SEQUSED=sequsage,
        EVEN_D=even_d, ROWS32=rows32,
        **dot_switches(dtype),
        BLOCK_D=block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    grid, grid_args = _grid(seq_kv, cfg.block_n, batch, heads_kv, varlen)
    dk_strides = _contiguous_strides(k_shape)
    tma_dq = None  # dQ tiles added by TMA bulk reductions (whole query blocks, dense)
    if (atomic and policy.backward_tma_dq_add and hardware.has_tma and not runtime.INTERPRETED and not varlen
            and even_d):  # fmt: skip
        rows = q_shape[0] * q_shape[1] * seq_q
        if seq_q % cfg.block_m == 0 and rows < 2**31:
            tma_dq = Descriptor((rows, head_dim), (head_dim, 1), (cfg.block_m, block_d))
    d_halves = atomic and tma_dq is None and dq_in_halves(block_d, cfg.block_m, dtype)
    tma_qdo = None  # Q and dO tiles by TMA
    if block_d in policy.backward_tma_head_dims and not (d_halves or tma_dq):
        tma_qdo = _tma_rows(q_shape, (q_stride, dout_stride), (cfg.block_m, cfg.block_m), block_d, dtype,
                            hardware, aligned, varlen)  # fmt: skip
    (q_desc, do_desc), qdo_seq_major = tma_qdo or ((None, None), False)
    dkdv = BACKWARD_DKDV.plan(
        grid, **common, **grid_args, **_stride_args(varlen, dk=dk_strides, dv=dk_strides), **dq_strides,
        DQ_DESC=tma_dq, Q_DESC=q_desc, DO_DESC=do_desc, DESC_SEQ_MAJOR=qdo_seq_major,
        heads_kv=heads_kv, EVEN_M=not varlen and seq_q % cfg.block_m == 0,
        EVEN_N=not varlen and seq_kv % cfg.block_n == 0, ATOMIC_DQ=atomic, D_HALVES=d_halves,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
    )  # fmt: skip
    if atomic:
        n = 1
        for size in q_shape:
            n *= size
        dq = BACKWARD_DQ_CONVERT.plan(
            (cdiv(n, CONVERT_BLOCK),), num_warps=CONVERT_WARPS, num_stages=1, n=n,
            EVEN=n % CONVERT_BLOCK == 0, RNE_BY_HAND=dot_switches(dtype)["RNE_BY_HAND"], BLOCK=CONVERT_BLOCK,
        )  # fmt: skip
        return preprocess, dkdv, dq
    # dQ holds Q, dO and the fp32 dQ accumulator [BM, BD]; K and V stream, like the forward.
    grid, grid_args = _grid(seq_q, cfg.block_n, batch, heads_q, varlen)
    order = launch_order(mask.is_causal, mask.left, mask.right, hardware,
                         heads_q if varlen else batch * heads_q, 2 * seq_kv * head_dim * dtype.itemsize,
                         heads_q // heads_kv, seq_q, policy)  # fmt: skip
    # K and V tiles by TMA, as the dK/dV kernel's Q and dO; not with ALiBi or dropout (as the forward: sm_90a,
    # the causal ALiBi+dropout dQ kernel, at 255 registers, spilled 9 instructions in its loops with it)
    tma_kv = None
    if block_d in policy.backward_tma_head_dims and not (mask.alibi or mask.dropout):
        tma_kv = _tma_rows(k_shape, (k_stride, v_stride), (cfg.block_m, cfg.block_m), block_d, dtype,
                           hardware, aligned, varlen)  # fmt: skip
    (k_desc, v_desc), kv_seq_major = tma_kv or ((None, None), False)
    dq = BACKWARD_DQ.plan(
        grid, **common, **grid_args, **order, **_stride_args(varlen, dq=_contiguous_strides(q_shape)),
        K_DESC=k_desc, V_DESC=v_desc, DESC_SEQ_MAJOR=kv_seq_major, heads_q=heads_q,
        EVEN_M=not varlen and seq_q % cfg.block_n == 0, EVEN_N=not varlen and seq_kv % cfg.block_m == 0,
        BLOCK_M=cfg.block_n, BLOCK_N=cfg.block_m,
    )  # fmt: skip
    return preprocess, dkdv, dq


def launch_backward(plans, dout, q, k, v, out, lse, dlse, cu_q, cu_k, scale: float, mods: ScoreMods,
                    deterministic, seqused_k=None):  # fmt: skip
    """Launch the three backward kernels: delta = rowsum(dO * O) - dLSE and the LSE in base 2, then dK/dV
    over key blocks, then dQ.

    Default path: the preprocess also zeroes an fp32 dQ accumulator, the dK/dV kernel adds dS K to it with
    atomics (FlashAttention-2's five matmuls per tile), and a conversion writes dQ = scale * accumulator in
    q's dtype. dQ's additions come in whatever order the GPU runs the programs: run to run, its last bits can
    differ. ``deterministic``: a dQ kernel of its own recomputes S and dP (seven matmuls per tile) and every
    output element has exactly one writer: no atomics, bitwise repeatable. ``seqused_k`` (packed): key rows
    past a sequence's used ones have no writer, so dK and dV start at zero."""
    preprocess, dkdv, dq_plan = plans
    device = q.device
    delta = tensors.new_output(lse.shape, torch.float32, device)
    lse2 = tensors.new_output(lse.shape, torch.float32, device)  # the preprocess's base-2 LSE
    # deterministic: the accumulator is not used; any float32 tensor stands in
    dq_acc = delta if deterministic else tensors.new_output(q.shape, torch.float32, device)
    preprocess.launch(O=out, DO=dout, LSE=lse, DLSE=delta if dlse is None else dlse, DELTA=delta, LSE2=lse2,
                      DQ_ACC=dq_acc)  # fmt: skip
    if seqused_k is None:
        dk = tensors.new_output(k.shape, k.dtype, device)
        dv = tensors.new_output(v.shape, v.dtype, device)
    else:
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    dq = tensors.new_output(q.shape, q.dtype, device)
    if cu_q is None:  # dense programs never read the sequence pointers: any tensor of the plan's dtype
        cu_q = cu_k = delta
    softcap, dropout_p = mods.cap, mods.dropout_p
    # without ALiBi or dropout their pointers are never read: any tensor of the plan's dtype stands in
    alibi = delta if mods.alibi_slopes is None else mods.alibi_slopes
    rng = delta if mods.rng is None else mods.rng
    used = delta if seqused_k is None else seqused_k
    if "Q_DESC" in dkdv.descriptors:  # backward_tma_head_dims: Q and dO through their descriptors too
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, Q_DESC=q,
                    DO_DESC=dout, CU_Q=cu_q, CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale,
                    softcap=softcap, dropout_p=dropout_p)  # fmt: skip
    elif dkdv.descriptors:  # backward_tma_dq_add: the accumulator through its descriptor too
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, DQ_DESC=dq_acc,
                    CU_Q=cu_q, CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    else:
        dkdv.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DK=dk, DV=dv, DQ=dq_acc, CU_Q=cu_q,
                    CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                    dropout_p=dropout_p)  # fmt: skip
    if deterministic and dq_plan.descriptors:  # K and V through their descriptors too
        dq_plan.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DQ=dq, K_DESC=k, V_DESC=v, CU_Q=cu_q,
                       CU_K=cu_k, SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                       dropout_p=dropout_p)  # fmt: skip
    elif deterministic:
        dq_plan.launch(Q=q, K=k, V=v, DO=dout, LSE2=lse2, DELTA=delta, DQ=dq, CU_Q=cu_q, CU_K=cu_k,
                       SEQUSED_K=used, ALIBI=alibi, RNG=rng, scale=scale, softcap=softcap,
                       dropout_p=dropout_p)  # fmt: skip
    else:
        dq_plan.launch(DQ_ACC=dq_acc, DQ=dq, scale=scale)
    return dq, dk, dv


def descale_key(descales) -> tuple | None:
    """The plan key of fp8 attention's (descale_q, descale_k, descale_v) (each a tensor or None): the
    (batch stride, head stride) each is read with, None for one not given; None for 16-bit attention."""
    if descales is None:
        return None
    return tuple(None if t is None else descale_strides(t) for t in descales)


def descale_inputs(descales) -> dict:
    """The forward kernel's per-call descale pointers (those given; the others are fixed None)."""
    if descales is None:
        return {}
    return {name: t for name, t in zip(("DESCALE_Q", "DESCALE_K", "DESCALE_V"), descales, strict=True)
            if t is not None}  # fmt: skip


# V^T's rows (one per head dim) start this many elements apart at least: 16 bytes of fp8, so that the pointer
# of every row is 16-byte aligned and Triton specialises its stride as such (vector copies along the keys).
V_T_ALIGN = 16


def transposed_values(v: torch.Tensor) -> torch.Tensor:
    """V ``[B, Hkv, S, D]`` as fp8 attention's forward reads it (``V_TRANSPOSED``): V^T ``[B, Hkv, D, S]``
    with the keys contiguous, each head-dim row ``cdiv(S, V_T_ALIGN) * V_T_ALIGN`` elements apart (the
    padding never read). One copy per call, 1 byte per element each way for e4m3."""
    batch, heads_kv, seq_kv, head_dim = v.shape
    if seq_kv % V_T_ALIGN == 0:  # no padding: the plain copy (3 us on the CPU against 6)
        return v.transpose(2, 3).contiguous()
    row = cdiv(seq_kv, V_T_ALIGN) * V_T_ALIGN
    v_t = torch.empty((batch, heads_kv, head_dim, row), dtype=v.dtype, device=v.device)[..., :seq_kv]
    return v_t.copy_(v.transpose(2, 3))
