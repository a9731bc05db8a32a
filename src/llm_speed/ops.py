"""The table of llm-speed's ops: one :class:`Op` row per op, read by the profiler, ``llm-speed doctor`` and
``llm-speed bench``. Adding an op is one file (kernel, launcher, public function) plus one row here.

How the row is used:

- **Work reports.** Whatever path computes an op (a Triton launcher, or the plain-PyTorch fallback on a CPU
  without the interpreter) calls ``llm_speed.core.runtime.report_work(row.name, **problem)`` once per call.
  The profiler looks the row up with :func:`get` and turns ``row.work(**problem)`` into FLOPs and bytes for
  the ``profile`` blocks that are open. An op name with no row is an error: a report can never be lost
  silently.
- **Probes.** ``llm-speed doctor`` runs :meth:`Op.run_probe` (a tiny call of the public function: the row's
  ``probe``, else its ``example`` at :data:`PROBE_SIZE`) for every row with either, and reports what ran under
  ``row.title``; any failing probe makes it exit 1.
- **Benchmarks.** ``llm-speed bench op NAME`` times any row with an ``example`` problem against its
  ``baseline`` (the PyTorch function with the same signature), with FLOPs and bytes from the row's cost.
  The attention and GEMM families also have their own benchmarks: ``llm-speed bench <row.bench>`` times the
  row under ``--impl row.bench_name`` against ``row.alternatives`` (the ``--impl`` names of other libraries'
  implementations); :func:`bench_impls` gives the accepted ``--impl`` values.

The module imports neither torch nor any kernel: cost functions use the torch-free analytic model
(:mod:`llm_speed.perf.kernel_costs`) and read only shapes, dtypes and devices of the reported tensors; probes
and public functions are imported when first used. Row format: docs/architecture.md.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

from llm_speed.perf.kernel_costs import (
    attention_cost,
    gemm_cost,
    kvcache_decode_cost,
    varlen_attention_cost,
    window_attention_cost,
)

# Score-matrix dtype of the attention implementations that materialise scores, when it differs from the
# inputs' (``attention_cost(score_dtype=...)``): llm-speed's naive_attention computes its scores in fp32.
ATTENTION_SCORE_DTYPES = {"naive": "fp32"}


@dataclasses.dataclass(frozen=True)
class Work:
    """What one reported call cost: analytic FLOPs and minimum DRAM bytes, the dtype whose peak applies
    (a name or torch.dtype) and the device it ran on."""

    flops: float
    bytes_moved: float
    dtype: Any
    device: Any


@dataclasses.dataclass(frozen=True)
class Op:
    """One row of the op table.

    ``name``: the key the op's work is reported under (``report_work(name, ...)``) and the row's id.
    ``function``: ``"module:attribute"`` of the public function (imported on first :meth:`load`).
    ``cost``: ``cost(**problem) -> Work | None`` for the keyword arguments its ``report_work`` passes; None
    for an empty problem (it costs nothing and is not recorded).
    ``probe``: ``probe(device)`` makes tiny inputs on ``device`` and calls the public function once; when
    None, doctor calls the function on ``example(device, None, PROBE_SIZE)``; rows with neither are not
    probed. ``label``: doctor's name for it (default ``name``).
    ``example``: ``example(device, dtype, size) -> (args, kwargs)``, a problem of the given scale for the
    public function (``dtype`` None: the device's default, fp16 on a GPU and fp32 on a CPU).
    ``baseline``: ``"module:attribute"`` of the PyTorch function ``bench op`` compares with (same call).
    ``bench``: the benchmark that times it ("attention", "gemm") or None; ``bench_name`` its ``--impl`` name
    there; ``alternatives``: the ``--impl`` names it is compared with there.
    ``plain_pytorch``: written in plain PyTorch on purpose (no Triton kernel is expected to launch).

    ``cost``, ``probe`` and ``example`` are functions or ``"module:attribute"`` strings naming one (loaded on
    first use, so a row can point into its op's own file without this module importing it).
    """

    name: str
    function: str
    cost: Callable[..., Work | None] | str
    probe: Callable[[Any], Any] | str | None = None
    label: str | None = None
    bench: str | None = None
    bench_name: str | None = None
    alternatives: tuple[str, ...] = ()
    plain_pytorch: bool = False
    example: Callable[[Any, Any, int], tuple[tuple, dict]] | str | None = None
    baseline: str | None = None

    @property
    def title(self) -> str:
        """How doctor and the profiler name the row."""
        return self.label or self.name

    def load(self) -> Callable[..., Any]:
        """The public function."""
        return _load(self.function)

    def load_baseline(self) -> Callable[..., Any] | None:
        """The baseline function ``bench op`` compares with, or None."""
        return _load(self.baseline) if self.baseline else None

    def work(self, **problem: Any) -> Work | None:
        """The cost of one reported call (``problem``: what the op passed to ``report_work``)."""
        return _function(self.cost)(**problem)

    def example_problem(self, device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the example problem of scale ``size``; ValueError when there is none."""
        if self.example is None:
            raise ValueError(f"op {self.name}: no example problem")
        return _function(self.example)(device, dtype, size)

    def run_probe(self, device: Any) -> Any:
        """One tiny call: ``probe(device)``, or the function on its example at :data:`PROBE_SIZE`."""
        if self.probe is not None:
            return _function(self.probe)(device)
        args, kwargs = self.example_problem(device, None, PROBE_SIZE)
        return self.load()(*args, **kwargs)


def _load(path: str) -> Callable[..., Any]:
    module, attribute = path.split(":")
    return getattr(importlib.import_module(module), attribute)


def _function(value: Callable[..., Any] | str) -> Callable[..., Any]:
    return _load(value) if isinstance(value, str) else value


# --- cost functions: the problem a path reports -> Work --------------------------------------------------


def attention_work(impl: str, mode: str) -> Callable[..., Work | None]:
    """Cost of an attention call reported as ``(q=[B, Hq, Sq, D], k=[B, Hkv, Skv, D], is_causal=bool)``,
    with the DRAM-traffic model of ``impl`` (see :func:`llm_speed.perf.kernel_costs.attention_cost`)."""

    def cost(*, q: Any, k: Any, is_causal: bool, window: Any = None, **_: Any) -> Work | None:
        if q.numel() == 0 or k.numel() == 0:
            return None
        batch, heads_q, seq_q, head_dim = q.shape
        out_dtype = "bf16" if q.element_size() == 1 else None  # fp8 attention writes bfloat16
        if window is not None and window != (None, None):
            # A window shrinks the FLOPs to the visible pairs (flash's minimum bytes are unchanged).
            total = window_attention_cost(
                batch, heads_q, seq_q, k.shape[2], head_dim, heads_kv=k.shape[1], dtype=q.dtype,
                is_causal=bool(is_causal), window=window, mode=mode,
            )  # fmt: skip
            return Work(total.flops, total.bytes_moved, q.dtype, q.device)
        total = attention_cost(
            batch, heads_q, seq_q, k.shape[2], head_dim,
            heads_kv=k.shape[1], dtype=q.dtype, causal=bool(is_causal), mode=mode, impl=impl,
            score_dtype=ATTENTION_SCORE_DTYPES.get(impl), out_dtype=out_dtype,
        )  # fmt: skip
        return Work(total.flops, total.bytes_moved, q.dtype, q.device)

    return cost


def varlen_work(mode: str) -> Callable[..., Work | None]:
    """Cost of a packed-sequence call reported as ``(q=[Tq, Hq, D], k=[Tk, Hkv, D], cu_seqlens_q=,
    cu_seqlens_k=, is_causal=, window=)``, keys per sequence from ``seqused_k=`` when given, k as pages
    ``[num_pages, page_size, Hkv, D]`` with ``block_table=``: FLOPs summed per sequence
    (:func:`llm_speed.perf.kernel_costs.varlen_attention_cost`). Reads the lengths on the host: profiler only.
    """

    def cost(*, q: Any, k: Any, cu_seqlens_q: Any, cu_seqlens_k: Any, is_causal: bool, window: Any = None,
             seqused_k: Any = None, block_table: Any = None, **_: Any) -> Work | None:  # fmt: skip
        if q.numel() == 0 or k.numel() == 0:
            return None
        lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
        if seqused_k is not None:
            lengths_k = seqused_k.tolist()
        else:
            lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).tolist()
        heads_kv = k.shape[1] if block_table is None else k.shape[2]
        total = varlen_attention_cost(
            lengths_q, lengths_k, q.shape[1], q.shape[2], heads_kv=heads_kv, dtype=q.dtype,
            is_causal=bool(is_causal), window=window, mode=mode,
        )  # fmt: skip
        return Work(total.flops, total.bytes_moved, q.dtype, q.device)

    return cost


def gemm_work(*, op_a: Any, op_b: Any, out: Any, **_: Any) -> Work | None:
    """Cost of a GEMM reported as ``(op_a [.., M, K], op_b [.., K, N], out [.., M, N])`` (batch dims lead)."""
    if out.numel() == 0 or op_a.shape[-1] == 0:
        return None
    batch = out.numel() // (out.shape[-2] * out.shape[-1])  # product of the leading (batch) dims
    # The cost model sizes outputs by dtype name; int32 (int8 GEMM results) has fp32's 4-byte width.
    out_dtype = "fp32" if str(out.dtype) == "torch.int32" else out.dtype
    total = gemm_cost(
        out.shape[-2], out.shape[-1], op_a.shape[-1], dtype=op_a.dtype, out_dtype=out_dtype, batch=batch
    )
    return Work(total.flops, total.bytes_moved, op_a.dtype, out.device)


def quantize_fp8_work(*, x: Any, granularity: str, **_: Any) -> Work | None:
    """Cost of ``quantize_fp8`` of ``x [rows, cols]``: x read once (twice for per-tensor scaling: the amax
    pass, then the cast), one byte per element written, and the float32 scales; about 4 FLOPs per element
    (abs and max for the amax, divide, clamp)."""
    rows, cols = x.shape
    elements = rows * cols
    if not elements:
        return None
    reads = 2 if granularity == "tensor" else 1
    scales = {"tensor": 1, "row": rows, "1x128": rows * -(-cols // 128)}.get(
        granularity, -(-rows // 128) * -(-cols // 128)
    )
    moved = reads * elements * x.element_size() + elements + 4 * scales
    return Work(4.0 * elements, moved, x.dtype, x.device)


def kvcache_work(
    *, q: Any, k_cache: Any, cache_seqlens: Any, seq_new: int, window: Any, cache_leftpad: Any = None,
    **_: Any,
) -> Work | None:
    """Cost of a KV-cache call (row ``attention_kvcache_fwd``): the sum of
    :func:`llm_speed.perf.kernel_costs.kvcache_decode_cost` over the sequences, each over the keys its rows
    can see (``cache_seqlens + seq_new - cache_leftpad``, at most ``left + seq_q`` under a left window) and
    the (query, key) pairs they compute under ``window`` (which carries causal as right = 0), the cache at
    its own element size (1 byte for an fp8 cache). Reads the lengths on the host: only the profiler calls
    it."""
    _, seq_q, heads_q, head_dim = q.shape
    if q.numel() == 0:
        return None
    left = window[0] if window is not None else None
    lengths = cache_seqlens.reshape(-1).tolist()
    pads = [0] * len(lengths) if cache_leftpad is None else cache_leftpad.reshape(-1).tolist()
    flops = moved = 0.0
    for cached, pad in zip(lengths, pads, strict=True):
        context = int(cached) + seq_new - int(pad)
        visible = context if left is None else min(context, left + seq_q)
        if visible <= 0:
            continue
        # (the last left + seq_q keys hold every pair a left window lets the queries compute)
        cost = kvcache_decode_cost(
            1, heads_q, seq_q, visible, head_dim, heads_kv=k_cache.shape[2], dtype=q.dtype,
            seq_new=min(seq_new, visible), kv_dtype=k_cache.dtype,
            window=None if window is None else tuple(window),
        )  # fmt: skip
        flops, moved = flops + cost.flops, moved + cost.bytes_moved
    return Work(flops, moved, q.dtype, q.device) if moved else None


def rms_norm_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of an RMSNorm call ``(x=[rows, hidden], weight=[hidden] or None)``: the minimum DRAM traffic
    (forward: x, weight in; y, fp32 rstd out. backward: dy, x, weight, rstd in; dx, dweight out) and FLOPs
    counted per element (forward: square, sum, two products = 4; backward: about 9 for dx and dweight
    together)."""

    def cost(*, x: Any, weight: Any, **_: Any) -> Work:
        rows, hidden = x.shape
        act = x.element_size() * rows * hidden
        w = 0 if weight is None else weight.element_size() * hidden
        if backward:
            return Work(9.0 * rows * hidden, 3 * act + 2 * w + 4 * rows, x.dtype, x.device)
        return Work(4.0 * rows * hidden, 2 * act + w + 4 * rows, x.dtype, x.device)

    return cost


def swiglu_work(backward: bool = False, activation_flops: float = 4.0) -> Callable[..., Work | None]:
    """Cost of a SwiGLU (or GeGLU) call ``(gate=...)``: the minimum DRAM traffic (forward: gate, up in, out
    out; backward: dout, gate, up in, dgate, dup out) and FLOPs per element: the activation (SiLU's sigmoid as
    exp, add, divide, product: 4; GeGLU's tanh form: about 12), one product forward; twice the activation
    and four products backward."""

    def cost(*, gate: Any, **_: Any) -> Work:
        n, size = gate.numel(), gate.element_size()
        flops = 2 * activation_flops + 2 if backward else activation_flops + 1
        moved = 5 * n * size if backward else 3 * n * size
        return Work(flops * n, moved, gate.dtype, gate.device)

    return cost


def rotary_work(*, x: Any, cos: Any, **_: Any) -> Work:
    """Cost of a rotary call (forward and backward alike): x read and the output written whole (the dims past
    ``rotary_dim`` are copied), cos and sin read once each; 6 FLOPs per rotated pair (4 products, 2 sums)."""
    batch, heads, seq, _ = x.shape
    pairs = batch * heads * seq * cos.shape[-1]
    moved = 2 * x.numel() * x.element_size() + 2 * cos.numel() * cos.element_size()
    return Work(6.0 * pairs, moved, x.dtype, x.device)


def cross_entropy_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of a fused linear cross-entropy call ``(hidden=[N, H], weight=[V, H])``: the chunk GEMMs (forward:
    the logits, 2NVH; backward: logits again, dhidden and dweight, 6NVH) plus about 4 FLOPs per logit for the
    softmax, and the minimum DRAM traffic: hidden and weight read (and their gradients written, backward),
    nothing of the ``[N, V]`` logits, which never leave the chunk. A forward that also makes the gradients
    (``gradients=(dhidden?, dweight?)``, a reduced loss with grad) adds 2NVH per gradient and 4 FLOPs per
    logit for d loss / d logits, and writes the gradients; its backward (``scaled=(tensors)``) multiplies
    them by the loss gradient: an element's read, product and write."""

    def cost(*, hidden: Any = None, weight: Any = None, gradients: tuple = (), scaled: tuple = (),
             **_: Any) -> Work:  # fmt: skip
        if backward and hidden is None:
            numel = sum(t.numel() for t in scaled)
            moved = sum(2 * t.numel() * t.element_size() for t in scaled)
            return Work(float(numel), moved, scaled[1].dtype, scaled[1].device)
        n, h = hidden.shape
        v = weight.shape[0]
        sizes = (n * hidden.element_size(), v * weight.element_size())
        operands = sum(sizes) * h
        if backward:
            return Work(6.0 * n * v * h + 4.0 * n * v, 2 * operands, hidden.dtype, hidden.device)
        made = [size * h for size, wanted in zip(sizes, gradients, strict=False) if wanted]
        flops = 2.0 * n * v * h * (1 + len(made)) + 4.0 * n * v * (2 if made else 1)
        return Work(flops, operands + sum(made), hidden.dtype, hidden.device)

    return cost


def logits_cross_entropy_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of a cross-entropy call on logits ``(logits=[N, V])``: the logits read once (forward; about 4
    FLOPs per logit for the online softmax) or read and their gradient written (backward; about 6 FLOPs per
    logit), plus a float32 statistic per row."""

    def cost(*, logits: Any, **_: Any) -> Work:
        n, v = logits.shape
        data = n * v * logits.element_size()
        if backward:
            return Work(6.0 * n * v, 2 * data + 4 * n, logits.dtype, logits.device)
        return Work(4.0 * n * v, data + 8 * n, logits.dtype, logits.device)

    return cost


def grouped_gemm_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of a grouped GEMM ``(a=[total, K], b=[groups, K, N] or [groups, N, K], out=[total, N])`` (the
    backward reports ``out`` = the output's gradient): 2 * total * N * K FLOPs (x2 backward: da and db), and
    a, out each moved once, b read for the groups that have rows (empty groups have no tiles): the
    ``G (1 - (1 - 1/G)^total)`` expected for rows spread uniformly, as the cost reads no offsets
    (:func:`llm_speed.perf.kernel_costs.expected_experts_hit`). Backward: dout, a and those groups of b read,
    da and every group's db written."""

    def cost(*, a: Any, b: Any, out: Any, **_: Any) -> Work | None:
        from llm_speed.perf.kernel_costs import expected_experts_hit

        total, k = a.shape
        n = out.shape[1]
        if total == 0 or n == 0 or k == 0:
            return None
        groups = b.shape[0]
        b_bytes = b.numel() * b.element_size()
        b_read = b_bytes * expected_experts_hit(groups, 1, total) / groups
        moved = a.numel() * a.element_size() + b_read + out.numel() * out.element_size()
        if backward:
            moved += a.numel() * a.element_size() + b_bytes
        return Work((4.0 if backward else 2.0) * total * n * k, float(moved), a.dtype, a.device)

    return cost


def rotary_qk_work(*, q: Any, k: Any, cos: Any, **_: Any) -> Work:
    """Cost of a q-and-k rotary call (forward and backward alike): q and k read and their outputs written
    whole (dims past the rotary ones copied), cos and sin read once per position block (counted once); 6 FLOPs
    per rotated pair (4 products, 2 sums)."""
    rotary_dim = cos.shape[-1]
    pairs = (q.numel() + k.numel()) // q.shape[-1] * (rotary_dim // 2)
    moved = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * cos.numel() * cos.element_size()
    return Work(6.0 * pairs, moved, q.dtype, q.device)


def moe_route_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of a routing call ``(router_logits=[tokens, experts], top_k=k)``: about ``4 + k`` FLOPs per score
    (softmax or sigmoid, then k rounds of max; the backward about 6), the logits read and 8 bytes per choice
    written (backward: the logits, the weights' gradient and the ids read, the logits' gradient written)."""

    def cost(*, router_logits: Any, top_k: int, **_: Any) -> Work | None:
        tokens, experts = router_logits.shape
        logits = router_logits.numel() * router_logits.element_size()
        if backward:
            return Work(6.0 * tokens * experts, 2.0 * logits + 8.0 * tokens * top_k, router_logits.dtype,
                        router_logits.device)  # fmt: skip
        return Work((4.0 + top_k) * tokens * experts, logits + 8.0 * tokens * top_k, router_logits.dtype,
                    router_logits.device)  # fmt: skip

    return cost


def moe_sort_work(*, topk_ids: Any, num_experts: int, **_: Any) -> Work | None:
    """Cost of grouping token copies by expert ``(topk_ids=[tokens, k], num_experts=E)``: no matrix FLOPs; the
    ids read twice (count, place), ``order`` and ``inverse`` written (4 bytes each per copy), ``offsets``."""
    copies = topk_ids.numel()
    moved = 2.0 * copies * topk_ids.element_size() + 8.0 * copies + 4.0 * num_experts
    return Work(0.0, moved, "fp32", topk_ids.device)


def fused_moe_work(backward: bool = False) -> Callable[..., Work | None]:
    """Cost of a fused MoE call ``(hidden=[T, H], w_gate_up=[E, 2I, H], w_down=[E, H, I], topk_ids=[T, k])``.

    FLOPs: the expert GEMMs of the ``T*k`` copies, 6 T k H I forward (gate/up 4, down 2) and 16 T k H I
    backward (the gate/up GEMM recomputed, 4, then d(act) 2, d(hidden) 4, dW_gate_up 4, dW_down 2), plus the
    combine's 2 T k H. Bytes: hidden (and dout) read; the weights of the experts T tokens are expected to hit
    (``E (1 - (1 - k/E)^T)``, :func:`llm_speed.perf.kernel_costs.expected_experts_hit`: the cost reads no ids)
    read, and every expert's gradient written; the intermediates each written and read once (forward: act
    ``T k I``, y ``T k H``; backward: dh ``T k 2I``, act, dx ``T k H``); the output written.
    """

    def cost(*, hidden: Any, w_gate_up: Any, w_down: Any, topk_ids: Any, **_: Any) -> Work | None:
        from llm_speed.perf.kernel_costs import expected_experts_hit

        tokens, size = hidden.shape
        experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
        top_k = topk_ids.shape[1]
        copies = tokens * top_k
        if copies == 0:
            return None
        e = hidden.element_size()
        expert_bytes = 3.0 * inter * size * e
        weights = expected_experts_hit(experts, top_k, tokens) * expert_bytes
        if backward:
            flops = 16.0 * copies * size * inter + 2.0 * copies * size
            moved = 3.0 * tokens * size * e + weights + experts * expert_bytes
            moved += 2.0 * copies * (3 * inter + size) * e
        else:
            flops = 6.0 * copies * size * inter + 2.0 * copies * size
            moved = 2.0 * tokens * size * e + weights + 2.0 * copies * (inter + size) * e
        return Work(flops, moved, hidden.dtype, hidden.device)

    return cost


# --- probes: one tiny call of each public op ---------------------------------------------------------------

# Tiny shapes: enough to launch every kernel once, cheap even in Triton's interpreter.
PROBE_SEQ = 16
PROBE_HEAD_DIM = 16
PROBE_GEMM = 32
PROBE_SIZE = 32  # the ``size`` doctor gives a row's ``example`` when it has no ``probe``


def _probe_float_dtype(device: Any) -> Any:
    import torch

    return torch.float16 if device.type == "cuda" else torch.float32


def default_dtype(device: Any, dtype: Any = None) -> Any:
    """``dtype`` as a torch.dtype (names like "bf16" accepted), or fp16 on a GPU and fp32 on a CPU."""
    import torch

    if dtype is None:
        return _probe_float_dtype(device)
    if isinstance(dtype, torch.dtype):
        return dtype
    from llm_speed.core.gpus import normalize_dtype

    names = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "int8": torch.int8}
    canonical = normalize_dtype(dtype)
    if canonical not in names:
        raise ValueError(f"dtype: {dtype!r} is not supported here; accepted: {', '.join(names)}")
    return names[canonical]


def attention_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """q, k, v ``[1, 8, size, 64]`` (``size`` = sequence length), causal."""
    import torch

    dtype = default_dtype(device, dtype)
    q, k, v = (torch.randn(1, 8, size, 64, device=device, dtype=dtype) for _ in range(3))
    return (q, k, v), {"is_causal": True}


def gemm_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """a, b ``[size, size]``."""

    dtype = default_dtype(device, dtype)
    return tuple(_matrices(device, dtype, size)), {}


def rms_norm_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """x ``[size, size]`` (rows x hidden) and a weight."""
    import torch

    dtype = default_dtype(device, dtype)
    x = torch.randn(size, size, device=device, dtype=dtype)
    return (x, torch.randn(size, device=device, dtype=dtype)), {}


def swiglu_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """gate, up ``[size, size]``."""
    import torch

    dtype = default_dtype(device, dtype)
    return tuple(torch.randn(size, size, device=device, dtype=dtype) for _ in range(2)), {}


def rotary_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """x ``[1, 8, size, 64]`` (``size`` = sequence length), cos and sin of Llama's angles."""
    import torch

    dtype = default_dtype(device, dtype)
    angles = torch.arange(size, device=device, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(32, device=device, dtype=torch.float32) / 32)
    )
    x = torch.randn(1, 8, size, 64, device=device, dtype=dtype)
    return (x, angles.cos().to(dtype), angles.sin().to(dtype)), {}


def cross_entropy_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """hidden ``[size, size]``, weight ``[4 size, size]`` (vocabulary 4 size), random targets."""
    import torch

    dtype = default_dtype(device, dtype)
    hidden = torch.randn(size, size, device=device, dtype=dtype)
    weight = torch.randn(4 * size, size, device=device, dtype=dtype) * size**-0.5
    return (hidden, weight, torch.randint(0, 4 * size, (size,), device=device)), {}


def geglu_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """gate, up ``[size, size]``."""
    return swiglu_example(device, dtype, size)


def logits_cross_entropy_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """logits ``[size, 4 size]`` (vocabulary 4 size), random targets."""
    import torch

    dtype = default_dtype(device, dtype)
    logits = torch.randn(size, 4 * size, device=device, dtype=dtype) * 3
    return (logits, torch.randint(0, 4 * size, (size,), device=device)), {}


def rotary_qk_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """q ``[1, 8, size, 64]``, k ``[1, 2, size, 64]`` (GQA), Hugging Face's cos/sin ``[1, size, 64]`` of
    Llama's angles (``size`` = sequence length)."""
    import torch

    dtype = default_dtype(device, dtype)
    freqs = torch.arange(size, device=device, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(32, device=device, dtype=torch.float32) / 32)
    )
    emb = torch.cat((freqs, freqs), -1)[None]
    q = torch.randn(1, 8, size, 64, device=device, dtype=dtype)
    k = torch.randn(1, 2, size, 64, device=device, dtype=dtype)
    return (q, k, emb.cos().to(dtype), emb.sin().to(dtype)), {}


def _rotary_qk_backward_probe(device: Any) -> Any:
    """apply_rotary_qk's example at :data:`PROBE_SIZE`, q and k requiring grad, then a backward of both
    outputs."""
    from llm_speed.fused.rotary_qk import apply_rotary_qk

    (q, k, cos, sin), _ = rotary_qk_example(device, None, PROBE_SIZE)
    q, k = q.requires_grad_(), k.requires_grad_()
    q_embed, k_embed = apply_rotary_qk(q, k, cos, sin)
    (q_embed.float().sum() + k_embed.float().sum()).backward()
    return [q.grad, k.grad]


def _group_counts(total: int, groups: int) -> list[int]:
    """Uneven group sizes summing to ``total``: empty groups, a heavy one, the rest spread."""
    pattern = [1, 0, 3, 1, 0, 2, 1, 0]
    weights = [pattern[g % len(pattern)] for g in range(groups)]
    counts = [total * w // sum(weights) for w in weights]
    counts[-1] += total - sum(counts)
    return counts


def grouped_gemm_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """a ``[4 size, size]`` in 8 uneven groups (two empty), b ``[8, size, size]``."""
    import torch

    dtype = default_dtype(device, dtype)
    counts = _group_counts(4 * size, 8)
    offsets = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
    a = torch.randn(4 * size, size, device=device, dtype=dtype)
    b = torch.randn(8, size, size, device=device, dtype=dtype) * size**-0.5
    return (a, b, offsets), {}


def moe_route_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """router logits ``[size, 64]``, top-8, softmax renormalised."""
    import torch

    dtype = default_dtype(device, dtype)
    return (torch.randn(size, 64, device=device, dtype=dtype),), {"top_k": 8}


def moe_sort_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """``[size, 8]`` random expert ids of 64."""
    import torch

    return (torch.randint(0, 64, (size, 8), device=device, dtype=torch.int32),), {"num_experts": 64}


def fused_moe_example(device: Any, dtype: Any, size: int) -> tuple[tuple, dict]:
    """``size`` tokens of hidden ``size``, 8 experts of intermediate ``size / 2`` (at least 16), top-2
    softmax routing."""
    import torch

    dtype = default_dtype(device, dtype)
    inter = max(16, size // 2)
    hidden = torch.randn(size, size, device=device, dtype=dtype)
    w_gate_up = torch.randn(8, 2 * inter, size, device=device, dtype=dtype) * size**-0.5
    w_down = torch.randn(8, size, inter, device=device, dtype=dtype) * inter**-0.5
    weights, ids = torch.randn(size, 8, device=device).softmax(-1).topk(2, dim=-1)
    return (hidden, w_gate_up, w_down, weights, ids.to(torch.int32)), {}


def _varlen_probe(device: Any) -> Any:
    """Three packed causal sequences of 5, 0 and 11 tokens, GQA 4/2, head_dim 16."""
    import torch

    from llm_speed.attention.varlen import flash_attention_varlen

    dtype = _probe_float_dtype(device)
    cu = torch.tensor([0, 5, 5, 16], dtype=torch.int32, device=device)
    q = torch.randn(16, 4, 16, device=device, dtype=dtype)
    k, v = (torch.randn(16, 2, 16, device=device, dtype=dtype) for _ in range(2))
    return flash_attention_varlen(q, k, v, cu, cu, 11, 11, is_causal=True)


def _kvcache_probe(device: Any) -> Any:
    """2 sequences (40 and 25 cached tokens) over a paged cache of 16-token pages, GQA 4/2, head_dim 32, one
    token appended."""
    import torch

    from llm_speed.attention.decode import flash_attention_with_kvcache

    dtype = _probe_float_dtype(device)
    k_cache, v_cache = (torch.randn(8, 16, 2, 32, device=device, dtype=dtype) for _ in range(2))
    block_table = torch.arange(8, dtype=torch.int32, device=device).reshape(2, 4)
    q = torch.randn(2, 1, 4, 32, device=device, dtype=dtype)
    k, v = (torch.randn(2, 1, 2, 32, device=device, dtype=dtype) for _ in range(2))
    cache_seqlens = torch.tensor([40, 25], dtype=torch.int32, device=device)
    return flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, block_table=block_table, is_causal=True
    )


def _qkv(device: Any, *, requires_grad: bool = False) -> list[Any]:
    import torch

    shape = (1, 2, PROBE_SEQ, PROBE_HEAD_DIM)
    dtype = _probe_float_dtype(device)
    return [torch.randn(shape, device=device, dtype=dtype, requires_grad=requires_grad) for _ in range(3)]


def attention_probe(function: str) -> Callable[[Any], Any]:
    """Probe: the public attention function ``function`` ("module:attribute"), causal, forward only."""

    def probe(device: Any) -> Any:
        module, attribute = function.split(":")
        return getattr(importlib.import_module(module), attribute)(*_qkv(device), is_causal=True)

    return probe


def _fp8_attention_probe(device: Any) -> Any:
    """fp8 attention (e4m3 q, k, v; per-KV-head descales), causal, GQA 4/2, head_dim 32."""
    import torch

    from llm_speed.attention.flash import flash_attention

    q = torch.randn(1, 4, 9, 32, device=device).to(torch.float8_e4m3fn)
    k, v = (torch.randn(1, 2, 9, 32, device=device).to(torch.float8_e4m3fn) for _ in range(2))
    descale = torch.full((2,), 0.5, device=device)
    return flash_attention(q, k, v, is_causal=True, descale_q=descale, descale_k=descale, descale_v=descale)


def _flash_backward_probe(device: Any) -> None:
    from llm_speed.attention.flash import flash_attention

    q, k, v = _qkv(device, requires_grad=True)
    flash_attention(q, k, v, is_causal=True).sum().backward()


def backward_probe(forward: str) -> Callable[[Any], Any]:
    """Probe of a backward row: the forward row ``forward``'s example at :data:`PROBE_SIZE`, its floating
    inputs requiring grad, then ``output.sum().backward()``."""

    def probe(device: Any) -> Any:
        row = get(forward)
        args, kwargs = row.example_problem(device, None, PROBE_SIZE)
        args = tuple(a.detach().requires_grad_() if a.is_floating_point() else a for a in args)
        row.load()(*args, **kwargs).float().sum().backward()
        return [a.grad for a in args if a.is_floating_point()]

    return probe


def _moe_route_backward_probe(device: Any) -> Any:
    """DeepSeek-V3-style routing of 16 tokens (sigmoid, correction bias, 4 groups of 8, top-4 of 2 groups)
    and the router logits' gradient through the weights."""
    import torch

    from llm_speed.moe.routing import moe_route

    logits = torch.randn(16, 32, device=device, dtype=_probe_float_dtype(device), requires_grad=True)
    weights, _ = moe_route(logits, 4, scoring="sigmoid", bias=torch.zeros(32, device=device), n_group=4,
                           topk_group=2, routed_scaling_factor=2.5)  # fmt: skip
    weights.sum().backward()
    return logits.grad


def _matrices(device: Any, dtype: Any, size: int = PROBE_GEMM) -> list[Any]:
    import torch

    shape = (size, size)
    if dtype == torch.int8:
        return [torch.randint(-128, 128, shape, device=device, dtype=dtype) for _ in range(2)]
    return [torch.randn(shape, device=device, dtype=dtype) for _ in range(2)]


def _gemm_probe(device: Any) -> Any:
    import torch

    from llm_speed.matmul.gemm import gemm

    a, b = _matrices(device, _probe_float_dtype(device))
    return gemm(a, b, activation="relu", bias=torch.zeros_like(a[0]))


def _tensor_core_gemm_probe(device: Any) -> Any:
    import torch

    from llm_speed.matmul.gemm import tensor_core_gemm

    return tensor_core_gemm(*_matrices(device, torch.float16))


def _int8_gemm_probe(device: Any) -> Any:
    import torch

    from llm_speed.matmul.gemm import tensor_core_gemm_int8

    return tensor_core_gemm_int8(*_matrices(device, torch.int8))


def _fp8_operands(device: Any) -> Any:
    import torch

    from llm_speed.matmul.fp8 import quantize_fp8

    a, w = (torch.randn(PROBE_GEMM, PROBE_GEMM, device=device) for _ in range(2))
    return quantize_fp8(a, granularity="row"), quantize_fp8(w, granularity="row")


def _quantize_fp8_probe(device: Any) -> Any:
    return _fp8_operands(device)[0]


def _gemm_fp8_probe(device: Any) -> Any:
    from llm_speed.matmul.fp8 import gemm_fp8

    (a, scale_a), (w, scale_w) = _fp8_operands(device)
    return gemm_fp8(a, w, scale_a, scale_w, trans_b=True)


# --- the table ---------------------------------------------------------------------------------------------

_SDPA = "torch.nn.functional:scaled_dot_product_attention"
_SDPA_ALTERNATIVES = ("sdpa", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "sdpa-math", "flash_attn")

OPS: tuple[Op, ...] = (
    Op(
        "flash_attention", "llm_speed.attention.flash:flash_attention", attention_work("flash", "fwd"),
        probe=attention_probe("llm_speed.attention.flash:flash_attention"),
        label="flash_attention (forward)", bench="attention", bench_name="flash",
        alternatives=_SDPA_ALTERNATIVES, example=attention_example, baseline=_SDPA,
    ),
    # fp8 attention (e4m3 q, k, v with descales; forward only): the flash kernel with fp8 tensor cores
    Op(
        "flash_attention_fp8", "llm_speed.attention.flash:flash_attention", attention_work("flash", "fwd"),
        probe=_fp8_attention_probe, label="flash_attention (fp8 forward)", bench="attention",
        bench_name="flash-fp8",
    ),
    # Also tiled_attention's backward: it runs the same kernels.
    Op(
        "flash_attention_backward", "llm_speed.attention.flash:flash_attention",
        attention_work("flash", "bwd"), probe=_flash_backward_probe, label="flash_attention (backward)",
    ),
    Op(
        "tiled_attention", "llm_speed.attention.tiled:tiled_attention", attention_work("tiled", "fwd"),
        probe=attention_probe("llm_speed.attention.tiled:tiled_attention"), bench="attention",
        bench_name="tiled", example=attention_example, baseline=_SDPA,
    ),
    Op(
        "naive_attention", "llm_speed.attention.naive:naive_attention", attention_work("naive", "fwd"),
        probe=attention_probe("llm_speed.attention.naive:naive_attention"), bench="attention",
        bench_name="naive", plain_pytorch=True, example=attention_example, baseline=_SDPA,
    ),
    Op(
        "flash_attention_varlen", "llm_speed.attention.varlen:flash_attention_varlen", varlen_work("fwd"),
        probe=_varlen_probe, label="flash_attention_varlen (packed)",
    ),
    Op(
        "flash_attention_varlen_backward", "llm_speed.attention.varlen:flash_attention_varlen",
        varlen_work("bwd"),
    ),
    # The out-of-memory fallback of safe_flash_attention, costed at flash's minimum traffic: on CUDA, SDPA's
    # flash or memory-efficient backend (its bottom-right causal mask included) keeps no score matrix in
    # DRAM, as `predict` prices it; the math backend (CPU) moves more. It was priced as the naive path's
    # float32 scores: 65x at 16 heads x 4096 x 128, bf16.
    Op(
        "sdpa_attention", "llm_speed.helpers:sdpa_attention", attention_work("flash", "fwd"),
        plain_pytorch=True,
    ),
    Op(
        "attention_kvcache_fwd", "llm_speed.attention.decode:flash_attention_with_kvcache",
        kvcache_work, probe=_kvcache_probe,
        label="flash_attention_with_kvcache (paged decode)",
    ),
    # Fused LLM ops (llm_speed.fused): each file holds its kernels, op, cost and example problem.
    Op(
        "rms_norm", "llm_speed.fused.rms_norm:rms_norm",
        rms_norm_work(), example=rms_norm_example,
        baseline="llm_speed.fused.reference:rms_norm_reference",
    ),
    Op(
        "rms_norm_backward", "llm_speed.fused.rms_norm:rms_norm", rms_norm_work(backward=True),
        probe=backward_probe("rms_norm"),
    ),
    Op(
        "swiglu", "llm_speed.fused.swiglu:swiglu", swiglu_work(), example=swiglu_example,
        baseline="llm_speed.fused.reference:swiglu_reference",
    ),
    Op(
        "swiglu_backward", "llm_speed.fused.swiglu:swiglu", swiglu_work(backward=True),
        probe=backward_probe("swiglu"),
    ),
    # Forward and backward run the same kernel (the backward rotates by the opposite angle).
    Op(
        "apply_rotary", "llm_speed.fused.rotary:apply_rotary", rotary_work, example=rotary_example,
        baseline="llm_speed.fused.reference:apply_rotary_reference",
    ),
    Op(
        "geglu", "llm_speed.fused.geglu:geglu", swiglu_work(activation_flops=12.0), example=geglu_example,
        baseline="llm_speed.fused.reference:geglu_reference",
    ),
    Op(
        "geglu_backward", "llm_speed.fused.geglu:geglu", swiglu_work(backward=True, activation_flops=12.0),
        probe=backward_probe("geglu"),
    ),
    # q and k in one launch, Hugging Face's cos/sin; the backward is the same kernel (the transposed map).
    Op(
        "apply_rotary_qk", "llm_speed.fused.rotary_qk:apply_rotary_qk", rotary_qk_work,
        example=rotary_qk_example, baseline="llm_speed.fused.reference:apply_rotary_qk_reference",
    ),
    Op(
        "apply_rotary_qk_backward", "llm_speed.fused.rotary_qk:apply_rotary_qk", rotary_qk_work,
        probe=_rotary_qk_backward_probe,
    ),
    Op(
        "cross_entropy", "llm_speed.fused.cross_entropy:cross_entropy", logits_cross_entropy_work(),
        example=logits_cross_entropy_example, baseline="llm_speed.fused.reference:cross_entropy_reference",
    ),
    Op(
        "cross_entropy_backward", "llm_speed.fused.cross_entropy:cross_entropy",
        logits_cross_entropy_work(backward=True), probe=backward_probe("cross_entropy"),
    ),
    Op(
        "fused_linear_cross_entropy", "llm_speed.fused.cross_entropy:fused_linear_cross_entropy",
        cross_entropy_work(), example=cross_entropy_example,
        baseline="llm_speed.fused.reference:fused_linear_cross_entropy_reference",
    ),
    Op(
        "fused_linear_cross_entropy_backward", "llm_speed.fused.cross_entropy:fused_linear_cross_entropy",
        cross_entropy_work(backward=True),
        probe=backward_probe("fused_linear_cross_entropy"),
    ),
    # gemm and tensor_core_gemm share one launcher, which reports both as "gemm".
    Op(
        "gemm", "llm_speed.matmul.gemm:gemm", gemm_work, probe=_gemm_probe, bench="gemm",
        bench_name="llm-speed", alternatives=("torch",), example=gemm_example, baseline="torch:matmul",
    ),
    Op(
        "tensor_core_gemm", "llm_speed.matmul.gemm:tensor_core_gemm", gemm_work, probe=_tensor_core_gemm_probe
    ),
    Op(
        "tensor_core_gemm_int8", "llm_speed.matmul.gemm:tensor_core_gemm_int8", gemm_work,
        probe=_int8_gemm_probe, bench="gemm", bench_name="llm-speed", alternatives=("torch-int-mm",),
    ),
    # FP8 (llm_speed.matmul.fp8): `llm-speed bench gemm --dtype fp8` times gemm_fp8 at each scaling
    # granularity against torch._scaled_mm with the same scaling and bf16 torch.matmul. Float8Linear
    # reports its quantizations and GEMMs under these two rows.
    Op("quantize_fp8", "llm_speed.matmul.fp8:quantize_fp8", quantize_fp8_work, probe=_quantize_fp8_probe),
    Op(
        "gemm_fp8", "llm_speed.matmul.fp8:gemm_fp8", gemm_work, probe=_gemm_fp8_probe, bench="gemm",
        bench_name="llm-speed", alternatives=("torch-scaled-mm", "torch"),
    ),
    # Mixture of experts (llm_speed.moe); `llm-speed bench moe` times the fused layer against the Hugging Face
    # loop and torch._grouped_mm.
    Op(
        "grouped_gemm", "llm_speed.moe.grouped_gemm:grouped_gemm", grouped_gemm_work(),
        example=grouped_gemm_example, baseline="torch:_grouped_mm",
    ),
    Op(
        "grouped_gemm_backward", "llm_speed.moe.grouped_gemm:grouped_gemm", grouped_gemm_work(backward=True),
        probe=backward_probe("grouped_gemm"),
    ),
    Op(
        "moe_route", "llm_speed.moe.routing:moe_route", moe_route_work(), example=moe_route_example,
        baseline="llm_speed.moe.reference:moe_route_reference",
    ),
    Op(
        "moe_route_backward", "llm_speed.moe.routing:moe_route", moe_route_work(backward=True),
        probe=_moe_route_backward_probe,
    ),
    Op(
        "moe_sort", "llm_speed.moe.routing:moe_sort", moe_sort_work, example=moe_sort_example,
        baseline="llm_speed.moe.reference:moe_sort_reference",
    ),
    Op(
        "fused_moe", "llm_speed.moe.fused_moe:fused_moe", fused_moe_work(), example=fused_moe_example,
        baseline="llm_speed.moe.reference:fused_moe_reference",
    ),
    Op(
        "fused_moe_backward", "llm_speed.moe.fused_moe:fused_moe", fused_moe_work(backward=True),
        probe=backward_probe("fused_moe"),
    ),
)  # fmt: skip


def get(name: str) -> Op:
    """The row called ``name``; ValueError listing the known names otherwise."""
    for op in OPS:
        if op.name == name:
            return op
    raise ValueError(f"op: no row called {name!r} in llm_speed.ops.OPS; known: {', '.join(names())}")


def names() -> tuple[str, ...]:
    """Every row's name, in table order."""
    return tuple(op.name for op in OPS)


def bench_rows(bench: str) -> tuple[Op, ...]:
    """The rows timed by ``llm-speed bench <bench>``, in table order."""
    return tuple(op for op in OPS if op.bench == bench)


def bench_names(bench: str) -> tuple[str, ...]:
    """The ``--impl`` names of llm-speed's own implementations in ``bench`` (each once, table order)."""
    return tuple(dict.fromkeys(op.bench_name for op in bench_rows(bench)))


def bench_impls(bench: str) -> tuple[str, ...]:
    """Every ``--impl`` value ``bench`` accepts: llm-speed's implementations, then their alternatives."""
    alternatives = (name for op in bench_rows(bench) for name in op.alternatives)
    return tuple(dict.fromkeys((*bench_names(bench), *alternatives)))


def probes() -> tuple[Op, ...]:
    """The rows doctor probes (a ``probe`` or an ``example``), in table order."""
    return tuple(op for op in OPS if op.probe is not None or op.example is not None)
