"""The cost models of the streaming rows (RMSNorm, the gated activations, rotary, cross-entropy on logits)
and of the fused linear cross-entropy."""

from __future__ import annotations

from typing import Any

from llm_speed.core.args import positive_int
from llm_speed.core.chunking import linear_cross_entropy_chunk_rows
from llm_speed.core.gpus import dtype_bytes, normalize_dtype
from llm_speed.core.intmath import cdiv
from llm_speed.perf._checks import distinct_experts, grouped_heads
from llm_speed.perf.prediction.calibration_data import parameters
from llm_speed.perf.prediction.gemm import gemm_terms
from llm_speed.perf.prediction.names import FLOAT_DTYPES, check_computes_in
from llm_speed.perf.prediction.terms import Terms, in_sequence, memory_pass_terms, no_more, pop_flag


def elementwise_cost(op: str, problem: dict[str, Any]) -> tuple[float, float, str]:
    """(FLOPs, minimum bytes, dtype) of an elementwise row, by the op table's formulas (``llm_speed.ops``:
    ``rms_norm_work``, ``swiglu_work``, ``rotary_work``; restated here without torch, tests compare them)."""
    dtype = check_computes_in(op, None, normalize_dtype(problem.pop("dtype", "bf16")), FLOAT_DTYPES)
    e = dtype_bytes(dtype)
    if op in ("cross_entropy", "cross_entropy_backward"):  # logits_cross_entropy_work
        tokens, vocab = (
            positive_int("tokens", problem.pop("tokens")),
            positive_int("vocab", problem.pop("vocab")),
        )
        data = tokens * vocab * e
        if op == "cross_entropy_backward":
            return 6.0 * tokens * vocab, 2 * data + 4 * tokens, dtype
        return 4.0 * tokens * vocab, data + 8 * tokens, dtype
    if op.startswith("moe_route"):  # moe_route_work
        tokens = positive_int("tokens", problem.pop("tokens"))
        experts = positive_int("experts", problem.pop("experts"))
        top_k = distinct_experts(positive_int("top_k", problem.pop("top_k")), experts)
        logits = tokens * experts * e
        if op == "moe_route_backward":
            return 6.0 * tokens * experts, 2.0 * logits + 8.0 * tokens * top_k, dtype
        return (4.0 + top_k) * tokens * experts, logits + 8.0 * tokens * top_k, dtype
    if op == "moe_sort":  # moe_sort_work: int32 ids by default
        tokens = positive_int("tokens", problem.pop("tokens"))
        top_k = positive_int("top_k", problem.pop("top_k"))
        experts = positive_int("experts", problem.pop("experts"))
        copies = tokens * distinct_experts(top_k, experts)
        id_bytes = positive_int("id_bytes", problem.pop("id_bytes", 4))
        return 0.0, 2.0 * copies * id_bytes + 8.0 * copies + 4.0 * experts, dtype
    if op.startswith("rms_norm"):
        rows, hidden = (
            positive_int("rows", problem.pop("rows")),
            positive_int("hidden", problem.pop("hidden")),
        )
        act, weight = e * rows * hidden, e * hidden
        if op == "rms_norm_backward":
            return 9.0 * rows * hidden, 3 * act + 2 * weight + 4 * rows, dtype
        return 4.0 * rows * hidden, 2 * act + weight + 4 * rows, dtype
    if op.startswith(("swiglu", "geglu")):
        if "elements" in problem:
            n = positive_int("elements", problem.pop("elements"))
        else:
            n = positive_int("rows", problem.pop("rows")) * positive_int("width", problem.pop("width"))
        # swiglu_work's activation FLOPs per element: SiLU 4, GeGLU's tanh form about 12.
        activation = 12.0 if op.startswith("geglu") else 4.0
        if op.endswith("_backward"):
            return (2 * activation + 2) * n, 5 * n * e, dtype
        return (activation + 1) * n, 3 * n * e, dtype
    if op.startswith("apply_rotary_qk"):  # rotary_qk_work: cos and sin [seq, rotary_dim]
        batch, seq = positive_int("batch", problem.pop("batch", 1)), positive_int("seq", problem.pop("seq"))
        heads_q = positive_int("heads_q", problem.pop("heads_q"))
        heads_kv = grouped_heads(heads_q, problem.pop("heads_kv", None))
        head_dim = positive_int("head_dim", problem.pop("head_dim"))
        rotary_dim = _rotary_dim(problem.pop("rotary_dim", head_dim), head_dim)
        rows = batch * (heads_q + heads_kv) * seq
        return 6.0 * rows * (rotary_dim // 2), 2 * rows * head_dim * e + 2 * seq * rotary_dim * e, dtype
    batch, heads = positive_int("batch", problem.pop("batch", 1)), positive_int("heads", problem.pop("heads"))
    seq, head_dim = positive_int("seq", problem.pop("seq")), positive_int("head_dim", problem.pop("head_dim"))
    rotary_dim = _rotary_dim(problem.pop("rotary_dim", head_dim), head_dim)
    pairs = batch * heads * seq * (rotary_dim // 2)
    return 6.0 * pairs, 2 * batch * heads * seq * head_dim * e + 2 * seq * (rotary_dim // 2) * e, dtype


def _rotary_dim(value: Any, head_dim: int) -> int:
    """The rotated dims of a rotary row, as its kernels accept them (``llm_speed.fused.rotary`` and
    ``rotary_qk``: cos and sin give one angle per pair): an even number from 2 to ``head_dim``."""
    rotary_dim = positive_int("rotary_dim", value)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"rotary_dim must be an even number from 2 to head_dim ({head_dim}), got {rotary_dim}"
        )
    return rotary_dim


def predict_elementwise(op, spec, consts, impl, params, problem) -> tuple[Terms, float, float, str]:
    flops, moved, dtype = elementwise_cost(op, problem)
    no_more(problem, op)
    table = params.get("kernels", {}).get(op, {})
    kernels = int(table.get("kernels", params.get("kernels_default", 1)))
    traffic = float(table.get("traffic", 1.0))
    rows_per_program = int(params.get("rows_per_program", 1))
    programs = max(1, int(moved / max(1.0, float(params.get("bytes_per_program", 65536)))))
    del rows_per_program
    passes = [memory_pass_terms(params, consts, op, moved * traffic / kernels, programs)] * kernels
    return in_sequence(passes), flops, moved, dtype


def predict_cross_entropy(op, spec, consts, impl, params, problem, calibration):
    """The linear cross-entropy: the logits GEMM(s), the softmax's exponentials, and the logits' traffic
    (llm-speed: chunks in the dtype of rows, the weight read once per chunk; eager: the whole [N, V] logits
    in the dtype, then in fp32). Forward 2NVH. Backward: llm-speed 6NVH (logits again, dhidden, dweight),
    eager 4NVH (it kept the logits). ``gradients=True`` (llm-speed, a reduced loss with grad): the forward
    makes dhidden and dweight with the logits (6NVH) and the backward only scales them by the loss
    gradient (one pass over them)."""
    dtype = check_computes_in(op, impl, normalize_dtype(problem.pop("dtype", "bf16")), FLOAT_DTYPES)
    tokens = positive_int("tokens", problem.pop("tokens"))
    hidden = positive_int("hidden", problem.pop("hidden"))
    vocab = positive_int("vocab", problem.pop("vocab"))
    gradients = pop_flag(problem, "gradients")  # a real bool: 1 or 0.0 are refused, as every flag
    no_more(problem, op)
    if gradients and impl != "llm-speed":
        raise ValueError(f"gradients=True is llm-speed's forward (a reduced loss with grad), not {impl}'s")
    e = dtype_bytes(dtype)
    backward = op.endswith("_backward")
    operands = (tokens + vocab) * hidden * e
    if backward and gradients:  # the gradients made in the forward, read, scaled and written once
        flops, moved = float((tokens + vocab) * hidden), 2 * operands
        return memory_pass_terms(params, consts, "elementwise", moved, spec.sm_count), flops, moved, dtype
    made = backward or gradients  # this call makes dhidden and dweight
    # the logits (but eager's backward kept them), then dhidden and dweight
    gemms = (0 if backward and impl != "llm-speed" else 1) + (2 if made else 0)
    flops = gemms * 2.0 * tokens * vocab * hidden + 4.0 * tokens * vocab * (2 if gradients else 1)
    moved = operands * (2 if made else 1)
    gemm_impl = "llm-speed" if impl == "llm-speed" else "cublas"
    gparams, _, _ = parameters(spec, gemm_impl, "gemm", calibration)
    peak = spec.peak_flops(dtype)
    if impl == "llm-speed":
        # the op's own chunk rule; the weight is read once per chunk, the chunk's logits written and read back
        # (and, making the gradients, read and written by the gradient kernel and read by the two GEMMs)
        chunk = linear_cross_entropy_chunk_rows(tokens, hidden, vocab)
        logits_bytes = (4 if made else 2) * tokens * vocab * e
    else:
        # Eager: the [N, V] logits in the dtype, upcast to fp32, log-softmax and the loss over them.
        chunk = tokens
        logits_bytes = (2 if backward else 1) * tokens * vocab * (2 * e + 12)
    chunks = cdiv(tokens, chunk)
    terms = []
    for _ in range(gemms):
        terms.append(
            gemm_terms(
                gparams,
                consts,
                m=tokens,
                n=vocab,
                k=hidden,
                batch=1,
                peak=peak,
                in_bytes=e,
                b_bytes=e,
                out_bytes=e,
                extra_bytes=(chunks - 1) * vocab * hidden * e,
                tile=tuple(gparams["tiles"][0]),
                split=1,
                dequant=None,
            )
        )
    softmax = memory_pass_terms(params, consts, "softmax", logits_bytes, spec.sm_count)
    exps = tokens * vocab * (2 if gradients else 1) / consts.sfu_per_s
    softmax = Terms(**{**softmax.__dict__, "compute_s": exps, "exp_s": exps})
    return in_sequence([*terms, softmax]), flops, moved, dtype
