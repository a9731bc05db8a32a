"""The problems whose launches the kernel report compiles: one builder per row of the op table
(:data:`llm_speed.ops.OPS`) that runs a Triton kernel, at GPU sizes, and the set that selects every shipped
configuration of a device's tier (the budgets of ``make test``).

A :class:`Problem` is a call of an op's public function (and, for a backward row, of ``backward()`` on its
output). It runs under :func:`llm_speed.core.launch.simulated_gpu`: CPU tensors take the CUDA path, the ops
choose their configurations for the stand-in GPU and make their plans, and nothing is launched. The report
compiles what those plans would launch (:mod:`llm_speed.kernel_report.capture`).

Sizes are those of a model, not of a test: attention over 4096 tokens of 16 heads (as the benchmarks run it,
head dims 64 and 128), GEMMs of 4096^3, fused ops over 4096 x 4096. Their host cost here is allocation only
(the large inputs are left unfilled: nothing reads them, and filling them was most of a report's capture),
apart from the fused cross-entropy, whose chunk logits are a ``torch.mm`` on the CPU (so its problem keeps
a vocabulary past the largest tile, 4096 entries, and few rows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator
from typing import Any

# What a problem calls to mark the part of its run whose launches are reported (a backward row reports the
# backward's kernels, not the forward it runs first).
Recording = Callable[[], contextlib.AbstractContextManager]

# The op table's rows written in plain PyTorch (no kernel to compile).
DTYPE_NAMES = ("fp16", "bf16", "fp32")


@dataclasses.dataclass(frozen=True)
class Options:
    """The sizes of the default problems (command-line options of ``llm-speed kernels``)."""

    seq: int = 4096  # tokens per sequence (attention), cache length (decode)
    head_dims: tuple[int, ...] = (64, 128)
    heads: int = 16
    size: int = 4096  # GEMM M = N = K; rows and hidden size of the fused ops
    dtypes: tuple[str, ...] = ("fp16",)
    # attention backward: "default" (dQ by atomics, five matmuls) and/or "deterministic" (a dQ kernel)
    backward: tuple[str, ...] = ("default", "deterministic")
    causal: tuple[bool, ...] = (False, True)  # the Gluon forward's masks (its compiles are long)


@dataclasses.dataclass(frozen=True)
class Problem:
    """One call: ``run(recording)`` makes the inputs and calls the op; ``op`` is its row of the op table."""

    op: str
    label: str
    run: Callable[[Recording], None]


def _torch_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _whole(recording: Recording) -> contextlib.AbstractContextManager:
    return recording()


def _record(recording: Recording, call, *args, backward: bool = False, with_forward: bool = False) -> None:
    """Record the kernels ``call(*args)`` launches, or with ``backward`` those its backward launches (the
    forward runs first, unrecorded unless ``with_forward``: an op whose forward with grad makes the
    gradients, the fused linear cross-entropy's)."""
    if not backward:
        with recording():
            call(*args)
        return
    if with_forward:
        with recording():
            call(*args).float().sum().backward()
        return
    out = call(*args)
    with recording():
        out.float().sum().backward()


# --- attention ----------------------------------------------------------------------------------------------


def _qkv(batch, heads_q, heads_kv, seq, head_dim, dtype, grad=False, packed=False, fp8=False):
    import torch

    if packed:
        shapes = [(seq, heads_q, head_dim)] + [(seq, heads_kv, head_dim)] * 2
    else:
        shapes = [(batch, heads_q, seq, head_dim)] + [(batch, heads_kv, seq, head_dim)] * 2
    if fp8:  # e4m3 (fp8 attention)
        return [torch.empty(shape, dtype=torch.float8_e4m3fn) for shape in shapes]
    return [torch.empty(shape, dtype=dtype).requires_grad_(grad) for shape in shapes]


def attention_problem(
    op: str,
    *,
    head_dim: int,
    dtype: str,
    seq: int = 4096,
    heads: int = 16,
    heads_kv: int | None = None,
    is_causal: bool = False,
    window: tuple | None = None,
    softcap: float | None = None,
    backward: str | None = None,
    sequences: int = 1,
    alibi: bool = False,
    dropout_p: float = 0.0,
    page_size: int = 0,
    fp8: bool = False,
) -> Problem:
    """A problem of an attention row: ``op`` "flash_attention", "tiled_attention" or
    "flash_attention_varlen" (forward), or with ``backward`` ("default" or "deterministic") its backward
    (``sequences`` packed sequences of ``seq / sequences`` tokens for varlen); ``alibi``: per-head ALiBi
    slopes; ``dropout_p``: attention dropout (the kernels' HAS_ALIBI / DROPOUT variants); ``page_size``
    (varlen forward): keys and values in pages of that size through a block table (the PAGED variant);
    ``fp8`` (forward): e4m3 q, k, v with per-KV-head descales, ``dtype`` unused (fp8 attention)."""
    heads_kv = heads_kv or heads
    torch_dtype = _torch_dtype(dtype)
    varlen = op.startswith("flash_attention_varlen")
    parts = [f"d{head_dim}", "fp8-e4m3" if fp8 else dtype, f"s{seq}",
             f"h{heads}" + (f"/{heads_kv}" if heads_kv != heads else "")]  # fmt: skip
    parts += ["causal"] * is_causal + [f"window{window}"] * (window is not None) + ["softcap"] * bool(softcap)
    parts += ["alibi"] * alibi + [f"dropout {dropout_p}"] * bool(dropout_p)
    parts += [f"{sequences} seqs"] * varlen + [f"paged {page_size}"] * bool(page_size)
    parts += [f"bwd {backward}"] if backward else []
    options = dict(is_causal=is_causal, window=window, softcap=softcap)
    if alibi or dropout_p:
        options["dropout_p"] = dropout_p
    if backward is not None:
        options["deterministic"] = backward == "deterministic"

    def run(recording: Recording) -> None:
        import torch

        grad = backward is not None
        if alibi:
            options["alibi_slopes"] = torch.full((heads,), 0.05)
        if fp8:
            options.update(descale_q=torch.full((heads_kv,), 0.01), descale_k=torch.full((heads_kv,), 0.01),
                           descale_v=torch.full((heads_kv,), 0.01))  # fmt: skip
        if varlen:
            from llm_speed.attention.varlen import flash_attention_varlen

            q, k, v = _qkv(1, heads, heads_kv, seq, head_dim, torch_dtype, grad, packed=True, fp8=fp8)
            length = seq // sequences
            cu = torch.arange(0, sequences + 1, dtype=torch.int32) * length
            cu[-1] = seq
            max_len = seq - length * (sequences - 1)
            if page_size:  # each sequence's pages one after another in the pool
                pages = -(-max_len // page_size)
                shape = (sequences * pages, page_size, heads_kv, head_dim)
                k, v = (torch.empty(shape, dtype=k.dtype) for _ in range(2))
                table = torch.arange(sequences * pages, dtype=torch.int32)
                options["block_table"] = table.view(sequences, pages)

            def call():
                return flash_attention_varlen(q, k, v, cu, cu, max_len, max_len, **options)
        else:
            from llm_speed.attention.flash import flash_attention
            from llm_speed.attention.tiled import tiled_attention

            function = tiled_attention if op.startswith("tiled") else flash_attention
            q, k, v = _qkv(1, heads, heads_kv, seq, head_dim, torch_dtype, grad, fp8=fp8)

            def call():
                return function(q, k, v, **options)

        _record(recording, call, backward=grad)

    return Problem(op, " ".join(parts), run)


def _attention(op: str, options: Options, backward: bool = False) -> Iterator[Problem]:
    for dtype in _floating(options):
        for head_dim in options.head_dims:
            for is_causal in (False, True):
                for path in options.backward if backward else (None,):
                    yield attention_problem(
                        op, head_dim=head_dim, dtype=dtype, seq=options.seq, heads=options.heads,
                        is_causal=is_causal, backward=path,
                    )  # fmt: skip
        if op.startswith("flash") and options.heads % 4 == 0:
            # GQA 4:1, causal (Llama's training): the dK/dV kernel then loops over the group's query heads
            # (MHA's group of 1 is specialised away); once, at the largest head dim
            for path in options.backward if backward else (None,):
                yield attention_problem(
                    op, head_dim=max(options.head_dims), dtype=dtype, seq=options.seq, heads=options.heads,
                    heads_kv=options.heads // 4, is_causal=True, backward=path,
                )  # fmt: skip
        if op.startswith("flash"):
            # flash-attn's options switch on kernel variants (HAS_ALIBI, DROPOUT): once, at the largest head
            # dim (`--head-dim` picks others), to keep make test's compile of the shipped set short
            for path in options.backward if backward else (None,):
                yield attention_problem(
                    op, head_dim=max(options.head_dims), dtype=dtype, seq=options.seq, heads=options.heads,
                    is_causal=True, backward=path, alibi=True, dropout_p=0.1,
                )  # fmt: skip


def _fp8_attention(op: str, options: Options) -> Iterator[Problem]:
    """fp8 attention (e4m3 q, k, v whatever ``--dtype``; forward only): each head dim non-causal, and packed
    causal sequences at the largest."""
    for head_dim in options.head_dims:
        problem = attention_problem("flash_attention", head_dim=head_dim, dtype="bf16", seq=options.seq,
                                    heads=options.heads, fp8=True)  # fmt: skip
        yield dataclasses.replace(problem, op=op)
    problem = attention_problem("flash_attention_varlen", head_dim=max(options.head_dims), dtype="bf16",
                                seq=options.seq, heads=options.heads, heads_kv=max(1, options.heads // 4),
                                is_causal=True, sequences=4, fp8=True)  # fmt: skip
    yield dataclasses.replace(problem, op=op)


def _varlen(op: str, options: Options, backward: bool = False) -> Iterator[Problem]:
    for dtype in _floating(options):
        for head_dim in options.head_dims:
            for path in options.backward if backward else (None,):
                yield attention_problem(op, head_dim=head_dim, dtype=dtype, seq=options.seq,
                                        heads=options.heads, heads_kv=max(1, options.heads // 4),
                                        is_causal=True, backward=path, sequences=4)  # fmt: skip
        if not backward:  # paged keys (vLLM-style prefill; forward only): once, at the largest head dim
            yield attention_problem(op, head_dim=max(options.head_dims), dtype=dtype, seq=options.seq,
                                    heads=options.heads, heads_kv=max(1, options.heads // 4), is_causal=True,
                                    sequences=4, page_size=16)  # fmt: skip


def decode_problem(*, head_dim: int, dtype: str, cache: int = 4096, batch: int = 8, heads: int = 32,
                   heads_kv: int = 8, page: int = 256, seq_q: int = 1, rotary_alibi: bool = False,
                   fp8: bool = False) -> Problem:  # fmt: skip
    """One decode step (``seq_q`` new tokens appended) over a paged KV cache of ``cache`` tokens; with
    ``rotary_alibi`` flash-attn's in-kernel rotary (whole head dim, GPT-NeoX halves) and ALiBi slopes; with
    ``fp8`` an e4m3 cache with per-KV-head descales (the appended tokens quantized)."""
    torch_dtype = _torch_dtype(dtype)
    label = f"d{head_dim} {dtype} batch{batch} cache{cache} h{heads}/{heads_kv} page{page} q{seq_q}"
    label += " rotary alibi" * rotary_alibi + " fp8-e4m3 cache" * fp8

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.attention.decode import flash_attention_with_kvcache

        pages = cache // page
        cache_dtype = torch.float8_e4m3fn if fp8 else torch_dtype
        k_cache, v_cache = (torch.empty(batch * pages, page, heads_kv, head_dim, dtype=cache_dtype)
                            for _ in range(2))  # fmt: skip
        table = torch.arange(batch * pages, dtype=torch.int32).reshape(batch, pages)
        q = torch.empty(batch, seq_q, heads, head_dim, dtype=torch_dtype)
        k, v = (torch.empty(batch, seq_q, heads_kv, head_dim, dtype=torch_dtype) for _ in range(2))
        lengths = torch.full((batch,), cache - seq_q, dtype=torch.int32)
        options = {}
        if rotary_alibi:
            half = max(1, head_dim // 2)
            options = dict(rotary_cos=torch.ones(cache, half, dtype=torch_dtype), rotary_interleaved=False,
                           rotary_sin=torch.zeros(cache, half, dtype=torch_dtype),
                           alibi_slopes=torch.full((heads,), 0.05))  # fmt: skip
        if fp8:
            options = dict(k_descale=torch.full((heads_kv,), 0.01), v_descale=torch.full((heads_kv,), 0.01))
        with recording():
            flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,
                                         block_table=table, is_causal=True, **options)  # fmt: skip

    return Problem("attention_kvcache_fwd", label, run)


def _decode(op: str, options: Options) -> Iterator[Problem]:
    for dtype in _floating(options):
        for head_dim in options.head_dims:
            yield decode_problem(head_dim=head_dim, dtype=dtype, cache=options.seq)
        # flash-attn's options switch on kernel variants: once, at the largest head dim
        yield decode_problem(
            head_dim=max(options.head_dims), dtype=dtype, cache=options.seq, rotary_alibi=True
        )
        if dtype != "fp32":  # an fp8 cache (issue 35): once, at the largest head dim
            yield decode_problem(head_dim=max(options.head_dims), dtype=dtype, cache=options.seq, fp8=True)


# --- GEMM ---------------------------------------------------------------------------------------------------


def gemm_problem(op: str, *, size: int, dtype: str) -> Problem:
    """``op`` "gemm" (``dtype`` operands), "tensor_core_gemm" or "tensor_core_gemm_int8" at size^3."""

    def run(recording: Recording) -> None:
        import torch

        gemm = importlib.import_module("llm_speed.matmul.gemm")

        if op == "tensor_core_gemm_int8":
            a, b = (torch.zeros(size, size, dtype=torch.int8) for _ in range(2))
            function = gemm.tensor_core_gemm_int8
        else:
            a, b = (torch.empty(size, size, dtype=_torch_dtype(dtype)) for _ in range(2))
            function = gemm.tensor_core_gemm if op == "tensor_core_gemm" else gemm.gemm
        with recording():
            function(a, b)

    label = f"{size}^3 " + ("int8" if op.endswith("int8") else dtype)
    return Problem(op, label, run)


def _gemm(op: str, options: Options) -> Iterator[Problem]:
    if op == "tensor_core_gemm_int8":
        yield gemm_problem(op, size=options.size, dtype="int8")
        return
    dtypes = [d for d in _floating(options) if op == "gemm" or d != "fp32"] or ["fp16"]
    for dtype in dtypes:
        yield gemm_problem(op, size=options.size, dtype=dtype)


# --- fused ops ----------------------------------------------------------------------------------------------


def fused_problem(op: str, *, size: int, dtype: str) -> Problem:
    """A fused op (``op`` a row of llm_speed.fused, ``_backward`` for its backward) over ``size`` tokens of
    a ``size`` hidden dim; the cross-entropy: 64 rows of 256 over a vocabulary of 16384 (its tiles depend on
    the vocabulary, up to 4096 entries, and the rows; its chunk logits are a ``torch.mm`` on the CPU here)."""
    backward = op.endswith("_backward")
    base = op.removesuffix("_backward")
    torch_dtype = _torch_dtype(dtype)

    def run(recording: Recording) -> None:
        import torch

        def randn(*shape):
            return torch.empty(shape, dtype=torch_dtype).requires_grad_(backward)

        if base == "rms_norm":
            from llm_speed.fused.rms_norm import rms_norm

            args, call = (randn(size, size), randn(size)), rms_norm
        elif base == "swiglu":
            from llm_speed.fused.swiglu import swiglu

            args, call = (randn(size, size), randn(size, size)), swiglu
        elif base == "geglu":
            from llm_speed.fused.geglu import geglu

            args, call = (randn(size, size), randn(size, size)), geglu
        elif base == "apply_rotary_qk":
            from llm_speed.fused.rotary_qk import apply_rotary_qk

            # Hugging Face's layout: q [1, 32, seq, 128], k [1, 8, seq, 128], cos/sin full width
            seq = size // 8
            angles = torch.arange(seq, dtype=torch.float32)[:, None] * torch.rand(64).repeat(2)
            cos, sin = (f(angles)[None].to(torch_dtype) for f in (torch.cos, torch.sin))
            args = (randn(1, 32, seq, 128), randn(1, 8, seq, 128), cos, sin)

            def call(*a):
                return torch.cat([t.flatten() for t in apply_rotary_qk(*a)])

        elif base == "cross_entropy":
            from llm_speed.fused.cross_entropy import cross_entropy

            rows, vocab = 256, 32768  # logits of a 32k vocabulary (the kernel's tiles depend on it)
            args, call = (randn(rows, vocab), torch.randint(0, vocab, (rows,))), cross_entropy
        elif base == "apply_rotary":
            from llm_speed.fused.rotary import apply_rotary

            seq = size // 8
            angles = torch.arange(seq, dtype=torch.float32)[:, None] * torch.rand(64)
            x = randn(1, 32, seq, 128)
            args, call = (x, angles.cos().to(torch_dtype), angles.sin().to(torch_dtype)), apply_rotary
        elif base == "fused_linear_cross_entropy":
            from llm_speed.fused.cross_entropy import fused_linear_cross_entropy

            rows, hidden, vocab = 64, 256, 16384
            target = torch.randint(0, vocab, (rows,))
            args, call = (randn(rows, hidden), randn(vocab, hidden), target), fused_linear_cross_entropy
        else:
            raise ValueError(f"op: no fused problem for {op!r}")
        _record(recording, call, *args, backward=backward, with_forward=base == "fused_linear_cross_entropy")

    labels = {"fused_linear_cross_entropy": dtype, "cross_entropy": f"256x32768 {dtype}",
              "apply_rotary_qk": f"seq {size // 8} {dtype}"}  # fmt: skip
    return Problem(op, labels.get(base, f"{size}x{size} {dtype}"), run)


def _fused(op: str, options: Options) -> Iterator[Problem]:
    for dtype in _floating(options):
        yield fused_problem(op, size=options.size, dtype=dtype)


# --- mixture of experts -------------------------------------------------------------------------------------


def moe_problem(op: str, *, dtype: str, tokens: int = 4096, experts: int = 64, top_k: int = 8,
                hidden: int = 2048, intermediate: int = 768) -> Problem:  # fmt: skip
    """``op`` a row of llm_speed.moe (``_backward`` for its backward) at a Qwen3-30B-A3B layer's shapes
    (hidden 2048, expert width 768, top-8; 64 experts here, half the model's: smaller host buffers)."""
    backward = op.endswith("_backward")
    base = op.removesuffix("_backward")
    torch_dtype = _torch_dtype(dtype)

    def run(recording: Recording) -> None:
        import torch

        from llm_speed import moe

        def empty(*shape, grad=backward):
            return torch.empty(shape, dtype=torch_dtype).requires_grad_(grad)

        logits = torch.randn(tokens, experts)
        ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)
        weights = torch.rand(tokens, top_k).requires_grad_(backward)
        if base == "grouped_gemm":
            offsets = torch.linspace(0, tokens * top_k, experts + 1)[1:].to(torch.int32)
            args = (empty(tokens * top_k, hidden), empty(experts, intermediate, hidden), offsets)

            def call(*a):
                return moe.grouped_gemm(*a, trans_b=True)

        elif base == "moe_route":
            args = (logits.to(torch_dtype).requires_grad_(backward), top_k)

            def call(*a):
                return moe.moe_route(*a)[0]

        elif base == "moe_sort":
            args = (ids, experts)

            def call(*a):
                return moe.moe_sort(*a)[0]

        else:
            args = (empty(tokens, hidden), empty(experts, 2 * intermediate, hidden),
                    empty(experts, hidden, intermediate), weights, ids)  # fmt: skip
            call = moe.fused_moe
        _record(recording, call, *args, backward=backward)

    return Problem(op, f"{tokens} tokens E{experts} k{top_k} {dtype}", run)


def _moe(op: str, options: Options) -> Iterator[Problem]:
    if op == "moe_sort":
        yield moe_problem(op, dtype="fp32")
        return
    for dtype in _floating(options):
        yield moe_problem(op, dtype=dtype)


# --- fp8 ----------------------------------------------------------------------------------------------------

FP8_GRANULARITIES = ("tensor", "row", (1, 128), (128, 128))


def fp8_problem(op: str, *, size: int, granularity) -> Problem:
    """``quantize_fp8`` of a [size, size] bf16 tensor, or ``gemm_fp8`` at size^3 (e4m3, bf16 out, ``b`` an
    ``nn.Linear`` weight) with the scales of ``granularity`` ((1, 128) quantizes a, (128, 128) b)."""

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.matmul import fp8

        if op == "quantize_fp8":
            x = torch.empty(size, size, dtype=torch.bfloat16)
            with recording():
                fp8.quantize_fp8(x, granularity=granularity)
            return
        e4m3 = torch.float8_e4m3fn
        a, b = (torch.zeros(size, size, dtype=e4m3) for _ in range(2))
        blocks = -(-size // 128)
        scales = {"tensor": ((), ()), "row": ((size, 1), (size, 1)),
                  "block": ((size, blocks), (blocks, blocks))}  # fmt: skip
        scale_a, scale_b = (torch.ones(shape) for shape in scales[granularity])
        with recording():
            fp8.gemm_fp8(a, b, scale_a, scale_b, trans_b=True)

    name = granularity if isinstance(granularity, str) else "x".join(map(str, granularity))
    return Problem(op, f"{size}^{3 if op == 'gemm_fp8' else 2} {name}", run)


def _fp8(op: str, options: Options) -> Iterator[Problem]:
    granularities = FP8_GRANULARITIES if op == "quantize_fp8" else ("tensor", "row", "block")
    for granularity in granularities:
        yield fp8_problem(op, size=options.size, granularity=granularity)


def _floating(options: Options) -> list[str]:
    return [d for d in options.dtypes if d in DTYPE_NAMES]


# One builder per op-table row with a Triton kernel (tests/kernel_report checks none is missing).
BUILDERS: dict[str, Callable[[str, Options], Iterator[Problem]]] = {
    "flash_attention": _attention,
    "flash_attention_fp8": _fp8_attention,
    "flash_attention_backward": lambda op, o: _attention("flash_attention", o, backward=True),
    "tiled_attention": _attention,
    "flash_attention_varlen": _varlen,
    "flash_attention_varlen_backward": lambda op, o: _varlen("flash_attention_varlen", o, backward=True),
    "attention_kvcache_fwd": _decode,
    "gemm": _gemm,
    "tensor_core_gemm": _gemm,
    "tensor_core_gemm_int8": _gemm,
    "rms_norm": _fused,
    "rms_norm_backward": _fused,
    "swiglu": _fused,
    "swiglu_backward": _fused,
    "apply_rotary": _fused,
    "fused_linear_cross_entropy": _fused,
    "fused_linear_cross_entropy_backward": _fused,
    "geglu": _fused,
    "geglu_backward": _fused,
    "apply_rotary_qk": _fused,
    "apply_rotary_qk_backward": _fused,
    "cross_entropy": _fused,
    "cross_entropy_backward": _fused,
    "grouped_gemm": _moe,
    "grouped_gemm_backward": _moe,
    "moe_route": _moe,
    "moe_route_backward": _moe,
    "moe_sort": _moe,
    "fused_moe": _moe,
    "fused_moe_backward": _moe,
    "quantize_fp8": _fp8,
    "gemm_fp8": _fp8,
}


# The Options fields each builder's problems read (the rest do not change them: `llm-speed kernels` refuses an
# option that no chosen op reads). Restated, not traced, to keep the command torch-free;
# tests/kernel_report/test_command_input.py checks it against what the builders read.
_ATTENTION = frozenset({"seq", "heads", "head_dims", "dtypes"})
_SIZED = frozenset({"size", "dtypes"})
OPTIONS_READ: dict[str, frozenset[str]] = {
    **dict.fromkeys(("flash_attention", "tiled_attention", "flash_attention_varlen", "gluon_attention_fwd",
                     "gluon_attention_bwd"), _ATTENTION),
    **dict.fromkeys(("flash_attention_backward", "flash_attention_varlen_backward"),
                    _ATTENTION | {"backward"}),
    **dict.fromkeys(("flash_attention_fp8", "gluon_attention_fwd_fp8"), _ATTENTION - {"dtypes"}),
    "attention_kvcache_fwd": _ATTENTION - {"heads"},  # the decode step's 32/8 heads are fixed
    **dict.fromkeys(("gemm", "tensor_core_gemm", "gluon_gemm", "rms_norm", "rms_norm_backward", "swiglu",
                     "swiglu_backward", "apply_rotary", "geglu", "geglu_backward", "apply_rotary_qk",
                     "apply_rotary_qk_backward"), _SIZED),
    **dict.fromkeys(("tensor_core_gemm_int8", "quantize_fp8", "gemm_fp8", "gluon_gemm_fp8",
                     "gluon_gemm_int8"), frozenset({"size"})),
    # fixed vocabularies and rows; the MoE layer's shapes are fixed (moe_sort's ids are int32)
    **dict.fromkeys(("cross_entropy", "cross_entropy_backward", "fused_linear_cross_entropy",
                     "fused_linear_cross_entropy_backward", "grouped_gemm", "grouped_gemm_backward",
                     "moe_route", "moe_route_backward", "fused_moe", "fused_moe_backward"),
                    frozenset({"dtypes"})),
    "moe_sort": frozenset(),
}


# --- Gluon kernels (not op-table rows: reached explicitly until a GPU proof selects them) -------------------


def gluon_gemm_problem(*, size: int, dtype: str, trans_b: bool = False) -> Problem:
    """:func:`llm_speed.gluon.gemm.gemm` at size^3 (``b`` [N, K] with ``trans_b``: an ``nn.Linear``
    weight)."""

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.gluon.gemm import gemm

        a = torch.empty(size, size, dtype=_torch_dtype(dtype))
        b = torch.empty(size, size, dtype=_torch_dtype(dtype))
        with recording():
            gemm(a, b, trans_b=trans_b)

    return Problem("gluon_gemm", f"{size}^3 {dtype}" + " b^T" * trans_b, run)


def _gluon_gemm(op: str, options: Options) -> Iterator[Problem]:
    for dtype in [d for d in _floating(options) if d != "fp32"] or ["fp16"]:
        yield gluon_gemm_problem(size=options.size, dtype=dtype)
    yield gluon_gemm_problem(size=options.size, dtype="bf16", trans_b=True)


def gluon_gemm_int8_problem(*, size: int) -> Problem:
    """:func:`llm_speed.gluon.gemm.gemm_int8` at size^3: int8 ``a`` and ``b`` [N, K], int32 out."""

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.gluon.gemm import gemm_int8

        a = torch.empty(size, size, dtype=torch.int8)
        b = torch.empty(size, size, dtype=torch.int8)
        with recording():
            gemm_int8(a, b)

    return Problem("gluon_gemm_int8", f"{size}^3 int8 b^T -> int32", run)


def _gluon_gemm_int8(op: str, options: Options) -> Iterator[Problem]:
    yield gluon_gemm_int8_problem(size=options.size)


def gluon_gemm_fp8_problem(*, size: int, out_dtype: str = "bf16", bias: bool = False) -> Problem:
    """:func:`llm_speed.gluon.gemm_fp8.gemm_fp8` at size^3: e4m3 ``a`` and ``b`` [N, K] with 1x128 and
    128x128 block scales."""

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.gluon.gemm_fp8 import gemm_fp8

        a = torch.empty(size, size, dtype=torch.float8_e4m3fn)
        b = torch.empty(size, size, dtype=torch.float8_e4m3fn)
        groups = -(-size // 128)
        scale_a, scale_b = torch.empty(size, groups), torch.empty(groups, groups)
        out_dtype_ = _torch_dtype(out_dtype)
        with recording():
            gemm_fp8(a, b, scale_a, scale_b, out_dtype=out_dtype_,
                     bias=torch.empty(size, dtype=out_dtype_) if bias else None)  # fmt: skip

    return Problem("gluon_gemm_fp8", f"{size}^3 e4m3 1x128/128x128 -> {out_dtype}" + " bias" * bias, run)


def _gluon_gemm_fp8(op: str, options: Options) -> Iterator[Problem]:
    yield gluon_gemm_fp8_problem(size=options.size)
    yield gluon_gemm_fp8_problem(size=options.size, out_dtype="fp16", bias=True)


def gluon_attention_problem(*, head_dim: int, dtype: str, seq: int, heads: int, heads_kv: int | None = None,
                            is_causal: bool = False) -> Problem:  # fmt: skip
    """:func:`llm_speed.gluon.attention.forward` over one sequence of ``seq`` tokens (``dtype`` "fp8-e4m3":
    e4m3 q, k, v with per-KV-head descales, op ``gluon_attention_fwd_fp8``)."""
    heads_kv = heads_kv or heads
    fp8 = dtype == "fp8-e4m3"

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.gluon.attention import forward

        q, k, v = _qkv(1, heads, heads_kv, seq, head_dim, None if fp8 else _torch_dtype(dtype), fp8=fp8)
        descales = dict.fromkeys(("descale_q", "descale_k", "descale_v"), torch.ones(heads_kv)) if fp8 else {}
        with recording():
            forward(q, k, v, is_causal=is_causal, **descales)

    label = f"d{head_dim} {dtype} s{seq} h{heads}" + (f"/{heads_kv}" if heads_kv != heads else "")
    return Problem("gluon_attention_fwd_fp8" if fp8 else "gluon_attention_fwd", label + " causal" * is_causal,
                   run)  # fmt: skip


# The head dims each Gluon attention kernel takes (llm_speed.gluon.attention's HEAD_DIMS and
# BACKWARD_HEAD_DIMS, restated: this module does not import Gluon).
_GLUON_HEAD_DIMS = {"gluon_attention_fwd": (64, 128, 256), "gluon_attention_fwd_fp8": (64, 128, 256),
                    "gluon_attention_bwd": (64, 128)}


def _gluon_attention(op: str, options: Options) -> Iterator[Problem]:
    """Causal and not at each head dim of ``options.head_dims`` the kernel takes (the forward also at 256
    when the head dims are the default ones), in each 16-bit dtype: the forward or (``gluon_attention_bwd``)
    the backward; ``gluon_attention_fwd_fp8``: the forward on e4m3 inputs."""
    make = gluon_attention_bwd_problem if op == "gluon_attention_bwd" else gluon_attention_problem
    head_dims = options.head_dims
    if op != "gluon_attention_bwd" and head_dims == Options.head_dims:
        head_dims = (*head_dims, 256)
    dtypes = [d for d in _floating(options) if d != "fp32"] or ["fp16"]
    for dtype in ["fp8-e4m3"] if op == "gluon_attention_fwd_fp8" else dtypes:
        for head_dim in [d for d in head_dims if d in _GLUON_HEAD_DIMS[op]]:
            for is_causal in options.causal:
                yield make(head_dim=head_dim, dtype=dtype, seq=options.seq, heads=options.heads,
                           is_causal=is_causal)  # fmt: skip


def gluon_attention_bwd_problem(*, head_dim: int, dtype: str, seq: int, heads: int,
                                heads_kv: int | None = None, is_causal: bool = False) -> Problem:  # fmt: skip
    """:func:`llm_speed.gluon.attention_bwd.backward` over one sequence of ``seq`` tokens (out and lse drawn:
    the build does not depend on their values)."""
    heads_kv = heads_kv or heads

    def run(recording: Recording) -> None:
        import torch

        from llm_speed.gluon.attention_bwd import backward

        q, k, v = _qkv(1, heads, heads_kv, seq, head_dim, _torch_dtype(dtype))
        out, dout = torch.empty_like(q), torch.empty_like(q)
        lse = torch.empty(q.shape[:3])
        with recording():
            backward(q, k, v, out, lse, dout, is_causal=is_causal)

    label = f"d{head_dim} {dtype} s{seq} h{heads}" + (f"/{heads_kv}" if heads_kv != heads else "")
    return Problem("gluon_attention_bwd", label + " causal" * is_causal, run)


GLUON_BUILDERS: dict[str, Callable[[str, Options], Iterator[Problem]]] = {
    "gluon_gemm": _gluon_gemm,
    "gluon_gemm_fp8": _gluon_gemm_fp8,
    "gluon_gemm_int8": _gluon_gemm_int8,
    "gluon_attention_fwd": _gluon_attention,
    "gluon_attention_fwd_fp8": _gluon_attention,
    "gluon_attention_bwd": _gluon_attention,
}
# The Gluon kernels of the default set (and so of make test's shipped set). The forward attention takes
# 4-20 s a compile on one core of the shared development CPU (sm_90a, Triton 3.6): `--op
# gluon_attention_fwd` reports it, and tests/gluon compiles one variant of it; the backward likewise (`--op
# gluon_attention_bwd`).
GLUON_DEFAULT = ("gluon_gemm",)


def default_ops(*, gluon: bool = True) -> tuple[str, ...]:
    """The ops of the default report: every op-table row with a builder, in table order, then, with
    ``gluon``, the Gluon kernels of :data:`GLUON_DEFAULT`."""
    from llm_speed import ops as table

    return (*(name for name in table.names() if name in BUILDERS), *(GLUON_DEFAULT if gluon else ()))


def default_problems(ops: tuple[str, ...] | None, options: Options, *, gluon: bool = True) -> list[Problem]:
    """The problems of ``ops`` (op-table row names, or Gluon kernels of :data:`GLUON_BUILDERS`; None:
    :func:`default_ops`)."""
    from llm_speed import ops as table

    builders = {**BUILDERS, **GLUON_BUILDERS}
    names = ops or default_ops(gluon=gluon)
    problems = []
    for name in names:
        if name not in builders:
            row = table.get(name)  # ValueError listing the rows for an unknown name
            reason = "plain PyTorch: no kernel" if row.plain_pytorch else "no problem builder"
            raise ValueError(f"op: {name!r} has no kernel to report ({reason})")
        for problem in builders[name](name, options):
            problems.append(dataclasses.replace(problem, op=name))
    return problems


# --- the shipped configurations of a tier -------------------------------------------------------------------

# Attention variants compiled for the tier rows, in rotation over (dtype, head dim): the plain kernel (what
# the benchmarks run), the richest mask (a window with softcap, GQA) and packed sequences.
_VARIANTS = (
    dict(),
    dict(is_causal=True, window=(1000, 0), softcap=30.0, heads_kv=4),
    dict(op="flash_attention_varlen", is_causal=True, sequences=3),
)


def shipped_problems(backward_paths: tuple[str, ...] = ("default", "deterministic")) -> list[Problem]:
    """Problems that make the launchers pick every row of the attention tier of the stand-in GPU (dtype
    class x head dim x direction, each head dim 64, 128 and 256 once; float16's rows once in float16 and once
    in bfloat16), forward and backward (both paths), in rotating mask variants; the other ops'
    configurations, and the lesson's two-pass forward (``tiled_attention``, the flash kernel's tiles with a
    second pass), follow from their sizes and are those of :func:`default_problems`."""
    problems = []
    rows = [(dtype, head_dim) for head_dim in (64, 128, 256) for dtype in ("fp16", "bf16", "fp32")]
    for i, (dtype, head_dim) in enumerate(rows):
        if dtype == "bf16" and head_dim != 128:
            continue  # bfloat16 shares float16's rows: one head dim in bf16 is enough
        variant: dict[str, Any] = dict(_VARIANTS[i % len(_VARIANTS)])
        op = variant.pop("op", "flash_attention")
        # Dense rows at the default problems' shape (4096 tokens, 16 heads): where a row meets one of them
        # (float16 plain, d 64 and 128) Triton's key is the same and the kernel compiles once.
        seq, heads = (1000, 8) if variant.get("sequences") else (4096, 16)
        common = dict(head_dim=head_dim, dtype=dtype, seq=seq, heads=heads, **variant)
        problems.append(attention_problem(op, **common))
        for path in backward_paths:
            problems.append(attention_problem(op + "_backward", backward=path, **common))
    return problems


# --- the candidate launch choices (llm_speed.core.policy.CANDIDATES) ---------------------------------------


def _under(name: str, problem: Problem) -> Problem:
    """``problem`` made under the policy ``name`` (a candidate's, or one of :data:`COMBINED`; its label
    ends in ``[name]``)."""

    def run(recording: Recording) -> None:
        from llm_speed.core.policy import CANDIDATES, use_policy

        with use_policy(CANDIDATES[name].policy if name in CANDIDATES else COMBINED[name]()):
            problem.run(recording)

    return dataclasses.replace(problem, label=f"{problem.label} [{name}]", run=run)


def _uniform_with_tma():
    from llm_speed.core.policy import CANDIDATES

    uniform = CANDIDATES["uniform-bounds"].policy
    return dataclasses.replace(uniform, forward_tma_kv_head_dims=(128, 256), backward_tma_head_dims=(128,))


# Policies of several candidates at once, where a budget compares builds that take them together (packed
# sequences' loops against the dense ones, both with the TMA loads at d = 128).
COMBINED = {"uniform-bounds+tma": _uniform_with_tma}


def candidate_problems() -> list[Problem]:
    """Each candidate launch choice's kernels (off as shipped until a GPU proves them), built as the
    candidate's policy launches them, at a problem its choice changes: the budgets hold for them too, so
    that a candidate the GPU proves can ship as built."""
    d128 = dict(head_dim=128, dtype="fp16")
    packed = dict(dtype="fp16", heads_kv=4, is_causal=True, sequences=4)
    bwd = dict(backward="deterministic")
    chosen = {
        "backward-atomic-dq": [attention_problem("flash_attention_backward", **d128, is_causal=c,
                                                 backward="default") for c in (False, True)],  # fmt: skip
        "forward-overlap": [attention_problem("flash_attention", **d128)],
        "forward-tma-kv": [attention_problem("flash_attention", **d128)],
        "forward-overlap-tma-kv": [attention_problem("flash_attention", **d128, is_causal=c)
                                   for c in (False, True)],  # fmt: skip
        "backward-tma": [attention_problem("flash_attention_backward", **d128, is_causal=True, **bwd)],
        "rows32": [attention_problem("flash_attention", head_dim=64, dtype="fp16", is_causal=True),
                   attention_problem("flash_attention_backward", head_dim=64, dtype="fp16", is_causal=True,
                                     **bwd)],  # fmt: skip
        "uniform-bounds": [
            attention_problem("flash_attention_varlen", head_dim=64, **packed),
            attention_problem("flash_attention_varlen_backward", head_dim=64, **packed, **bwd),
        ],
        "uniform-bounds+tma": [
            attention_problem("flash_attention", **d128, is_causal=True),
            attention_problem("flash_attention_backward", **d128, is_causal=True, **bwd),
            attention_problem("flash_attention_varlen", head_dim=128, **packed),
            attention_problem("flash_attention_varlen_backward", head_dim=128, **packed, **bwd),
        ],
        "decode-append": [decode_problem(head_dim=128, dtype="fp16")],
        "fp8-weights-gpu-cast": [dataclasses.replace(
            attention_problem("flash_attention", head_dim=64, dtype="bf16", fp8=True),
            op="flash_attention_fp8",
        )],  # fmt: skip
    }
    return [_under(name, problem) for name, problems in chosen.items() for problem in problems]
