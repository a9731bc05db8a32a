"""The attention cost model: the blocks each program walks and their launch order (longest first, as
``llm_speed.attention.flash`` launches them), the kernels' tiles restated without torch, the forward and
backward passes, decode over a KV cache, and the eager attention."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from llm_speed.core.args import check_choice, check_window, positive_int, positive_ints, type_name
from llm_speed.core.gpus import GPUSpec, dtype_bytes, normalize_dtype
from llm_speed.core.intmath import cdiv, next_power_of_2
from llm_speed.core.policy import SHIPPED
from llm_speed.perf._checks import attention_shape, check_dtype
from llm_speed.perf.kernel_costs import (
    attention_cost,
    kvcache_decode_cost,
    varlen_attention_cost,
    visible_pairs,
    window_visible_pairs,
)
from llm_speed.perf.prediction.calibration_data import THREADS_PER_WARP, load_calibration, parameters
from llm_speed.perf.prediction.gemm import gemm_terms
from llm_speed.perf.prediction.terms import (
    KernelPass,
    ProgramOrder,
    Runs,
    ScheduleTooLong,
    Terms,
    in_sequence,
    memory_pass_terms,
    order_blocks,
    pass_terms,
    pop_flag,
)

# The most query (or key) blocks of one causal sequence the model lists: 2**19, 67M tokens in blocks of 128
# (a full mask's blocks are all equal and only counted).
MAX_CAUSAL_BLOCKS = 2**19


def query_blocks(seq_q: int, seq_kv: int, rows: int, cols: int, causal: bool) -> list[int]:
    """Key blocks of ``cols`` that each program of ``rows`` query rows walks, by query block in row order.
    Causal (bottom-right aligned): a block of rows walks the key blocks up to its last row's last visible key
    (the diagonal blocks whole, masked inside)."""
    blocks = cdiv(seq_q, rows)
    if not causal:
        return [cdiv(seq_kv, cols)] * blocks
    offset = seq_kv - seq_q
    ends = (min(seq_kv, min((i + 1) * rows, seq_q) + offset) for i in range(blocks))
    return [cdiv(end, cols) if end > 0 else 0 for end in ends]


def key_blocks(seq_q: int, seq_kv: int, rows: int, cols: int, causal: bool) -> list[int]:
    """Query blocks of ``rows`` that each program of ``cols`` keys walks (the dK/dV kernel), by key block in
    row order. Causal: the blocks from the first query row that sees the program's first key."""
    blocks = cdiv(seq_kv, cols)
    if not causal:
        return [cdiv(seq_q, rows)] * blocks
    offset = seq_kv - seq_q
    firsts = (max(0, j * cols - offset) for j in range(blocks))
    return [cdiv(seq_q - first, rows) if first < seq_q else 0 for first in firsts]


def _thinned(blocks: list[int], fraction: float) -> list[int]:
    """Block counts scaled by ``fraction`` (a sliding window's share of the visible pairs), at least 1."""
    if fraction >= 1.0:
        return blocks
    return [max(1, math.ceil(n * fraction)) if n else 0 for n in blocks]


def launch_order(per_pair: Sequence[int], pairs: int, section: int | None) -> tuple[int, ...]:
    """The programs of ``pairs`` (batch, head) pairs of blocks ``per_pair`` each, in launch order: row order
    (``section`` None: a pair's blocks adjacent), or longest first as llm-speed's causal query-block kernels
    launch (``llm_speed.attention.blocks._longest_first``): sections of ``section`` pairs, block index major
    within one, from the last block."""
    if section is None:
        return tuple(per_pair) * pairs
    order: list[int] = []
    for first in range(0, pairs, section):
        width = min(section, pairs - first)
        for n in reversed(per_pair):
            order.extend([n] * width)
    return tuple(order)


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads_q: int
    heads_kv: int
    head_dim: int
    element: float
    causal: bool
    sequences: tuple[tuple[int, int], ...]  # (seq_q, seq_kv) of each sequence (dense: one, times batch)
    window_fraction: float = 1.0

    @property
    def group(self) -> int:
        return self.heads_q // self.heads_kv

    def per_sequence(self):
        """(seq_q, seq_kv, multiplicity) per distinct sequence: a dense problem has one, ``batch`` times."""
        counts: dict[tuple[int, int], int] = {}
        for pair in self.sequences:
            counts[pair] = counts.get(pair, 0) + (self.batch if len(self.sequences) == 1 else 1)
        return [(q, kv, c) for (q, kv), c in counts.items()]

    @property
    def q_elems(self) -> int:
        return sum(q * c for q, _, c in self.per_sequence()) * self.heads_q * self.head_dim

    @property
    def kv_elems(self) -> int:
        return sum(kv * c for _, kv, c in self.per_sequence()) * self.heads_kv * self.head_dim

    @property
    def rows(self) -> int:
        return sum(q * c for q, _, c in self.per_sequence()) * self.heads_q


