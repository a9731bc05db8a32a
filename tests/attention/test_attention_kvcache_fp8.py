"""flash_attention_with_kvcache over an fp8 KV cache (float8_e4m3fn / float8_e5m2 with k_descale / v_descale
per tensor, per KV head or per sequence and KV head): dense and paged, GQA, appends with and without rotary,
saturation, bad descale arguments, invalid entries with the value checks off, plans and host reads.

Truth: :func:`llm_speed.attention.reference.reference_kvcache` in float64 over the cache the op holds,
dequantized exactly (``cache * descale``), so the quantization is not counted as kernel error; the
same-precision version dequantizes into q's dtype. 2x rule of TESTING.md on out and LSE. The appended cache
bytes must equal the reference's quantization (``(x.float() / descale).clamp(-max, max).to(fp8)``) bit for
bit: under the interpreter the kernel rounds by hand (docs/fp8.md, "Interpreter rounding").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from attention_testing import (
    OUTPUT_FACTOR,
    assert_error_rule,
    decode_kernels,
    expect_launches,
    repeat_decode_step,
)

from host_reads import host_reads_raise
from llm_speed.attention import decode, decode_launch
from llm_speed.attention.decode import flash_attention_with_kvcache
from llm_speed.attention.reference import FP8_MAX, descale_rows, quantize_to_cache, reference_kvcache
from llm_speed.core import runtime

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
I32 = torch.int32


@dataclass
class Case:
    name: str
    dtype: torch.dtype  # q, k, v
    cache: torch.dtype  # the caches' fp8 dtype
    lens: list[int]
    capacity: int
    heads: tuple[int, int]  # (heads_q, heads_kv)
    seq_q: int
    seq_new: int
    descale: str  # "tensor" ([]), "one" ([1]), "head" ([heads_kv]), "batch" ([batch, heads_kv])
    head_dim: int = 32
    page_size: int | None = None
    rotary: tuple | None = None  # (rotary_dim, interleaved)
    saturate: bool = False  # appended k/v up to 4x past the format's range at their descale
    cache_batch: int | None = None  # dense rows picked by a cache_batch_idx (descales still per sequence)
    leftpad: list[int] | None = None
    alibi: bool = False
    options: dict = field(default_factory=dict)
    positive: bool = False


CASES = [
    Case("dense-bf16-e4m3-tensor-gqa", BF16, E4M3, [5, 0, 40], 48, (4, 2), 1, 1, "tensor"),
    Case("paged16-f16-e4m3-head-gqa-causal-split", F16, E4M3, [33, 0, 50], 64, (8, 2), 2, 2, "head",
         page_size=16, options={"is_causal": True, "num_splits": 3}),
    Case("dense-f32-e5m2-batch-rotary-causal", F32, E5M2, [3, 20], 32, (2, 2), 2, 2, "batch",
         rotary=(32, True), options={"is_causal": True}),
    Case("paged16-bf16-e4m3-one-rotary-neox-mqa-positive", BF16, E4M3, [20, 7], 32, (4, 1), 1, 1, "one",
         page_size=16, rotary=(16, False), positive=True),
    Case("dense-f16-e4m3-head-saturated-append-window-softcap", F16, E4M3, [30, 12], 48, (4, 2), 3, 3, "head",
         saturate=True, options={"window": (8, 0), "softcap": 3.0}),
    Case("dense-bf16-e4m3-batch-index-leftpad-alibi-causal", BF16, E4M3, [12, 30, 5], 32, (4, 2), 2, 1,
         "batch", cache_batch=4, leftpad=[3, 0, 5], alibi=True, options={"is_causal": True}),
]  # fmt: skip


def _descale(layout: str, batch: int, heads_kv: int) -> torch.Tensor:
    """Descales around amax / fp8_max of randn data (|x| < ~4), different per head and sequence."""
    shape = {"tensor": (), "one": (1,), "head": (heads_kv,), "batch": (batch, heads_kv)}[layout]
    return 4.0 / 448 * (0.5 + torch.rand(shape))


def build(case: Case, device):
    """(call keyword arguments on ``device``, the same on the CPU): fp8 caches holding every sequence's
    tokens quantized with its descales, NaN everywhere else (pages shuffled)."""
    batch, (heads_q, heads_kv), dim = len(case.lens), case.heads, case.head_dim
    draw = torch.rand if case.positive else torch.randn
    dtype = case.dtype
    q = draw(batch, case.seq_q, heads_q, dim).to(dtype)
    if case.options.get("softcap"):
        q = q * 4
    k_descale = _descale(case.descale, batch, heads_kv)
    v_descale = _descale(case.descale, batch, heads_kv)
    k_rows, v_rows = descale_rows(k_descale, batch, heads_kv), descale_rows(v_descale, batch, heads_kv)
    call = dict(q=q, cache_seqlens=torch.tensor(case.lens, dtype=I32), k_descale=k_descale,
                v_descale=v_descale, **case.options)  # fmt: skip
    index = torch.arange(batch)
    if case.page_size is None:
        shape = (case.cache_batch or batch, case.capacity, heads_kv, dim)
        table = None
        if case.cache_batch:
            index = torch.randperm(case.cache_batch)[:batch].to(I32)
            call["cache_batch_idx"] = index
    else:
        pages = case.capacity // case.page_size
        num_blocks = batch * pages + 3
        table = torch.randperm(num_blocks)[: batch * pages].reshape(batch, pages).to(I32)
        shape = (num_blocks, case.page_size, heads_kv, dim)
        call["block_table"] = table
    k_cache = torch.full(shape, float("nan")).to(case.cache)
    v_cache = torch.full(shape, float("nan")).to(case.cache)
    leftpad = case.leftpad or [0] * batch
    for b, n in enumerate(case.lens):
        pos = torch.arange(leftpad[b], n)
        slots = (int(index[b]), pos) if table is None else (table[b, pos // case.page_size].long(),
                                                            pos % case.page_size)  # fmt: skip
        k_cache[slots] = quantize_to_cache(draw(len(pos), heads_kv, dim), k_rows[b], case.cache)
        v_cache[slots] = quantize_to_cache(draw(len(pos), heads_kv, dim), v_rows[b], case.cache)
    if case.leftpad is not None:
        call["cache_leftpad"] = torch.tensor(case.leftpad, dtype=I32)
    if case.alibi:
        call["alibi_slopes"] = torch.rand(batch, heads_q) * 0.3
    call.update(k_cache=k_cache, v_cache=v_cache)
    if case.seq_new:
        k_new, v_new = (draw(batch, case.seq_new, heads_kv, dim) for _ in range(2))
        if case.saturate:  # up to 4x past the range: saturated to +-max in the cache
            k_new = k_new * 4 * (FP8_MAX[case.cache] * k_rows.max()).item() / k_new.abs().max()
            v_new = v_new * 4 * (FP8_MAX[case.cache] * v_rows.max()).item() / v_new.abs().max()
        call["k"], call["v"] = k_new.to(dtype), v_new.to(dtype)
    if case.rotary is not None:
        rotary_dim, interleaved = case.rotary
        per_row = case.options.get("is_causal") or case.options.get("window") is not None
        rows = max(case.lens) + decode.rotary_span(case.seq_new, case.seq_q, per_row)
        angle = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
        call["rotary_cos"], call["rotary_sin"] = angle.cos().float(), angle.sin().float()
        call["rotary_interleaved"] = interleaved
    on_device = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    return on_device, call


def run_reference(call, truth: bool):
    """reference_kvcache of the CPU inputs: q, k, v and the tables in float64 for the truth (the fp8 caches
    and the float32 descales as they are), else as given."""
    skip = ("num_splits", "return_lse")
    wide = ("q", "k", "v", "rotary_cos", "rotary_sin", "alibi_slopes")
    kwargs = {n: (t.double() if truth and n in wide else t) for n, t in call.items() if n not in skip}
    q, k_cache, v_cache, seqlens = (kwargs.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens"))
    return reference_kvcache(q, k_cache, v_cache, seqlens, **kwargs)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.cpu().view(torch.uint8)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_truth_and_quantizes_the_appended_tokens(case, device):
    on_device, call = build(case, device)
    with expect_launches(*decode_kernels(on_device["q"], case.heads[1], case.seq_new), device=device):
        out, lse = flash_attention_with_kvcache(**on_device, return_lse=True)
    truth, same = run_reference(call, True), run_reference(call, False)
    assert out.shape == call["q"].shape and out.dtype == case.dtype and lse.dtype == F32
    assert_error_rule("out", out, same[0], truth[0], OUTPUT_FACTOR, case.dtype)
    assert_error_rule("lse", lse, same[1], truth[1], OUTPUT_FACTOR, case.dtype)
    # The caches: the appended tokens quantized exactly as the reference, every other byte unchanged.
    assert torch.equal(truth[2].view(torch.uint8), same[2].view(torch.uint8))
    assert torch.equal(_bytes(on_device["k_cache"]), _bytes(same[2]))
    assert torch.equal(_bytes(on_device["v_cache"]), _bytes(same[3]))
    if case.saturate:
        limit = FP8_MAX[case.cache]
        new = [on_device[n].cpu().float() for n in ("k_cache", "v_cache")]
        assert all((c.abs() == limit).sum() > 0 for c in new)  # saturated values were written


def test_saturation_nan_infinity_and_rounding_of_the_append(device):
    """Values past +-448 and infinities saturate, a NaN stays NaN, a tie rounds to even, tiny values go
    subnormal: bit for bit the reference's cast, for both fp8 formats."""
    special = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), float("nan"), 31.75, -31.75, 30.5,
                            2.0**-8, 3 * 2.0**-10, 0.0, -0.0, 447.9, 465.0, 500.0, 57344.0])  # fmt: skip
    for cache_dtype in (E4M3, E5M2):
        descale = torch.tensor([1.0, 0.5])
        k = torch.stack([special, special * 0.5])[None, None]  # [1, 1, heads_kv 2, 16]
        v = -k
        k_cache = torch.zeros(1, 16, 2, 16).to(cache_dtype).to(device)
        v_cache = k_cache.clone()
        flash_attention_with_kvcache(torch.randn(1, 1, 2, 16, device=device), k_cache, v_cache,
                                     cache_seqlens=3, k=k.to(device), v=v.to(device),
                                     k_descale=descale.to(device), v_descale=descale.to(device))  # fmt: skip
        for cache, new in ((k_cache, k), (v_cache, v)):
            want = quantize_to_cache(new[0, 0], descale, cache_dtype)
            nan = want.float().isnan()  # a NaN's sign and payload may differ on a GPU (cvt's canonical NaN)
            assert torch.equal(cache[0, 3].cpu().float().isnan(), nan)
            assert torch.equal(_bytes(cache[0, 3])[~nan], _bytes(want)[~nan])
        stored = k_cache[0, 3, 0].cpu().float()
        limit = FP8_MAX[cache_dtype]
        assert stored[:4].abs().eq(limit).all() and stored[4].isnan()
        assert _bytes(k_cache[0, :3]).eq(0).all() and _bytes(k_cache[0, 4:]).eq(0).all()


