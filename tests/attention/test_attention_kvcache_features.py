"""flash_attention_with_kvcache's flash-attn 2.x options: cache_batch_idx, cache_leftpad, rotary embedding
(interleaved and GPT-NeoX, tables in q's dtype or float32), ALiBi slopes ([heads] and [batch, heads]) and any
head_dim from 1 to 256, each alone and combined (GQA, paged, split, causal, window, softcap).

Each case scatters every sequence's valid tokens into a cache whose other slots (left padding, slots past
the tokens, rows or pages no sequence uses) hold NaN, runs the op, and compares out, LSE and the caches
with :func:`llm_speed.attention.reference.reference_kvcache` in float64 (the truth) and in the op's dtype
(the same-precision version) under the 2x rule of TESTING.md. Then: bad input refused before any write,
NaN rows for invalid entries with the value checks off, and plans from shapes only with no host read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from attention_testing import OUTPUT_FACTOR, assert_error_rule, decode_kernels, expect_launches

from host_reads import host_reads_raise
from llm_speed.attention import decode, decode_launch
from llm_speed.attention.decode import flash_attention_with_kvcache
from llm_speed.attention.reference import apply_rotary, reference_kvcache
from llm_speed.core import runtime

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


@dataclass
class Case:
    name: str
    dtype: torch.dtype
    lens: list[int]
    capacity: int
    heads: tuple[int, int]  # (heads_q, heads_kv)
    seq_q: int
    seq_new: int
    head_dim: int = 32
    page_size: int | None = None
    cache_batch: int | None = None  # dense rows; a cache_batch_idx picks them when given
    leftpad: list[int] | None = None
    rotary: tuple | None = None  # (rotary_dim, interleaved, table dtype or None for q's dtype)
    rotary_rows: int | None = None  # rows of the tables (default: every position of the call, exactly)
    alibi: str | None = None  # "head" ([heads_q] slopes) or "batch" ([batch, heads_q])
    options: dict = field(default_factory=dict)
    positive: bool = False  # torch.rand inputs (truncating bf16 casts would show, TESTING.md)


CASES = [
    Case("batch-idx-append-gqa-causal", F16, [5, 30, 0], 48, (4, 2), 2, 2, cache_batch=5,
         options={"is_causal": True}),
    Case("batch-idx-read-only", F32, [7, 12], 32, (2, 2), 1, 0, head_dim=16, cache_batch=3),
    Case("leftpad-causal-window-split", BF16, [40, 17, 60], 64, (4, 1), 3, 3, leftpad=[10, 0, 59],
         options={"is_causal": True, "window": (20, None), "num_splits": 3}),
    Case("leftpad-window-both-sides-only-new-keys", F32, [30, 9], 48, (2, 2), 4, 1, head_dim=16,
         leftpad=[25, 9], options={"window": (3, 2)}),
    Case("rotary-interleaved-not-causal", F16, [3, 20], 32, (4, 2), 3, 3, rotary=(32, True, None)),
    Case("rotary-neox-not-causal-seq-q-above-seq-new", F16, [3, 20], 32, (2, 2), 3, 1,
         rotary=(32, False, None)),
    Case("rotary-neox-causal-partial-positive", BF16, [10, 0], 32, (2, 1), 2, 2, head_dim=64,
         rotary=(16, False, F32), options={"is_causal": True}, positive=True),
    Case("rotary-interleaved-window-f32-tables", F32, [8, 25], 32, (2, 2), 3, 1, rotary=(24, True, F32),
         options={"window": (5, 0)}),
    Case("alibi-per-head", F32, [20, 3], 32, (4, 2), 2, 1, alibi="head"),
    Case("alibi-per-batch-head-causal-softcap", F16, [40, 11], 64, (4, 4), 3, 1, alibi="batch",
         options={"is_causal": True, "softcap": 2.0}),
    Case("paged-rotary-alibi-gqa-split", BF16, [33, 0, 50], 64, (8, 2), 2, 2, page_size=16,
         rotary=(32, False, None), alibi="batch", options={"is_causal": True, "num_splits": 3}),
    Case("dense-everything", F16, [12, 40, 25], 48, (6, 2), 2, 2, head_dim=48, cache_batch=4,
         leftpad=[3, 0, 25], rotary=(16, True, F32), alibi="head",
         options={"is_causal": True, "window": (10, None), "softcap": 5.0}),
    # head dims the kernels pad (to 16 or the next power of two) with masked loads
    Case("head-dim-1-alibi-leftpad", F32, [9, 4], 16, (2, 1), 2, 1, head_dim=1, leftpad=[3, 0], alibi="head",
         options={"is_causal": True}),
    Case("head-dim-59-rotary-neox-batch-idx", F16, [6, 13], 32, (4, 2), 2, 2, head_dim=59, cache_batch=3,
         rotary=(58, False, None), options={"is_causal": True}),
    Case("head-dim-111-paged-rotary-interleaved", F32, [20, 35], 48, (4, 1), 1, 1, head_dim=111, page_size=16,
         rotary=(20, True, None), alibi="batch"),
]  # fmt: skip


def build(case: Case, device):
    """(call keyword arguments on ``device``, the same inputs on the CPU for the reference): caches with NaN
    outside every sequence's valid tokens, pages shuffled, rows picked at random."""
    batch, (heads_q, heads_kv), dim = len(case.lens), case.heads, case.head_dim
    draw = torch.rand if case.positive else torch.randn
    dtype = case.dtype
    q = draw(batch, case.seq_q, heads_q, dim).to(dtype)
    if case.options.get("softcap"):
        q = q * 4  # logits well past the cap
    leftpad = case.leftpad or [0] * batch
    call = dict(q=q, cache_seqlens=torch.tensor(case.lens, dtype=torch.int32), **case.options)
    if case.page_size is None:
        rows = case.cache_batch or batch
        index = torch.randperm(rows)[:batch].to(torch.int32) if case.cache_batch else torch.arange(batch)
        k_cache = torch.full((rows, case.capacity, heads_kv, dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        for b, (start, end) in enumerate(zip(leftpad, case.lens, strict=True)):
            row = int(index[b])
            k_cache[row, start:end] = draw(end - start, heads_kv, dim).to(dtype)
            v_cache[row, start:end] = draw(end - start, heads_kv, dim).to(dtype)
        if case.cache_batch:
            call["cache_batch_idx"] = index
    else:
        pages = case.capacity // case.page_size
        num_blocks = batch * pages + 3  # spare pages nobody uses
        table = torch.randperm(num_blocks)[: batch * pages].reshape(batch, pages).to(torch.int32)
        k_cache = torch.full((num_blocks, case.page_size, heads_kv, dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
        for b, n in enumerate(case.lens):
            pos = torch.arange(n)
            page, slot = table[b, pos // case.page_size].long(), pos % case.page_size
            k_cache[page, slot] = draw(n, heads_kv, dim).to(dtype)
            v_cache[page, slot] = draw(n, heads_kv, dim).to(dtype)
        call["block_table"] = table
    call.update(k_cache=k_cache, v_cache=v_cache)
    if case.seq_new:
        call["k"], call["v"] = (draw(batch, case.seq_new, heads_kv, dim).to(dtype) for _ in range(2))
    if case.leftpad is not None:
        call["cache_leftpad"] = torch.tensor(case.leftpad, dtype=torch.int32)
    if case.rotary is not None:
        rotary_dim, interleaved, table_dtype = case.rotary
        options = case.options
        per_row = options.get("is_causal") or options.get("window") is not None
        rows = case.rotary_rows or max(case.lens) + decode.rotary_span(case.seq_new, case.seq_q, per_row)
        angle = torch.rand(rows, rotary_dim // 2, dtype=torch.float64) * 2 * math.pi
        table_dtype = table_dtype or dtype
        call["rotary_cos"], call["rotary_sin"] = angle.cos().to(table_dtype), angle.sin().to(table_dtype)
        call["rotary_interleaved"] = interleaved
    if case.alibi is not None:
        shape = (heads_q,) if case.alibi == "head" else (batch, heads_q)
        call["alibi_slopes"] = torch.rand(shape) * 0.3
    on_device = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    return on_device, call


def run_reference(call, dtype):
    """reference_kvcache of the CPU inputs ``call``, every float tensor (tables and slopes too) in
    ``dtype`` for the truth (float64); as they are for the same-precision version (None)."""

    def cast(t):
        floating = isinstance(t, torch.Tensor) and t.is_floating_point()
        return t.to(dtype) if dtype is not None and floating else t

    kwargs = {n: cast(t) for n, t in call.items() if n not in ("num_splits", "return_lse")}
    q, k_cache, v_cache, seqlens = (kwargs.pop(n) for n in ("q", "k_cache", "v_cache", "cache_seqlens"))
    return reference_kvcache(q, k_cache, v_cache, seqlens, **kwargs)


def _same_or_both_nan(a, b):
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_reference_and_writes_the_caches(case, device):
    on_device, call = build(case, device)
    with expect_launches(*decode_kernels(on_device["q"], case.heads[1], case.seq_new), device=device):
        out, lse = flash_attention_with_kvcache(**on_device, return_lse=True)
    truth = run_reference(call, torch.float64)
    same = run_reference(call, None)
    dtype = case.dtype
    assert out.shape == call["q"].shape and out.dtype == dtype
    assert_error_rule("out", out, same[0], truth[0], OUTPUT_FACTOR, dtype)
    assert_error_rule("lse", lse, same[1], truth[1], OUTPUT_FACTOR, dtype)
    k_cache, v_cache = on_device["k_cache"].cpu(), on_device["v_cache"].cpu()
    # v lands as it is; k rotated in float32 and rounded once (as the same-precision reference rotates it)
    assert _same_or_both_nan(v_cache, same[3])
    if case.rotary is None:
        assert _same_or_both_nan(k_cache, same[2])
    elif dtype == F32:
        # A float32 cache holds the float32 rotation itself, x1 cos - x2 sin, whose last bit depends on the
        # order of the arithmetic: compiled code contracts it to an FMA (one rounding fewer than PyTorch's
        # multiply, then add), a few ulps apart from the reference where the two products nearly cancel (seen
        # on an H100). So the rule against the float64 rotation instead of equality, NaN where it is NaN.
        assert torch.equal(k_cache.isnan(), truth[2].isnan())
        assert_error_rule("k_cache", k_cache, same[2], truth[2], OUTPUT_FACTOR, dtype)
    else:  # 16-bit: the float32 rotation rounded once; an FMA can move that rounding by one ulp at most
        torch.testing.assert_close(k_cache, same[2], equal_nan=True, rtol=torch.finfo(dtype).eps, atol=0)


def test_rotary_positions_follow_flash_attn(device):
    """Direct check of the rotary rule, without the reference's help: the appended k holds
    rotary(k, cache_seqlens + j); a causal query i is rotated at cache_seqlens + i, a non-causal one at
    cache_seqlens: with one key and a cache empty of other keys, out = v and the LSE is the scaled q.k of
    the rotated pair, which differs between the two rules."""
    dim, lens = 16, [3, 7]
    k_cache = torch.full((2, 16, 1, dim), float("nan"))
    v_cache = k_cache.clone()
    angle = torch.rand(16, 4) * 2 * math.pi
    cos, sin = angle.cos(), angle.sin()
    q = torch.randn(2, 2, 1, dim)
    k, v = torch.randn(2, 2, 1, dim), torch.randn(2, 2, 1, dim)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    leftpad = torch.tensor(lens, dtype=torch.int32)  # the sequences' keys are the new ones only
    for causal in (False, True):
        kc, vc = k_cache.clone().to(device), v_cache.clone().to(device)
        _, lse = flash_attention_with_kvcache(
            q.to(device), kc, vc, cache_seqlens=seqlens.to(device), k=k.to(device), v=v.to(device),
            cache_leftpad=leftpad.to(device), rotary_cos=cos.to(device), rotary_sin=sin.to(device),
            rotary_interleaved=False, is_causal=causal, return_lse=True,
        )  # fmt: skip
        for b, n in enumerate(lens):
            new_pos = torch.arange(n, n + 2)
            k_ro = apply_rotary(k[b].double(), cos.double(), sin.double(), new_pos, interleaved=False)
            assert torch.allclose(kc[b, n : n + 2].cpu().double(), k_ro, atol=1e-6)
            q_pos = torch.arange(n, n + 2) if causal else torch.full((2,), n)
            q_ro = apply_rotary(q[b].double(), cos.double(), sin.double(), q_pos, interleaved=False)
            scores = torch.einsum("ihd,jhd->hij", q_ro, k_ro) / math.sqrt(dim)
            if causal:  # query i sees new keys 0..i (bottom-right: 2 queries, 2 keys)
                scores = scores.masked_fill(torch.ones(2, 2, dtype=torch.bool).triu(1), float("-inf"))
            torch.testing.assert_close(lse[b].cpu().double(), scores.logsumexp(-1), atol=1e-5, rtol=0)


def test_operator_registration_with_every_option(device):
    """The custom op with the optional inputs passes torch.library.opcheck's schema and fake-tensor tests."""
    case = Case("opcheck", F32, [5, 9], 16, (4, 2), 2, 1, head_dim=16, cache_batch=3, leftpad=[2, 0],
                rotary=(8, False, None), alibi="batch")  # fmt: skip
    on_device, _ = build(case, device)
    c = on_device
    args = (c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k"], c["v"], None, 0.25, None, None,
            None, 0, c["cache_batch_idx"], c["cache_leftpad"], c["rotary_cos"], c["rotary_sin"], False,
            c["alibi_slopes"])  # fmt: skip
    torch.library.opcheck(decode._kvcache_op, args, test_utils=("test_schema", "test_faketensor"))


def test_strided_option_tensors_give_the_contiguous_result(device):
    """Index, leftpad, tables and slopes sliced out of larger tensors (the kernels read them contiguous: the
    op copies them) give exactly the result of contiguous ones."""
    call = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in _dense_call().items()}
    wide = {
        "cache_batch_idx": torch.tensor([[2, 9], [0, 9]], dtype=I32),
        "cache_leftpad": torch.tensor([[1, 1], [0, 0]], dtype=I32),
        "rotary_cos": torch.randn(16, 6),
        "rotary_sin": torch.randn(16, 6),
        "alibi_slopes": torch.rand(4, 2),
    }
    columns = {"cache_batch_idx": 0, "cache_leftpad": 0, "rotary_cos": slice(1, 5), "rotary_sin": slice(1, 5),
               "alibi_slopes": 1}  # fmt: skip
    # sliced on the device: .to(device) of a strided CPU view makes a contiguous copy
    strided = {n: t.to(device)[:, columns[n]] for n, t in wide.items()}
    assert not any(t.is_contiguous() for t in strided.values())
    results = []
    for options in (strided, {n: t.contiguous() for n, t in strided.items()}):
        kc, vc = call["k_cache"].clone(), call["v_cache"].clone()
        rest = {n: t for n, t in call.items() if n not in ("q", "k_cache", "v_cache", *options)}
        results.append((*flash_attention_with_kvcache(call["q"], kc, vc, **rest, **options, return_lse=True),
                        kc, vc))  # fmt: skip
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


# --- bad input: a clear error naming the argument, before any write -----------------------------------------


def _dense_call():
    """A valid dense call with every option (2 sequences, 3 cache rows of 16 slots, head_dim 16, GQA 4/2)."""
    dim = 16
    k_cache = torch.randn(3, 16, 2, dim)
    return dict(
        q=torch.randn(2, 1, 4, dim), k_cache=k_cache, v_cache=torch.randn_like(k_cache),
        cache_seqlens=torch.tensor([3, 5], dtype=torch.int32), k=torch.randn(2, 1, 2, dim),
        v=torch.randn(2, 1, 2, dim), cache_batch_idx=torch.tensor([2, 0], dtype=torch.int32),
        cache_leftpad=torch.tensor([1, 0], dtype=torch.int32), rotary_cos=torch.randn(16, 4),
        rotary_sin=torch.randn(16, 4), alibi_slopes=torch.rand(4),
    )  # fmt: skip


I32 = torch.int32
BAD = [
    ({"cache_batch_idx": torch.tensor([2, 0])}, TypeError, "cache_batch_idx must be int32"),
    ({"cache_batch_idx": [2, 0]}, TypeError, "cache_batch_idx must be a torch.Tensor"),
    ({"cache_batch_idx": torch.tensor([2], dtype=I32)}, ValueError, r"cache_batch_idx must be \[batch=2\]"),
    ({"cache_batch_idx": torch.tensor([3, 0], dtype=I32)}, ValueError, r"cache_batch_idx\[0\] = 3 is not a"),
    ({"cache_batch_idx": torch.tensor([0, -1], dtype=I32)}, ValueError, r"cache_batch_idx\[1\] = -1"),
    ({"cache_batch_idx": torch.tensor([1, 1], dtype=I32)}, ValueError, "names one cache row twice"),
    ({"cache_batch_idx": None}, ValueError, r"k_cache batch \(3\) must equal q batch \(2\)"),
    ({"cache_leftpad": torch.tensor([4, 0], dtype=I32)}, ValueError,
     r"cache_leftpad\[0\] = 4 must be in \[0, cache_seqlens\[0\] = 3\]"),
    ({"cache_leftpad": torch.tensor([0, -2], dtype=I32)}, ValueError, r"cache_leftpad\[1\] = -2"),
    ({"cache_leftpad": torch.tensor([1.0, 0.0])}, TypeError, "cache_leftpad must be int32"),
    ({"block_table": torch.tensor([[2], [0]], dtype=I32), "cache_leftpad": None}, ValueError,
     "cache_batch_idx cannot be used with block_table"),
    ({"block_table": torch.tensor([[2], [0]], dtype=I32), "cache_batch_idx": None}, ValueError,
     "cache_leftpad cannot be used with block_table"),
    ({"rotary_sin": None}, ValueError, "rotary_cos and rotary_sin must be given together"),
    ({"rotary_cos": torch.randn(16, 4, dtype=torch.float64)}, TypeError, "rotary_cos has dtype"),
    ({"rotary_sin": torch.randn(16, 4).half()}, TypeError, r"rotary_sin has dtype torch.float16; accepted"),
    ({"rotary_sin": torch.randn(16, 2)}, ValueError, "rotary_sin .* must have rotary_cos's shape"),
    ({"rotary_cos": torch.randn(16, 9), "rotary_sin": torch.randn(16, 9)}, ValueError,
     r"rotary_dim = 18; accepted: rotary_dim from 2 to head_dim \(16\)"),
    ({"rotary_cos": torch.randn(16, 4, 1), "rotary_sin": torch.randn(16, 4, 1)}, ValueError,
     "rotary_cos must have 2 dims"),
    ({"rotary_cos": torch.randn(0, 4), "rotary_sin": torch.randn(0, 4)}, ValueError, "at least one row"),
    ({"k": None, "v": None}, ValueError, "rotary_cos/rotary_sin need new keys k and v"),
    ({"rotary_cos": torch.randn(5, 4), "rotary_sin": torch.randn(5, 4)}, ValueError,
     r"have 5 rows \(positions\) but the call rotates positions up to 5"),
    ({"rotary_interleaved": 1}, TypeError, "rotary_interleaved must be a bool"),
    ({"alibi_slopes": torch.rand(4).half()}, TypeError, "alibi_slopes has dtype"),
    ({"alibi_slopes": torch.rand(2)}, ValueError, r"alibi_slopes must be \[heads_q=4\] or \[batch=2"),
    ({"alibi_slopes": torch.rand(3, 4)}, ValueError, "alibi_slopes must be"),
    ({"causal": True}, TypeError, "unexpected keyword argument 'causal': did you mean is_causal="),
    ({"softmax_scale": 0.5}, TypeError, "did you mean scale="),
    ({"window_size": (-1, -1)}, TypeError, r"did you mean window=\(left, right\)"),
    ({"return_softmax_lse": True}, TypeError, "did you mean return_lse="),
]  # fmt: skip


BAD_IDS = [f"{next(iter(change))}-{i}" for i, (change, _, _) in enumerate(BAD)]


@pytest.mark.parametrize("change, error, match", BAD, ids=BAD_IDS)
def test_bad_options_are_refused_before_any_write(change, error, match):
    call = _dense_call()
    call.update(change)
    k_cache, v_cache = call["k_cache"], call["v_cache"]
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(error, match=match):
        flash_attention_with_kvcache(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), **call)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@pytest.mark.parametrize("head_dim", [0, 257])
def test_head_dim_outside_1_to_256_is_refused(head_dim):
    k_cache = torch.randn(1, 16, 1, head_dim)
    with pytest.raises(ValueError, match="q head_dim is .*; accepted: any head_dim from 1 to 256"):
        flash_attention_with_kvcache(torch.randn(1, 1, 1, head_dim), k_cache, k_cache, cache_seqlens=1)


def test_boundaries_accepted(device):
    """Right at the limits: rotary tables exactly as long as the positions used, rotary_dim = head_dim,
    leftpad = cache_seqlens (only the new keys), the last cache row, head_dim 256."""
    call = _dense_call()
    call["rotary_cos"], call["rotary_sin"] = torch.randn(6, 8), torch.randn(6, 8)  # positions up to 5 + 1 - 1
    call["cache_leftpad"] = torch.tensor([3, 5], dtype=I32)
    call["cache_batch_idx"] = torch.tensor([2, 1], dtype=I32)
    call = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in call.items()}
    out = flash_attention_with_kvcache(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), **call)
    assert torch.isfinite(out).all()
    k_cache = torch.randn(1, 16, 1, 256, device=device)
    out = flash_attention_with_kvcache(torch.randn(1, 1, 2, 256, device=device), k_cache, k_cache,
                                       cache_seqlens=5)  # fmt: skip
    assert torch.isfinite(out).all()


def test_int_cache_seqlens_is_checked_against_the_rotary_tables_on_the_host(monkeypatch):
    """An int is already on the host: checked whatever CHECK_INPUTS says."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = _dense_call()
    call["cache_seqlens"] = 15  # 15 + 1 new = 16 slots: fits the cache, not 8 rows of angles
    call["rotary_cos"], call["rotary_sin"] = torch.randn(8, 4), torch.randn(8, 4)
    with pytest.raises(ValueError, match="have 8 rows"):
        flash_attention_with_kvcache(call.pop("q"), call.pop("k_cache"), call.pop("v_cache"), **call)


# --- value checks off (the CUDA default): invalid entries give NaN rows, touch nothing --------------------


def _finite_outputs(monkeypatch):
    """Outputs start finite (7.0), so a NaN row must have been written by the kernel."""
    from llm_speed.core import tensors

    monkeypatch.setattr(
        tensors, "new_output", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype, device=device)
    )


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-split", "split"])
def test_unchecked_bad_batch_index_leftpad_and_rotary_give_nan_rows_and_no_cache_access(
    num_splits, device, monkeypatch
):
    """cache_batch_idx outside the cache, a leftpad past cache_seqlens or negative, positions past the rotary
    tables: those sequences' rows and LSE NaN, nothing of theirs appended, no cache row read or written on
    their behalf; the others exactly as in a valid call of the same shapes."""
    capacity, dim, seq_new = 160, 16, 2
    lens = [7, 5, 6, 8, 3, 150, 2]
    valid = dict(idx=[3, 1, 0, 5, 2, 4, 6], leftpad=[0, 0, 2, 0, 1, 7, 0])
    broken = dict(idx=[3, -1, 0, 7, 2, 4, 6], leftpad=[0, 0, 9, 0, 1, 7, -1])
    # sequence 5: positions up to 150 + 2 - 1 = 151, the tables end at 150 (a table row short)
    bad = [1, 2, 3, 5, 6]
    k_cache = torch.randn(7, capacity, 2, dim, device=device)
    v_cache = torch.randn_like(k_cache)
    angle = torch.rand(152, 4) * 2 * math.pi
    q = torch.randn(7, 2, 4, dim, device=device)
    k_new, v_new = (torch.randn(7, seq_new, 2, dim, device=device) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=I32, device=device)
    slopes = torch.rand(4, device=device)

    def call(kc, vc, idx, leftpad, rows):
        return flash_attention_with_kvcache(
            q, kc, vc, cache_seqlens=seqlens, k=k_new, v=v_new, cache_batch_idx=torch.tensor(idx, dtype=I32,
            device=device), cache_leftpad=torch.tensor(leftpad, dtype=I32, device=device),
            rotary_cos=angle.cos()[:rows].to(device), rotary_sin=angle.sin()[:rows].to(device),
            alibi_slopes=slopes, is_causal=True, num_splits=num_splits, return_lse=True,
        )  # fmt: skip

    truth, truth_lse = call(k_cache.clone(), v_cache.clone(), valid["idx"], valid["leftpad"], 152)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    _finite_outputs(monkeypatch)
    with expect_launches(*decode_kernels(q, 2, seq_new, num_splits > 1), device=device, only=True):
        out, lse = call(k_cache, v_cache, broken["idx"], broken["leftpad"], 151)
    for b in range(7):
        if b in bad:
            assert out[b].isnan().all() and lse[b].isnan().all(), b
        else:
            assert torch.equal(out[b], truth[b]) and torch.equal(lse[b], truth_lse[b]), b
    # Only the good sequences' new slots changed, in the rows they name.
    for cache, before in ((k_cache, before_k), (v_cache, before_v)):
        changed = (cache != before).any(dim=(2, 3)).cpu()  # [rows, capacity]
        expected = torch.zeros_like(changed)
        for b in range(7):
            if b not in bad:
                expected[broken["idx"][b], lens[b] : lens[b] + seq_new] = True
        assert torch.equal(changed, expected)


# --- per-call host work: plans from shapes only, no host read of device data ------------------------------

def test_plans_depend_on_shapes_and_options_only_and_nothing_is_read(monkeypatch, policy):
    """On the CUDA code path (simulated, launches stubbed, checks off): calls that differ only in the values
    of cache_seqlens, cache_batch_idx, cache_leftpad, the tables and the slopes share one plan; a change of
    option (interleaving, slopes per batch, rotary_dim, an option left out, causal) is a new plan; no tensor
    value is read on the host (the new tokens written by the attention kernel)."""
    from llm_speed.core import launch

    policy(decode_append_in_attention=True)

    call = _dense_call()
    q, k_cache, v_cache = call.pop("q"), call.pop("k_cache"), call.pop("v_cache")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    variants = [
        {},
        {"cache_seqlens": torch.tensor([9, 0], dtype=I32), "cache_batch_idx": torch.tensor([1, 2], dtype=I32),
         "cache_leftpad": torch.tensor([9, 0], dtype=I32), "alibi_slopes": torch.rand(4),
         "rotary_cos": torch.randn(16, 4), "rotary_sin": torch.randn(16, 4)},
        {"rotary_interleaved": False},
        {"alibi_slopes": torch.rand(2, 4)},
        {"rotary_cos": torch.randn(16, 3), "rotary_sin": torch.randn(16, 3)},
        {"cache_leftpad": None},
        {"is_causal": True},
    ]  # fmt: skip
    with launch.simulated_gpu():
        before = runtime.launch_counts()
        with host_reads_raise(monkeypatch):
            for change in variants:
                flash_attention_with_kvcache(q, k_cache, v_cache, **{**call, **change})
        ran = runtime.launch_counts() - before
        info = decode_launch.step_plans.cache_info()
    assert (info.misses, info.hits) == (6, 1)
    assert ran == {decode.KERNEL_DECODE: 7}  # (the attention kernel appends the new tokens)
