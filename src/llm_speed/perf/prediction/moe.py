"""The cost model of the mixture-of-experts rows: llm-speed's grouped-GEMM tile restated, grouped GEMMs and
the fused MoE."""

from __future__ import annotations

from llm_speed.core.args import positive_int
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.core.intmath import cdiv, next_power_of_2
from llm_speed.core.tile_choice import SMALLEST_TILE_SIDE
from llm_speed.perf._checks import distinct_experts
from llm_speed.perf.kernel_costs import (
    expected_experts_hit,
)
from llm_speed.perf.prediction.gemm import gemm_terms
from llm_speed.perf.prediction.names import FLOAT_DTYPES, check_computes_in
from llm_speed.perf.prediction.terms import Terms, in_sequence, memory_pass_terms, no_more


def grouped_tile(rows_per_group: int, n: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """llm-speed's grouped-GEMM tile (``llm_speed.moe.grouped_gemm.grouped_config``'s rule restated without
    torch; tests/perf checks the two agree): BLOCK_M the rows per group as a power of two (16 to 128),
    BLOCK_N 128 (64 with the SwiGLU epilogue or row tiles of 32 or less), BLOCK_K 64, 8 warps from
    128x128 accumulator elements on."""
    block_m = min(128, max(SMALLEST_TILE_SIDE, next_power_of_2(rows_per_group)))
    block_n = 64 if swiglu or block_m <= 32 else 128
    block_n = min(block_n, max(SMALLEST_TILE_SIDE, next_power_of_2(n)))
    warps = 8 if block_m * block_n * (2 if swiglu else 1) >= 128 * 128 else 4
    return (block_m, block_n, 64, warps)


def _grouped_terms(params, consts, impl, *, groups, rows, n, k, peak, e, swiglu=False) -> Terms:
    """One grouped GEMM of ``groups`` equal groups of ``rows`` rows (balanced routing: the model does not
    see the ids), out[rows, n] = a[rows, k] @ w_g[k, n] per group: llm-speed's tile rule, or the best of
    cuBLAS's tiles (torch._grouped_mm)."""
    common = dict(m=rows, n=n, k=k, batch=groups, peak=peak, in_bytes=e, b_bytes=e, out_bytes=e,
                  extra_bytes=0.0, split=1, dequant=None)  # fmt: skip
    if impl == "llm-speed":
        return gemm_terms(params, consts, tile=grouped_tile(rows, n, swiglu), **common)
    options = [gemm_terms(params, consts, tile=tuple(t), **common) for t in params["tiles"]]
    return min(options, key=lambda terms: terms.device)


def predict_moe(op, spec, consts, impl, params, problem) -> tuple[Terms, float, float, str]:
    """grouped_gemm(_backward): ``tokens`` rows (all groups), ``groups``, ``n``, ``k``; fused_moe(_backward):
    ``tokens, hidden, intermediate, experts, top_k``. FLOPs and bytes are the op table's
    (``grouped_gemm_work``, ``fused_moe_work``); the time is the kernels' sequence: forward the SwiGLU
    gate/up GEMM, the down GEMM and the combine; backward the gate/up GEMM again, d(act), d(hidden) and the
    two weight gradients (a GEMM over each expert's rows, and the zeros of the experts no token picked). The
    forward also sorts the copies by expert (two short kernels)."""
    dtype = check_computes_in(op, impl, normalize_dtype(problem.pop("dtype", "bf16")), FLOAT_DTYPES)
    e = dtype_bytes(dtype)
    peak = spec.peak_flops(dtype)
    backward = op.endswith("_backward")
    if op.startswith("grouped_gemm"):
        total = positive_int("tokens", problem.pop("tokens"))
        groups = positive_int("groups", problem.pop("groups"))
        n, k = positive_int("n", problem.pop("n")), positive_int("k", problem.pop("k"))
        no_more(problem, op)
        rows = cdiv(total, groups)
        flops = (4.0 if backward else 2.0) * total * n * k
        moved = (total * k + groups * k * n + total * n) * e
        passes = [_grouped_terms(params, consts, impl, groups=groups, rows=rows, n=n, k=k, peak=peak, e=e)]
        if backward:
            moved += (total * k + groups * k * n) * e
            passes = [
                _grouped_terms(params, consts, impl, groups=groups, rows=rows, n=k, k=n, peak=peak, e=e),
                _grouped_terms(params, consts, impl, groups=groups, rows=k, n=n, k=rows, peak=peak, e=e),
            ]
        return in_sequence(passes), flops, moved, dtype
    tokens = positive_int("tokens", problem.pop("tokens"))
    size = positive_int("hidden", problem.pop("hidden"))
    inter = positive_int("intermediate", problem.pop("intermediate"))
    experts = positive_int("experts", problem.pop("experts"))
    top_k = distinct_experts(positive_int("top_k", problem.pop("top_k")), experts)
    no_more(problem, op)
    copies = tokens * top_k
    hit = expected_experts_hit(experts, top_k, tokens)
    groups = max(1, min(experts, round(hit)))
    rows = cdiv(copies, groups)
    expert_bytes = 3.0 * inter * size * e
    weights = hit * expert_bytes
    if backward:
        flops = 16.0 * copies * size * inter + 2.0 * copies * size
        moved = (
            3.0 * tokens * size * e + weights + experts * expert_bytes + 2.0 * copies * (3 * inter + size) * e
        )
    else:
        flops = 6.0 * copies * size * inter + 2.0 * copies * size
        moved = 2.0 * tokens * size * e + weights + 2.0 * copies * (inter + size) * e

    def grouped(rows_, n, k, swiglu=False):
        return _grouped_terms(params, consts, impl, groups=groups, rows=rows_, n=n, k=k, peak=peak, e=e,
                              swiglu=swiglu)  # fmt: skip

    combine = memory_pass_terms(params, consts, "combine", (copies + tokens) * size * e, spec.sm_count)
    # Grouping the copies by expert (moe_sort: count, then place; not in the op table's fused_moe bytes).
    sort = memory_pass_terms(params, consts, "sort", 8.0 * copies, 1)
    if not backward:
        passes = [
            sort,
            sort,
            grouped(rows, 2 * inter, size, swiglu=True),
            grouped(rows, size, inter),
            combine,
        ]
    else:
        # The weight-gradient kernels run over every expert, an expert no token picked writing its zeros
        # (grouped_gemm's wgrad: "an empty group writes zeros"): a stream of those experts' gradients.
        unhit = memory_pass_terms(params, consts, "zero gradients", (experts - groups) * expert_bytes,
                                  spec.sm_count)  # fmt: skip
        passes = [
            grouped(rows, 2 * inter, size, swiglu=True),  # gate/up again (the activations were not kept)
            grouped(rows, inter, size),  # d(act) = dy @ W_down
            grouped(size, inter, rows),  # dW_down = dy^T @ act, per expert
            grouped(rows, size, 2 * inter),  # d(hidden) = dh @ W_gate_up
            grouped(2 * inter, size, rows),  # dW_gate_up = dh^T @ hidden, per expert
            unhit,
            combine,
        ]
    return in_sequence(passes), flops, moved, dtype