def test_fp8_cache_agrees_with_the_16bit_cache_of_its_dequantized_values(device):
    """Metamorphic: the fp8 call equals the bf16-cache call over ``cache.float() * descale`` (exact in
    float32 at these descales, powers of two) up to float32 reassociation."""
    batch, heads_kv, dim = 2, 2, 32
    k8 = (torch.randn(batch, 64, heads_kv, dim) * 30).to(E4M3)
    v8 = (torch.randn(batch, 64, heads_kv, dim) * 30).to(E4M3)
    k_ds, v_ds = torch.tensor([2.0**-5, 2.0**-3]), torch.tensor([[2.0**-4, 2.0**-6], [2.0**-2, 2.0**-7]])
    q = torch.randn(batch, 1, 4, dim)
    lens = torch.tensor([40, 64], dtype=I32)
    k32 = k8.float() * k_ds[None, None, :, None]
    v32 = v8.float() * v_ds[:, None, :, None]
    args = dict(cache_seqlens=lens.to(device), num_splits=1, return_lse=True)
    descales = dict(k_descale=k_ds.to(device), v_descale=v_ds.to(device))
    out8, lse8 = flash_attention_with_kvcache(q.to(device), k8.to(device), v8.to(device), **args, **descales)
    out, lse = flash_attention_with_kvcache(q.to(device), k32.to(device), v32.to(device), **args)
    torch.testing.assert_close(out8, out, atol=4e-6, rtol=4e-6)
    torch.testing.assert_close(lse8, lse, atol=4e-6, rtol=4e-6)