def _pad_dim(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _block_runs(blocks: list[int] | tuple[int, int]) -> Runs:
    """Runs (blocks, count) of equal neighbours in a list of block counts (a pair: n, count times)."""
    if isinstance(blocks, tuple):
        return (blocks,) if blocks[1] else ()
    runs: list[list[int]] = []
    for n in blocks:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return tuple((n, c) for n, c in runs)


def _pair_runs(shape: AttentionShape, keys: bool, rows: int, cols: int, scale: int = 1) -> Runs:
    """One (batch, head) pair's programs as runs: every sequence's blocks (:func:`query_blocks`, ``keys``:
    :func:`key_blocks`), thinned by the window, times ``scale``. A full mask's are all equal and counted; a
    causal one's differ and are listed, up to :data:`MAX_CAUSAL_BLOCKS` a sequence."""
    runs: list[tuple[int, int]] = []
    for q, kv in shape.sequences:
        programs, walked = (cdiv(kv, cols), cdiv(q, rows)) if keys else (cdiv(q, rows), cdiv(kv, cols))
        if not shape.causal:
            n = _thinned([walked], shape.window_fraction)[0]
            runs.extend(_block_runs((n * scale, programs)))
            continue
        if programs > MAX_CAUSAL_BLOCKS:
            name, value, size = ("seq_kv", kv, cols) if keys else ("seq_q", q, rows)
            if len(shape.sequences) > 1:
                name = "lengths_k entry" if keys else "lengths_q entry"
            raise ValueError(
                f"{name}={value:,} is past the longest causal sequence the model schedules: {programs:,} "
                f"blocks of {size} (at most {MAX_CAUSAL_BLOCKS:,} a sequence: "
                f"{MAX_CAUSAL_BLOCKS * size:,} tokens)"
            )
        walk = key_blocks if keys else query_blocks
        blocks = _thinned(walk(q, kv, rows, cols, True), shape.window_fraction)
        runs.extend((n * scale, c) for n, c in _block_runs(blocks))
    return tuple(runs)


def launch_runs(per_pair: Runs, pairs: int, section: int | None) -> ProgramOrder:
    """:func:`launch_order` as a :data:`ProgramOrder`: row order repeats the pair's runs ``pairs`` times;
    longest first, sections of ``section`` pairs (a last, narrower one), each run ``width`` times wider."""
    if section is None:
        return ((per_pair, pairs),)
    full, rest = divmod(pairs, section)
    order = []
    for width, repeats in ((min(section, pairs), full), (rest, 1 if rest else 0)):
        if repeats:
            order.append((tuple((n, c * width) for n, c in reversed(per_pair)), repeats))
    return tuple(order)


def _query_programs(shape: AttentionShape, rows: int, cols: int, section: int | None) -> ProgramOrder:
    """Programs of ``rows`` query rows per (sequence, query head) over key blocks of ``cols``, in launch
    order (:func:`launch_runs`; packed sequences: a head's blocks run over the sequences in turn)."""
    per_pair = _pair_runs(shape, False, rows, cols)
    return launch_runs(per_pair, shape.batch * shape.heads_q, section)


def _forward_pass(
    shape: AttentionShape, tile: Sequence[int], *, passes: int = 1, section: int | None = None
) -> KernelPass:
    """The forward kernel: programs of BM query rows per (sequence, query head) walk key blocks of BN:
    S = QK^T and O += PV per block (``passes=2``: the two-pass tiled kernel, which computes QK^T twice);
    ``section``: launched longest first (:func:`launch_order`)."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    one = 2.0 * bm * bn * d
    matmuls = ((bm, bn, one), (bm, d, one)) + (((bm, bn, one),) if passes == 2 else ())
    regs = (bm * d + bm * bn) / (THREADS_PER_WARP * warps)
    dram = e * (2 * shape.q_elems + 2 * shape.kv_elems * (1.5 if passes == 2 else 1)) + 4 * shape.rows
    stages = int(tile[3]) if len(tile) > 3 else 2
    return KernelPass(
        "forward",
        _query_programs(shape, bm, bn, section),
        matmuls,
        exps=float(bm * bn) * passes,
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=(2 + (passes - 1)) * bn * d * e,
        unique_load_bytes=2 * shape.kv_elems * e,
        tile=tuple(int(x) for x in tile),
        smem_bytes=e * d * (bm + stages * 2 * bn),
    )


def _dkdv_pass(
    shape: AttentionShape, tile: Sequence[int], matmuls_per_block: int, per_query_head: bool = False
) -> KernelPass:
    """The dK/dV kernel (or a vendor's one-kernel backward with ``matmuls_per_block`` 5): programs own BN keys
    of one (sequence, kv head) and walk the query blocks of BM rows of every query head of the group:
    S and dP (rows BM), dV and dK (rows BN) per block, and dQ (rows BM, atomics) for a one-kernel backward."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    # Programs of BN keys per (sequence, kv head), in row order, each walking the group's query heads
    # (llm-speed's); ``per_query_head``: one per query head instead, dK/dV summed over the group after.
    group = 1 if per_query_head else shape.group
    per_pair = _pair_runs(shape, True, bm, bn, group)
    one = 2.0 * bm * bn * d
    matmuls = [(bm, bn, one), (bm, bn, one), (bn, d, one), (bn, d, one)]
    if matmuls_per_block == 5:
        matmuls.append((bm, d, one))
    regs = (2 * bn * d + 2 * bm * bn) / (THREADS_PER_WARP * warps)
    # Q, dO, LSE and delta of each query block; K, V read and dK, dV written once.
    dram = e * (2 * shape.q_elems + 4 * shape.kv_elems) + 8 * shape.rows
    load = 2 * bm * d * e + 8 * bm + (2 * 4 * bm * d if matmuls_per_block == 5 else 0)
    stages = int(tile[3]) if len(tile) > 3 else 2
    return KernelPass(
        "dkdv",
        launch_runs(per_pair, shape.batch * shape.heads_kv * shape.group // group, None),
        tuple(matmuls),
        exps=float(bm * bn),
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=load,
        unique_load_bytes=2 * shape.q_elems * e + 8 * shape.rows,
        tile=tuple(int(x) for x in tile),
        smem_bytes=e * d * (2 * bn + stages * 2 * bm),
    )


def _dq_pass(shape: AttentionShape, tile: Sequence[int], section: int | None = None) -> KernelPass:
    """llm-speed's dQ kernel: the backward tile transposed (programs own BN query rows, walk BM keys):
    S, dP (rows BN) and dQ = dS K (rows BN) per block; Q, dO, LSE, delta read once, dQ written."""
    bm, bn, warps = int(tile[0]), int(tile[1]), int(tile[2])
    d, e = _pad_dim(shape.head_dim), shape.element
    one = 2.0 * bm * bn * d
    matmuls = ((bn, bm, one), (bn, bm, one), (bn, d, one))
    regs = (bn * d + 2 * bm * bn) / (THREADS_PER_WARP * warps)
    dram = e * (3 * shape.q_elems + 2 * shape.kv_elems) + 8 * shape.rows
    return KernelPass(
        "dq",
        _query_programs(shape, bn, bm, section),
        matmuls,
        exps=float(bm * bn),
        warps=warps,
        regs=regs,
        dram_bytes=dram,
        block_load_bytes=2 * bm * d * e,
        unique_load_bytes=2 * shape.kv_elems * e,
        tile=(bn, bm, warps, *tile[3:4]),
        smem_bytes=e * d * (2 * bn + (int(tile[3]) if len(tile) > 3 else 2) * 2 * bm),
    )


def _attention_tiles(
    params: dict[str, Any], build: dict[str, Any], head_dim: int, dtype: str, problem: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(forward tile, backward tile) as (BM, BN, warps, stages): the problem's override, else the build's
    table (llm-speed: by padded head_dim and dtype class), else the implementation's."""
    forward, backward = problem.pop("config", None), problem.pop("backward_config", None)
    table = build.get("attention_tiles") or params.get("tiles")
    key = str(max(64, _pad_dim(head_dim)))
    dtype_class = "fp32" if dtype == "fp32" else "fp16"

    def lookup(direction: str) -> tuple[int, ...]:
        entry = table[direction]
        entry = entry.get(dtype_class, entry) if isinstance(entry, dict) else entry
        if isinstance(entry, dict):
            entry = entry.get(key) or entry[max(entry, key=int)]
        return tuple(int(x) for x in entry)

    return (
        tuple(int(x) for x in forward) if forward is not None else lookup("forward"),
        tuple(int(x) for x in backward) if backward is not None else lookup("backward"),
    )


def _lengths(name: str, value: Any) -> list[int]:
    """A packed problem's sequence lengths: a list of positive ints, or one int (a single sequence)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{name} must be a list of sequence lengths (positive ints) or one int, got "
            f"{type_name(value)} {value!r}"
        )
    lengths = [positive_int(f"{name} entry", x) for x in value]
    if not lengths:
        raise ValueError(f"{name} must hold at least one sequence length, got {value!r}")
    return lengths


# The forms of the tile overrides of the attention rows (``config``, ``backward_config``).
ATTENTION_CONFIG = "BM, BN, warps[, stages]"


def _check_overrides(problem: dict[str, Any]) -> None:
    """The attention rows' optional overrides checked before any work, each error naming its key:
    ``config`` and ``backward_config`` (3 or 4 positive ints), ``launch_order`` ("lpt" or "row")."""
    for key in ("config", "backward_config"):
        if problem.get(key) is not None:
            problem[key] = positive_ints(key, problem[key], lengths=(3, 4), what=ATTENTION_CONFIG)
    if problem.get("launch_order") is not None:
        check_choice("launch_order", problem["launch_order"], LAUNCH_ORDERS)


def _attention_shape(op: str, dtype: str, problem: dict[str, Any]) -> tuple[AttentionShape, Any]:
    """The checked shape of an attention problem, and its cost (kernel_costs) in the op's mode."""
    mode = "bwd" if op.endswith("_backward") else "fwd"
    causal = pop_flag(problem, "causal", pop_flag(problem, "is_causal"))
    window = check_window(problem.pop("window", None))
    if op.startswith("flash_attention_varlen"):
        lengths_q = _lengths("lengths_q", problem.pop("lengths_q"))
        lengths_k = problem.pop("lengths_k", None)
        lengths_k = lengths_q if lengths_k is None else _lengths("lengths_k", lengths_k)
        if len(lengths_k) != len(lengths_q):
            raise ValueError("lengths_k must have one entry per sequence of lengths_q")
        heads_q = positive_int("heads_q", problem.pop("heads_q"))
        head_dim = positive_int("head_dim", problem.pop("head_dim"))
        heads_kv = problem.pop("heads_kv", None)
        _, heads_q, _, _, head_dim, heads_kv = attention_shape(1, heads_q, 1, 1, head_dim, heads_kv)
        cost = varlen_attention_cost(
            lengths_q,
            lengths_k,
            heads_q,
            head_dim,
            heads_kv=heads_kv,
            dtype=dtype,
            is_causal=causal,
            window=window,
            mode=mode,
        )
        pairs_full = sum(
            window_visible_pairs(q, k, is_causal=causal) for q, k in zip(lengths_q, lengths_k, strict=True)
        )
        fraction = (
            1.0
            if window is None
            else (cost.flops / (4 * heads_q * head_dim) / (BACKWARD_FACTOR[mode] * max(pairs_full, 1)))
        )
        shape = AttentionShape(
            1,
            heads_q,
            heads_kv,
            head_dim,
            dtype_bytes(dtype),
            causal,
            tuple(zip(lengths_q, lengths_k, strict=True)),
            min(1.0, fraction),
        )
        return shape, cost
    batch, heads_q, seq_q = problem.pop("batch"), problem.pop("heads_q"), problem.pop("seq_q")
    seq_kv = problem.pop("seq_kv", None)
    head_dim, heads_kv = problem.pop("head_dim"), problem.pop("heads_kv", None)
    batch, heads_q, seq_q, seq_kv, head_dim, heads_kv = attention_shape(
        batch, heads_q, seq_q, seq_q if seq_kv is None else seq_kv, head_dim, heads_kv
    )
    impl_class = {"tiled_attention": "tiled", "naive_attention": "naive"}
    cost = attention_cost(
        batch,
        heads_q,
        seq_q,
        seq_kv,
        head_dim,
        heads_kv=heads_kv,
        dtype=dtype,
        causal=causal,
        mode=mode,
        impl=impl_class.get(op, "flash"),
        score_dtype="fp32" if op == "naive_attention" else None,
        out_dtype="bf16" if op == "flash_attention_fp8" else None,  # e4m3 in, bfloat16 out
    )
    fraction = 1.0
    if window is not None:
        pairs = window_visible_pairs(seq_q, seq_kv, is_causal=causal, window=window)
        fraction = pairs / max(1, visible_pairs(seq_q, seq_kv, causal))
        cost = type(cost)(cost.flops * fraction, cost.bytes_moved)
    shape = AttentionShape(
        batch, heads_q, heads_kv, head_dim, dtype_bytes(dtype), causal, ((seq_q, seq_kv),), min(1.0, fraction)
    )
    return shape, cost


BACKWARD_FACTOR = {"fwd": 1.0, "bwd": 2.5}
# The query-block kernels' launch orders ``launch_order`` names: longest first, or row order.
LAUNCH_ORDERS = ("lpt", "row")
# Longest first only from this many query rows per sequence (packed: in all); llm_speed.attention.flash's
# The kernels' rule, read from the shipped launch policy (torch-free), not restated.
LPT_MIN_ROWS = SHIPPED.lpt_min_rows


def lpt_section(spec: GPUSpec, order: str, shape: AttentionShape, min_rows: int = LPT_MIN_ROWS) -> int | None:
    """The (batch, head) pairs per section of a longest-first launch of the query-block kernels (llm-speed's
    as ``llm_speed.attention.configs.launch_order`` does it), or None where they launch in row order:
    ``order`` "row" (llm-speed's builds before it; a vendor's kernel that launches so), masks that are
    not causal-like (a window's left bound), and sequences shorter than ``min_rows`` (:data:`LPT_MIN_ROWS`;
    a build's ``attention_lpt_min_rows``: d1b0227 launched longest first at every length)."""
    rows = sum(sq for sq, _ in shape.sequences)  # dense: the one sequence's; packed: all of them
    if order != "lpt" or not shape.causal or shape.window_fraction < 1.0 or rows < min_rows:
        return None
    kv_bytes = 2 * shape.kv_elems * shape.element / (shape.batch * shape.heads_kv)
    return max(1, int(spec.l2_cache_mb * 2**20 * shape.group // max(1.0, kv_bytes)))


def compiled_key(kernel: str, causal: bool, head_dim: int, dtype: str, tile: Sequence[int]) -> str:
    """How the calibration's ``compiled`` tables name a kernel as compiled: ``forward/causal/128/fp16/
    128,32,8,2`` (kernel, mask, head_dim, dtype, the tile as the op's configuration names it)."""
    mask = "causal" if causal else "full"
    return f"{kernel}/{mask}/{head_dim}/{dtype}/{','.join(str(int(x)) for x in tile)}"


def _as_compiled(
    kernel: KernelPass, calibration: Any, build: dict[str, Any], shape: AttentionShape, dtype: str, tile
) -> KernelPass:
    """``kernel`` with what the compiler made of it, where the calibration has its build's commit compiled
    at this tile (``compiled`` tables: ``benchmarks/compile_measured_tiles.py``; registers, spills and
    occupancy read from the sm_90a build, not guessed)."""
    table = load_calibration(calibration).get("compiled", {}).get(build.get("commit") or "", {})
    row = table.get("kernels", {}).get(compiled_key(kernel.name, shape.causal, shape.head_dim, dtype, tile))
    if row is None:
        return kernel
    return replace(kernel, resident=int(row["blocks_per_sm"]), loop_spills=int(row["loop_spills"]))


def _attention_peak(spec: GPUSpec, dtype: str) -> float:
    # fp32 attention runs an IEEE product on the CUDA cores (no TF32): the fp32 peak.
    return spec.peak_flops("fp32" if dtype == "fp32" else dtype)


def _predict_kvcache(spec, consts, impl, params, problem) -> tuple[Terms, float, float]:
    """Decode over a KV cache: the visible cache streamed once by ``batch * heads_kv * splits`` programs
    (split-KV: enough splits to give every SM work), then (splits > 1) a small combine kernel."""
    dtype = normalize_dtype(problem.pop("dtype", "fp16"))
    batch, heads_q = problem.pop("batch"), problem.pop("heads_q")
    seq_q = problem.pop("seq_q", 1)
    context, head_dim = problem.pop("seq_kv"), problem.pop("head_dim")
    heads_kv, seq_new = problem.pop("heads_kv", None), problem.pop("seq_new", 0)
    kv_dtype = problem.pop("kv_dtype", None)
    kv_dtype = None if kv_dtype is None else check_dtype("kv_dtype", kv_dtype)
    context = positive_int("seq_kv", context)
    seq_new = positive_int("seq_new", seq_new, allow_zero=True)
    if seq_new > context:  # named here: the cost's own check calls seq_kv "context"
        raise ValueError(f"seq_new ({seq_new}) cannot exceed seq_kv ({context}): appended keys are attended")
    # a paged cache (page_size) streams the same bytes, one block-table read per page aside: priced as dense
    page_size = problem.pop("page_size", None)
    if page_size is not None:
        positive_int("page_size", page_size)
    cost = kvcache_decode_cost(
        batch,
        heads_q,
        seq_q,
        context,
        head_dim,
        heads_kv=heads_kv,
        dtype=dtype,
        seq_new=seq_new,
        kv_dtype=kv_dtype,
    )
    heads_kv = heads_q if heads_kv is None else heads_kv
    sms = spec.sm_count
    block = int(params.get("decode_block", 64))
    splits = max(1, min(cdiv(context, block), cdiv(2 * sms, batch * heads_kv)))
    programs = batch * heads_kv * splits
    main = memory_pass_terms(params, consts, "decode", cost.bytes_moved, programs)
    peak = _attention_peak(spec, dtype)
    compute = cost.flops / (peak * float(params.get("eta", 1.0)) * min(1.0, programs / sms))
    main = Terms(
        **{
            **main.__dict__,
            "compute_s": compute,
            "tile": (seq_q, block),
            "split_k": splits,
            "waves": programs / sms,
            "device_s": None,
        }
    )
    if splits > 1:
        partial = 2.0 * batch * heads_q * seq_q * splits * (head_dim + 1) * 4
        return (
            in_sequence([main, memory_pass_terms(params, consts, "combine", partial, batch * heads_q)]),
            cost.flops,
            cost.bytes_moved,
        )
    return main, cost.flops, cost.bytes_moved


def predict_attention(
    op, spec, consts, impl, params, build, problem, calibration
) -> tuple[Terms, float, float]:
    sizes = ("batch", "heads_q", "seq_q", "lengths_q")
    given = ", ".join(f"{key}={problem[key]}" for key in sizes if key in problem)
    try:
        return _predict_attention(op, spec, consts, impl, params, build, problem, calibration)
    except ScheduleTooLong as error:  # name the problem's sizes, which the kernel pass does not know
        raise ValueError(f"{op}: {given}: {error}; fewer (batch, head) pairs or shorter sequences") from None


def _predict_attention(
    op, spec, consts, impl, params, build, problem, calibration
) -> tuple[Terms, float, float]:
    if op == "attention_kvcache_fwd":
        return _predict_kvcache(spec, consts, impl, params, problem)
    _check_overrides(problem)
    if op == "sdpa_attention":  # F.scaled_dot_product_attention on a backend: that backend's fused kernel
        op = "flash_attention"
    dtype = normalize_dtype(problem.pop("dtype", "fp8" if op == "flash_attention_fp8" else "fp16"))
    peak = _attention_peak(spec, dtype)
    shape, cost = _attention_shape(op, dtype, problem)
    forward_tile, backward_tile = _attention_tiles(params, build, shape.head_dim, dtype, problem)
    backward = op.endswith("_backward")
    e = shape.element
    if op == "naive_attention":
        return (
            _predict_eager_attention(op, spec, consts, shape, dtype, calibration),
            cost.flops,
            cost.bytes_moved,
        )
    llm_speed = impl == "llm-speed"
    # llm-speed's launch order is its build's; a vendor's is stated with its parameters.
    # ``launch_order`` ("lpt", "row") forces one (an A/B run that patched the launcher's choice).
    launch = build if llm_speed else params
    order = problem.pop("launch_order", None) or launch.get("attention_launch", "lpt")
    section = lpt_section(spec, order, shape, int(launch.get("attention_lpt_min_rows", LPT_MIN_ROWS)))

    def terms(kernel: KernelPass, tile: Sequence[int]) -> Terms:
        if llm_speed:
            kernel = _as_compiled(kernel, calibration, build, shape, dtype, tile)
        return pass_terms(params, consts, peak, kernel)

    if not backward:
        passes = 2 if op == "tiled_attention" else 1
        forward = _forward_pass(shape, forward_tile, passes=passes, section=section)
        return terms(forward, forward_tile), cost.flops, cost.bytes_moved
    deterministic = pop_flag(problem, "deterministic") if llm_speed else False
    # ``atomic_dq``: the five-matmul path forced where the build's default is the dQ kernel (an A/B row)
    atomic_dq = pop_flag(problem, "atomic_dq") if llm_speed else False
    # Backward: delta = rowsum(dO * O) first (O, dO read, delta written). Its copy of the LSE in base 2 (8
    # more bytes a row) is not priced yet: it moves the shipped fit's attention errors by 0.02%; the next
    # refit takes it in.
    preprocess_bytes = 2 * e * shape.q_elems + 4 * shape.rows
    if llm_speed and (deterministic or (build.get("attention_backward") == "dq_kernel" and not atomic_dq)):
        # The dQ kernel path (7 matmuls per tile): dK/dV, then dQ recomputing S and dP.
        preprocess = memory_pass_terms(params, consts, "preprocess", preprocess_bytes, cdiv(shape.rows, 128))
        dkdv = terms(_dkdv_pass(shape, backward_tile, 4), backward_tile)
        dq = terms(_dq_pass(shape, backward_tile, section), backward_tile)
        return in_sequence([preprocess, dkdv, dq]), cost.flops, cost.bytes_moved
    if llm_speed:
        # The default path (5 matmuls, FlashAttention-2's): the preprocess also zeroes an fp32 dQ, the dK/dV
        # kernel adds dS K to it with atomics, a conversion writes dQ (GQA's dK/dV summed in the kernel).
        preprocess = memory_pass_terms(
            params, consts, "preprocess", preprocess_bytes + 4 * shape.q_elems, cdiv(shape.rows, 128)
        )
        dkdv = _dkdv_pass(shape, backward_tile, 5)
        main = terms(dkdv, backward_tile)
        # Every block iteration adds its BM x d share of dQ with fp32 atomics (one red.global.add per
        # element: Triton's tl.atomic_add): ``atomic_s`` each, device-wide, on top of the kernel's matmuls
        # (measured on the H100 SXM 2026-11-25: the atomic path 23.8 ms at 64x64 x 4 warps, 1 x 16 x 16384
        # d=128 fp16, against 14.3 for the dQ kernel's seven matmuls).
        atomic_s = (
            float(params.get("atomic_s", 0.0))
            * order_blocks(dkdv.programs)
            * backward_tile[0]
            * _pad_dim(shape.head_dim)
        )
        if atomic_s:
            main = replace(main, latency_s=main.latency_s + atomic_s,
                           device_s=None if main.device_s is None else main.device_s + atomic_s)  # fmt: skip
        convert = memory_pass_terms(
            params, consts, "dq_convert", (4 + e) * shape.q_elems, cdiv(shape.q_elems, 1024)
        )
        return in_sequence([preprocess, main, convert]), cost.flops, cost.bytes_moved
    preprocess = memory_pass_terms(params, consts, "preprocess", preprocess_bytes, cdiv(shape.rows, 128))
    # A vendor's one-kernel backward: dQ accumulated in fp32 with atomics, zeroed first and converted after;
    # GQA's dK/dV computed per query head and summed over the group afterwards.
    main = pass_terms(params, consts, peak, _dkdv_pass(shape, backward_tile, 5, per_query_head=True))
    extra = 4 * shape.q_elems + (4 + e) * shape.q_elems  # zero the fp32 dQ, read it, write dQ
    if shape.group > 1:
        extra += 2 * e * shape.kv_elems * shape.group * 2  # expanded dK, dV written and read back
    convert = memory_pass_terms(params, consts, "dq_convert", extra, cdiv(shape.rows, 128))
    return in_sequence([preprocess, main, convert]), cost.flops, cost.bytes_moved


# Eager (plain PyTorch) attention: two batched cuBLAS GEMMs around a softmax that makes several passes over
# the score matrix (scale, max, subtract and exp, sum, divide: ~EAGER_SOFTMAX_PASSES reads and writes).
EAGER_SOFTMAX_PASSES = 5


def _predict_eager_attention(op, spec, consts, shape: AttentionShape, dtype, calibration) -> Terms:
    cublas, _, _ = parameters(spec, "cublas", "gemm", calibration)
    eager, _, _ = parameters(spec, "pytorch", "elementwise", calibration)
    ((seq_q, seq_kv, count),) = shape.per_sequence()
    heads = count * shape.heads_q
    peak = spec.peak_flops("tf32" if dtype == "fp32" else dtype)
    e = shape.element
    score = 4.0 if op == "naive_attention" else e
    common = dict(batch=heads, peak=peak, in_bytes=e, b_bytes=e, extra_bytes=0.0, split=1, dequant=None)
    tile = tuple(cublas["tiles"][0])
    qk = gemm_terms(cublas, consts, m=seq_q, n=seq_kv, k=shape.head_dim, out_bytes=score, tile=tile, **common)
    pv = gemm_terms(cublas, consts, m=seq_q, n=shape.head_dim, k=seq_kv, out_bytes=e, tile=tile, **common)
    scores = heads * seq_q * seq_kv * score
    softmax = memory_pass_terms(
        eager, consts, "softmax", 2 * EAGER_SOFTMAX_PASSES * scores, consts.spec.sm_count
    )
    passes = [qk, softmax, pv]
    passes += [memory_pass_terms(eager, consts, "elementwise", 0.0, 1)] * (EAGER_SOFTMAX_PASSES - 1)
    return in_sequence(passes)