def test_bf16_queries_of_any_magnitude_over_an_fp8_cache(device):
    """A bfloat16 q over an fp8 cache multiplies K in float16, its rows first scaled by powers of two into
    float16's range: rows of one GQA group past float16's largest value (~1e5), ordinary, zero and tiny
    (2**-130, bfloat16 subnormals) all meet the float64 truth (a row cast to float16 as it is would be inf,
    its output NaN)."""
    batch, heads_kv, dim = 2, 1, 64
    q = torch.randn(batch, 1, 4, dim)
    q[:, :, 0] *= 3e4  # |q| up to ~1e5
    q[:, :, 2] = 0.0
    q[:, :, 3] = q[:, :, 3].sign() * 2.0**-130
    q = q.to(BF16)
    assert q[:, :, 0].float().abs().max() > torch.finfo(F16).max
    k8, v8 = ((torch.randn(batch, 48, heads_kv, dim) * 100).to(E4M3) for _ in range(2))
    descale = torch.tensor([0.01])
    lens = torch.tensor([48, 21], dtype=I32)
    call = dict(q=q, k_cache=k8, v_cache=v8, cache_seqlens=lens, k_descale=descale, v_descale=descale,
                scale=1e-4)  # fmt: skip
    on_device = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    with expect_launches(decode.KERNEL_DECODE, device=device):
        out, lse = flash_attention_with_kvcache(**on_device, return_lse=True)
    truth, same = run_reference(call, True), run_reference(call, False)
    assert out.isfinite().all() and lse.isfinite().all()
    assert_error_rule("out", out, same[0], truth[0], OUTPUT_FACTOR, BF16)
    assert_error_rule("lse", lse, same[1], truth[1], OUTPUT_FACTOR, BF16)


def test_strided_descales_give_the_contiguous_result(device):
    """[batch, heads_kv] descales as a transposed view, [heads_kv] as a strided slice: read through their
    strides, bitwise the result of contiguous copies."""
    batch, heads_kv, dim = 3, 2, 16
    k8, v8 = ((torch.randn(batch, 32, heads_kv, dim) * 50).to(E4M3).to(device) for _ in range(2))
    q = torch.randn(batch, 1, 4, dim, device=device)
    k_new, v_new = (torch.randn(batch, 1, heads_kv, dim, device=device) for _ in range(2))
    k_ds = (torch.rand(heads_kv, batch) * 0.02 + 0.01).to(device).t()
    v_ds = (torch.rand(heads_kv, 3) * 0.02 + 0.01).to(device)[:, 1]
    assert not k_ds.is_contiguous() and not v_ds.is_contiguous()
    results = []
    for kd, vd in ((k_ds, v_ds), (k_ds.contiguous(), v_ds.contiguous())):
        kc, vc = k8.clone(), v8.clone()
        lens = torch.tensor([3, 30, 0], dtype=I32, device=device)
        out = flash_attention_with_kvcache(q, kc, vc, cache_seqlens=lens, k=k_new, v=v_new, k_descale=kd,
                                           v_descale=vd)  # fmt: skip
        results.append((out, _bytes(kc), _bytes(vc)))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_operator_registration_with_fp8_caches(device):
    """The custom op with fp8 caches and descales passes opcheck's fake-tensor test (its schema test compares
    the mutated caches with ``torch.allclose``, which torch 2.13 does not implement for fp8 (CPU); the
    same schema passes it with 16-bit caches, test_attention_kvcache.py)."""
    k_cache = (torch.randn(2, 16, 2, 16) * 20).to(E4M3).to(device)
    args = (torch.randn(2, 1, 4, 16, device=device), k_cache, k_cache.clone(),
            torch.tensor([3, 7], dtype=I32, device=device), torch.randn(2, 1, 2, 16, device=device),
            torch.randn(2, 1, 2, 16, device=device), None, 0.25, None, None, None, 0, None, None, None, None,
            True, None, torch.tensor(0.05, device=device), torch.full((2,), 0.05, device=device))  # fmt: skip
    torch.library.opcheck(decode._kvcache_op, args, test_utils=("test_faketensor",))


def test_flash_attn_wrapper_passes_fa3_descales(device):
    """flash_attn_interface.flash_attn_with_kvcache takes FlashAttention-3's k_descale/v_descale ([batch,
    heads_kv]) by keyword: bitwise the result (and the appended cache) of the llm-speed call."""
    from llm_speed import flash_attn_interface as fa

    k8 = (torch.randn(2, 16, 2, 32) * 40).to(E4M3).to(device)
    v8 = (torch.randn(2, 16, 2, 32) * 40).to(E4M3).to(device)
    q = torch.randn(2, 1, 4, 32, dtype=BF16, device=device)
    k_new, v_new = (torch.randn(2, 1, 2, 32, dtype=BF16, device=device) for _ in range(2))
    lens = torch.tensor([5, 9], dtype=I32, device=device)
    descales = dict(k_descale=torch.rand(2, 2, device=device) * 0.02 + 0.01,
                    v_descale=torch.rand(2, 2, device=device) * 0.02 + 0.01)  # fmt: skip
    kc, vc = k8.clone(), v8.clone()
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, causal=True,
                                          return_softmax_lse=True, **descales)  # fmt: skip
    kc2, vc2 = k8.clone(), v8.clone()
    want = flash_attention_with_kvcache(q, kc2, vc2, k=k_new, v=v_new, cache_seqlens=lens, is_causal=True,
                                        return_lse=True, **descales)  # fmt: skip
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
    assert torch.equal(_bytes(kc), _bytes(kc2)) and torch.equal(_bytes(vc), _bytes(vc2))


def test_op_table_counts_one_byte_per_fp8_cache_element():
    """The op table's cost of an fp8 call (what the profiler records): the cache at 1 byte per element."""
    from llm_speed import ops
    from llm_speed.perf.kernel_costs import kvcache_decode_cost

    q = torch.randn(2, 1, 4, 32, dtype=BF16)
    k_cache = torch.zeros(2, 64, 2, 32).to(E4M3)
    lens = torch.tensor([40, 25], dtype=I32)
    work = ops.kvcache_work(q=q, k_cache=k_cache, cache_seqlens=lens, seq_new=1, window=None)
    costs = [kvcache_decode_cost(1, 4, 1, n, 32, heads_kv=2, dtype="bf16", seq_new=1, kv_dtype="fp8")
             for n in (41, 26)]  # fmt: skip
    assert work.bytes_moved == sum(c.bytes_moved for c in costs)
    sixteen = ops.kvcache_work(q=q, k_cache=k_cache.to(BF16), cache_seqlens=lens, seq_new=1, window=None)
    cache_bytes = 2 * 2 * 32 * (41 + 26)  # K and V, heads_kv 2, head_dim 32: 1 byte each saved
    assert sixteen.bytes_moved - work.bytes_moved == cache_bytes + 2 * 2 * 2 * 32  # and the 2 appends


# --- bad input: a clear error naming the argument, before any write -----------------------------------------


def _fp8_call():
    """A valid dense fp8 call: 2 sequences, caches [2, 16, 2, 16] in e4m3, one token appended."""
    k_cache = (torch.randn(2, 16, 2, 16) * 20).to(E4M3)
    return dict(q=torch.randn(2, 1, 4, 16, dtype=BF16), k_cache=k_cache, v_cache=k_cache.clone(),
                cache_seqlens=torch.tensor([3, 5], dtype=I32), k=torch.randn(2, 1, 2, 16, dtype=BF16),
                v=torch.randn(2, 1, 2, 16, dtype=BF16), k_descale=torch.tensor(0.05),
                v_descale=torch.full((2,), 0.05))  # fmt: skip


BF16_CACHE = torch.randn(2, 16, 2, 16, dtype=BF16)
BAD = [
    ({"k_descale": None}, ValueError, r"k_descale is required with an fp8 cache"),
    ({"v_descale": None}, ValueError, r"v_descale is required with an fp8 cache"),
    ({"k_cache": BF16_CACHE, "v_cache": BF16_CACHE.clone()}, ValueError,
     r"k_descale is for an fp8 cache .*k_cache has dtype torch.bfloat16: leave k_descale None"),
    ({"k_cache": BF16_CACHE, "v_cache": BF16_CACHE.clone(), "k_descale": None}, ValueError,
     "v_descale is for an fp8 cache"),
    ({"k_descale": torch.tensor(0.05, dtype=torch.float64)}, TypeError, "k_descale must be float32"),
    ({"v_descale": torch.full((2,), 0.05, dtype=BF16)}, TypeError, "v_descale must be float32"),
    ({"k_descale": 0.05}, TypeError, r"k_descale must be a torch.Tensor \(float32\), got float"),
    ({"k_descale": torch.full((3,), 0.05)}, ValueError,
     r"k_descale must be \[\] or \[1\] \(per tensor\), \[heads_kv=2\] .* got shape \(3,\)"),
    ({"v_descale": torch.full((2, 1), 0.05)}, ValueError, r"v_descale must be .*\[batch=2, heads_kv=2\]"),
    ({"v_descale": torch.full((1, 1, 1), 0.05)}, ValueError, r"v_descale must be"),
    ({"k_descale": torch.tensor(0.05, device="meta")}, ValueError, "k_descale is on meta but q is on cpu"),
    ({"k_descale": torch.tensor(0.0)}, ValueError, "k_descale must be finite and > 0, got 0.0"),
    ({"v_descale": torch.tensor([0.05, -1.0])}, ValueError, "v_descale must be finite and > 0, got -1.0"),
    ({"v_descale": torch.tensor([0.05, float("inf")])}, ValueError, "v_descale must be finite and > 0"),
    ({"k_descale": torch.tensor(float("nan"))}, ValueError, "k_descale must be finite and > 0, got nan"),
    ({"v_cache": torch.zeros(2, 16, 2, 16, dtype=BF16)}, TypeError,
     r"k_cache \(torch.float8_e4m3fn\) and v_cache \(torch.bfloat16\) must share one dtype"),
    ({"v_cache": torch.zeros(2, 16, 2, 16).to(E5M2)}, TypeError, "must share one dtype"),
    ({"k_cache": torch.zeros(2, 16, 2, 16).to(torch.float8_e4m3fnuz)}, TypeError,
     r"k_cache has dtype torch.float8_e4m3fnuz; accepted: .*float8_e4m3fn, float8_e5m2"),
    ({"k_cache": torch.zeros(2, 16, 2, 16, dtype=F16)}, TypeError,
     r"k_cache dtype torch.float16 differs from q's torch.bfloat16: it must be q's dtype \(or an fp8"),
    ({"k": torch.zeros(2, 1, 2, 16).to(E4M3)}, TypeError, r"k has dtype torch.float8_e4m3fn; accepted"),
    ({"v_cache": torch.zeros(2, 16, 2, 16).to(E4M3).to("meta")}, ValueError, "v_cache is on meta"),
]  # fmt: skip


@pytest.mark.parametrize("change, error, match", BAD, ids=[f"{next(iter(c))}-{i}" for i, (c, _, _) in
                                                             enumerate(BAD)])  # fmt: skip
def test_bad_descales_and_caches_are_refused_before_any_write(change, error, match):
    call = _fp8_call()
    call.update(change)
    k_cache, v_cache = call["k_cache"], call["v_cache"]
    before = [t.clone() for t in (k_cache, v_cache) if t.device.type == "cpu"]
    with pytest.raises(error, match=match):
        flash_attention_with_kvcache(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), **call)
    after = [t for t in (k_cache, v_cache) if t.device.type == "cpu"]
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(after, before, strict=True))


def test_boundaries_accepted(device):
    """Each descale layout at its boundary: [1], [heads_kv] with one KV head, [batch, heads_kv] with batch 1,
    both fp8 formats, q in each float dtype."""
    for dtype, cache_dtype, descale in ((BF16, E4M3, torch.tensor([0.05])), (F16, E5M2, torch.tensor([0.05])),
                                        (F32, E4M3, torch.tensor([[0.05]]))):  # fmt: skip
        k_cache = (torch.randn(1, 16, 1, 16) * 20).to(cache_dtype).to(device)
        out = flash_attention_with_kvcache(
            torch.randn(1, 1, 2, 16, dtype=dtype, device=device), k_cache, k_cache.clone(), cache_seqlens=15,
            k=torch.randn(1, 1, 1, 16, dtype=dtype, device=device),
            v=torch.randn(1, 1, 1, 16, dtype=dtype, device=device), k_descale=descale.to(device),
            v_descale=descale.to(device),
        )  # fmt: skip
        assert out.dtype == dtype and torch.isfinite(out).all()


# --- value checks off (the CUDA default): invalid entries give NaN rows, touch nothing --------------------


def test_unchecked_bad_entries_give_nan_rows_and_no_fp8_write(device, monkeypatch, policy):
    """cache_seqlens past the capacity and a block-table entry outside the pool, with an fp8 paged cache:
    those sequences' rows NaN and nothing of theirs appended (by the attention kernel); the others as in a
    valid call."""
    policy(decode_append_in_attention=True)
    capacity, page_size, heads_kv, dim = 64, 16, 2, 16
    pages = capacity // page_size
    table = torch.randperm(3 * pages).reshape(3, pages).to(I32)
    k_cache = (torch.randn(3 * pages, page_size, heads_kv, dim) * 20).to(E4M3).to(device)
    v_cache = (torch.randn(3 * pages, page_size, heads_kv, dim) * 20).to(E4M3).to(device)
    q = torch.randn(3, 1, 4, dim, device=device)
    k_new, v_new = (torch.randn(3, 1, heads_kv, dim, device=device) for _ in range(2))
    descales = dict(k_descale=torch.tensor(0.05, device=device), v_descale=torch.tensor(0.04, device=device))
    good = torch.tensor([10, 20, 30], dtype=I32, device=device)
    truth = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), cache_seqlens=good, k=k_new,
                                         v=v_new, block_table=table.to(device), **descales)  # fmt: skip
    bad_table = table.clone()
    bad_table[2, 1] = 3 * pages  # sequence 2's page of its new token: outside the pool
    before_k, before_v = _bytes(k_cache).clone(), _bytes(v_cache).clone()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    lens = torch.tensor([64, 20, 30], dtype=I32, device=device)  # sequence 0: 64 + 1 > capacity
    with expect_launches(decode.KERNEL_DECODE, device=device, only=True):  # (appending too)
        out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k_new, v=v_new,
                                           block_table=bad_table.to(device), num_splits=1,
                                           **descales)  # fmt: skip
    assert out[0].isnan().all() and out[2].isnan().all()
    torch.testing.assert_close(out[1], truth[1], atol=1e-6, rtol=1e-6)
    changed_k = (_bytes(k_cache) != before_k).any(dim=(2, 3))
    changed_v = (_bytes(v_cache) != before_v).any(dim=(2, 3))
    expected = torch.zeros_like(changed_k)
    expected[int(table[1, 1]), 20 % page_size] = True  # sequence 1's new token, and nothing else
    assert torch.equal(changed_k, expected) and torch.equal(changed_v, expected)


# --- per-call host work: plans from shapes only, no host read of device data ------------------------------

def test_plans_key_the_cache_dtype_and_descale_layout_and_nothing_is_read(monkeypatch, policy):
    """On the CUDA code path (simulated, launches stubbed, checks off): descale values and lengths share a
    plan; the fp8 format, the descale layout and a 16-bit cache each get their own; no host read (the new
    tokens written by the attention kernel)."""
    from llm_speed.core import launch

    policy(decode_append_in_attention=True)

    call = _fp8_call()
    q, k_cache, v_cache = call.pop("q"), call.pop("k_cache"), call.pop("v_cache")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    e5m2 = dict(k_cache=k_cache.to(torch.float32).to(E5M2), v_cache=v_cache.to(torch.float32).to(E5M2))
    variants = [
        {},
        {"k_descale": torch.tensor(0.5), "v_descale": torch.full((2,), 0.2),
         "cache_seqlens": torch.tensor([0, 9], dtype=I32)},  # values only: the same plan
        {"k_descale": torch.tensor([0.5])},  # [1]: per tensor too, the same plan
        {"k_descale": torch.full((2,), 0.5)},  # per head
        {"v_descale": torch.full((2, 2), 0.5)},  # per sequence and head
        e5m2,
        {"k_cache": k_cache.to(BF16), "v_cache": v_cache.to(BF16), "k_descale": None, "v_descale": None},
    ]  # fmt: skip
    with launch.simulated_gpu():
        before = runtime.launch_counts()
        with host_reads_raise(monkeypatch):
            for change in variants:
                args = {"k_cache": k_cache, "v_cache": v_cache, **call, **change}
                flash_attention_with_kvcache(q, **args)
        ran = runtime.launch_counts() - before
        info = decode_launch.step_plans.cache_info()
    assert info.misses == 5  # (a plain call's plans are looked up once more, to be kept by its metadata)
    assert ran == {decode.KERNEL_DECODE: 7}  # (the attention kernel appends the new tokens)


def test_a_repeated_fp8_step_skips_the_checks(monkeypatch):
    """With the value checks off (as for CUDA tensors) a repeated fp8 step (one token appended, quantized by
    the descales) is served from the calls checked before: no check, the same output and cache bytes; a
    descale of another layout is checked, and every metadata error is still raised."""
    from call_records import record_checks

    checked = record_checks(monkeypatch, torch.device("cpu"), decode, "_check_descales")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = _fp8_call()
    repeat_decode_step(call, checked)
    assert len(checked) == 1
    flash_attention_with_kvcache(**dict(call, v_descale=torch.full((2, 2), 0.05)))  # another layout: checked
    assert len(checked) == 2
    for change, error, match in BAD:
        if "finite and > 0" not in match:  # (a value check: off here)
            with pytest.raises(error, match=match):
                flash_attention_with_kvcache(**{**call, **change})
