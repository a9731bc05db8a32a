"""flash_attention_with_kvcache: dense and paged caches, appends, split-KV, window/softcap, GQA, bad input.

Each case builds every sequence's keys/values logically, scatters them into a dense or a paged cache (pages
shuffled, unused slots NaN so a read past the valid tokens shows), and compares with the float64 reference
of the gathered dense sequence under the 2x rule of TESTING.md.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from attention_testing import OUTPUT_FACTOR, assert_error_rule, expect_launches, repeat_decode_step

from accuracy_rule import nan_poisoned_outputs
from call_records import record_calls
from host_reads import host_reads_raise
from llm_speed.attention import decode, decode_launch
from llm_speed.attention.decode import flash_attention_with_kvcache
from llm_speed.attention.reference import reference_attention
from llm_speed.core import launch, runtime
from llm_speed.core.gpus import get_gpu
from llm_speed.core.hardware import Hardware, hardware_of
from llm_speed.core.policy import use_policy
from triton_builds import GPU_BUILD_ENV, environment


@pytest.fixture(autouse=True)
def _poison_decode_outputs(monkeypatch):
    nan_poisoned_outputs(monkeypatch)


def make_cache(lens, capacity, heads_kv, dim, dtype, device, page_size=None, draw=torch.randn):
    """(k_cache, v_cache, block_table or None, logical k, logical v): logical [batch, capacity, heads, D] with
    the first lens[b] tokens valid; the physical cache holds them (pages shuffled) and NaN everywhere else."""
    batch = len(lens)
    k_log = draw(batch, capacity, heads_kv, dim).to(dtype)
    v_log = draw(batch, capacity, heads_kv, dim).to(dtype)
    if page_size is None:
        k_cache = torch.full_like(k_log, float("nan"))
        v_cache = torch.full_like(v_log, float("nan"))
        for b, n in enumerate(lens):
            k_cache[b, :n], v_cache[b, :n] = k_log[b, :n], v_log[b, :n]
        return k_cache.to(device), v_cache.to(device), None, k_log, v_log
    pages = capacity // page_size
    num_blocks = batch * pages + 3  # spare pages nobody uses
    table = torch.randperm(num_blocks)[: batch * pages].reshape(batch, pages).to(torch.int32)
    k_cache = torch.full((num_blocks, page_size, heads_kv, dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, n in enumerate(lens):
        for pos in range(n):
            page, slot = int(table[b, pos // page_size]), pos % page_size
            k_cache[page, slot], v_cache[page, slot] = k_log[b, pos], v_log[b, pos]
    return k_cache.to(device), v_cache.to(device), table.to(device), k_log, v_log


def gather(cache, table, b, length):
    """Sequence b's first ``length`` tokens from a dense or paged cache, [length, heads, D] on the CPU."""
    cache = cache.cpu()
    if table is None:
        return cache[b, :length]
    page_size = cache.shape[1]
    pos = torch.arange(length)
    return cache[table.cpu()[b, pos // page_size].long(), pos % page_size]


def reference(q, keys, values, b, dtype, **kwargs):
    """reference_attention of sequence b in ``dtype``: q [seq_q, heads, D] -> ([seq_q, heads, D], lse)."""
    to_bhsd = lambda t: t.cpu().to(dtype).transpose(0, 1)[None]  # noqa: E731
    out, lse = reference_attention(to_bhsd(q[b]), to_bhsd(keys), to_bhsd(values), return_lse=True, **kwargs)
    return out[0].transpose(0, 1), lse[0]


CASES = [
    # (name, dtype, lens, capacity, heads_q, heads_kv, seq_q, seq_new, page_size, head_dim, options)
    ("dense-decode-mha", torch.float32, [5, 0, 70], 96, 2, 2, 1, 1, None, 32, {}),
    ("dense-gqa-append3-causal", torch.float16, [1, 40, 17], 64, 4, 2, 3, 3, None, 32, {"is_causal": True}),
    ("paged16-gqa-causal", torch.bfloat16, [33, 0, 50], 64, 8, 2, 2, 2, 16, 32, {"is_causal": True}),
    ("paged256-mqa", torch.float32, [300, 7], 512, 4, 1, 1, 1, 256, 32, {}),
    ("paged16-window-softcap", torch.float32, [45, 20], 64, 2, 1, 4, 0, 16, 32,
     {"is_causal": True, "window": (9, None), "softcap": 2.0}),
    ("dense-window-both-sides", torch.float16, [30, 64], 80, 2, 2, 3, 1, None, 32, {"window": (5, 1)}),
    ("dense-window-zero-head-dim-40", torch.float32, [20, 3], 32, 2, 2, 2, 1, None, 40, {"window": (0, 0)}),
    ("paged48-window-past-context-head-dim-72", torch.float16, [50, 9], 96, 4, 2, 1, 2, 48, 72,
     {"is_causal": True, "window": (1000, 7)}),
    ("paged16-bf16-positive-inputs", torch.bfloat16, [40, 25], 64, 4, 2, 1, 1, 16, 64, {"positive": True}),
    ("dense-causal-more-queries-than-keys", torch.float32, [0, 2], 16, 2, 2, 5, 1, None, 32,
     {"is_causal": True}),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_reference_and_appends_in_place(case, device):
    _, dtype, lens, capacity, heads_q, heads_kv, seq_q, seq_new, page_size, dim, options = case
    options = dict(options)
    # Positive inputs: where rounding biased low (truncating bf16 casts) would show, per TESTING.md.
    draw = torch.rand if options.pop("positive", False) else torch.randn
    k_cache, v_cache, table, k_log, v_log = make_cache(
        lens, capacity, heads_kv, dim, dtype, device, page_size, draw
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    batch = len(lens)
    q = draw(batch, seq_q, heads_q, dim).to(dtype)
    if options.get("softcap"):
        q = q * 4  # logits well past the cap
    k_new = draw(batch, seq_new, heads_kv, dim).to(dtype)
    v_new = draw(batch, seq_new, heads_kv, dim).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    new = dict(k=k_new.to(device), v=v_new.to(device)) if seq_new else {}
    with expect_launches(decode.KERNEL_DECODE, device=device):
        out, lse = flash_attention_with_kvcache(
            q.to(device), k_cache, v_cache, cache_seqlens=seqlens.to(device), block_table=table,
            return_lse=True, **new, **options,
        )  # fmt: skip
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (batch, heads_q, seq_q)

    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lens):
        length = n + seq_new
        keys, values = gather(k_cache, table, b, length), gather(v_cache, table, b, length)
        # The cache now holds the old tokens and the new ones right after them.
        assert torch.equal(keys, torch.cat([k_log[b, :n], k_new[b]]))
        assert torch.equal(values, torch.cat([v_log[b, :n], v_new[b]]))
        for pos in range(n, length):
            page_size_or_cap = page_size or capacity
            row = int(table[b, pos // page_size]) if table is not None else b
            written[row, pos % page_size_or_cap] = True
        truth = reference(q, keys, values, b, torch.float64, **options)
        same = reference(q, keys, values, b, dtype, **options)
        assert_error_rule("out", out[b], same[0], truth[0], OUTPUT_FACTOR, dtype)
        assert_error_rule("lse", lse[b], same[1], truth[1], OUTPUT_FACTOR, dtype)
    # Nothing but the appended slots changed (NaN == NaN counts as unchanged).
    for cache, old in ((k_cache, before_k), (v_cache, before_v)):
        same_slot = (cache.cpu() == old.cpu()) | (cache.cpu().isnan() & old.cpu().isnan())
        assert same_slot.all(dim=(2, 3))[~written].all()


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_split_counts_agree(paged, device):
    """One split, several, and the automatic choice give the same result (up to float32 reassociation)."""
    lens = [150, 37]
    k_cache, v_cache, table, _, _ = make_cache(lens, 192, 2, 64, torch.float32, device, 16 if paged else None)
    q = torch.randn(2, 1, 4, 64, device=device)
    kwargs = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), block_table=table)
    results = []
    for num_splits in (1, 3, 0, 1000):  # 1000: more than key blocks, capped
        launched = [decode.KERNEL_COMBINE] if num_splits != 1 else []
        with expect_launches(decode.KERNEL_DECODE, *launched, device=device):
            results.append(flash_attention_with_kvcache(q, k_cache, v_cache, num_splits=num_splits,
                                                        return_lse=True, **kwargs))  # fmt: skip
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], atol=2e-6, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=2e-6, rtol=0)


def test_empty_cache_gives_zero_and_minus_inf(device):
    k_cache = torch.full((2, 32, 1, 16), float("nan"), device=device)
    q = torch.randn(2, 3, 2, 16, device=device)
    for num_splits in (0, 1):
        out, lse = flash_attention_with_kvcache(
            q, k_cache, k_cache.clone(), cache_seqlens=0, num_splits=num_splits, return_lse=True
        )
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.equal(lse, torch.full_like(lse, float("-inf")))


def test_choose_num_splits():
    assert decode.choose_num_splits(programs=264, key_blocks=100, slots=264) == 1  # the slots are full
    assert decode.choose_num_splits(programs=8, key_blocks=1, slots=264) == 1  # one key block: no split
    assert decode.choose_num_splits(programs=8, key_blocks=3, slots=264) == 3  # at most one split per block
    splits = decode.choose_num_splits(programs=8, key_blocks=512, slots=264)
    assert 0.8 * 264 <= 8 * splits <= 2 * 264  # about one full wave of programs


@pytest.mark.parametrize(
    "batch, context, splits",
    [(1, 1024, 16), (8, 16384, 4), (16, 16384, 2), (32, 4096, 1), (128, 1024, 1)],
)
def test_default_splits_fill_two_programs_per_sm(batch, context, splits):
    """On an H100 (132 SMs) the 4-warp kernel's default split count fills two programs per SM, as flash-attn
    counts (``set_params_splitkv``): 8 x 16k tokens (64 programs of 8 KV heads) gets 4 splits, 256 programs
    (one SM read 2.27 TB/s with one program on 2026-11-25, 3.06 with two); 32 sequences need none; a short
    cache is split at most once per key block."""
    hardware = Hardware.from_spec("h100-sxm")
    cfg = decode.kernel_config(128, torch.float16, 4, context, batch * 8, hardware)
    assert cfg.num_warps == 4 and cfg.splits == splits
    assert batch * 8 * cfg.splits >= min(0.8 * 2 * 132, batch * 8 * -(-context // cfg.block_n))


def _good_call(device="cpu"):
    """A valid call; input checks are tested on the CPU, calls that run go to ``device``."""
    batch, heads_kv, dim = 2, 2, 16
    k_cache = torch.randn(4, 16, heads_kv, dim)
    call = dict(
        q=torch.randn(batch, 1, 4, dim), k_cache=k_cache, v_cache=torch.randn_like(k_cache),
        cache_seqlens=torch.tensor([3, 3], dtype=torch.int32), k=torch.randn(batch, 2, heads_kv, dim),
        v=torch.randn(batch, 2, heads_kv, dim), block_table=torch.tensor([[2], [0]], dtype=torch.int32),
    )  # fmt: skip
    return {name: t.to(device) for name, t in call.items()}


BAD = [
    ("q", torch.randn(2, 4, 16), ValueError, "q must have 4 dims"),
    ("q", torch.randn(2, 1, 4, 16, dtype=torch.float64), TypeError, "q has dtype"),
    ("q", torch.randn(2, 1, 3, 16), ValueError, "multiple of k_cache heads"),
    ("v_cache", torch.randn(4, 16, 2, 16).half(), TypeError, "v_cache dtype"),
    ("v_cache", torch.randn(4, 32, 2, 16), ValueError, "one shape"),
    ("k", torch.randn(2, 2, 1, 16), ValueError, "k must be"),
    ("v", None, ValueError, "k and v must be given together"),
    ("cache_seqlens", torch.tensor([3, 14], dtype=torch.int64), TypeError, "int32"),
    ("cache_seqlens", torch.tensor([3], dtype=torch.int32), ValueError, r"\[batch=2\]"),
    ("cache_seqlens", torch.tensor([-1, 3], dtype=torch.int32), ValueError, ">= 0"),
    ("cache_seqlens", torch.tensor([3, 15], dtype=torch.int32), ValueError, "cache too small"),
    ("cache_seqlens", 2.0, TypeError, "cache_seqlens must be an int"),
    ("block_table", torch.tensor([[2], [0]], dtype=torch.int64), TypeError, "block_table must be int32"),
    ("block_table", torch.tensor([[2], [4]], dtype=torch.int32), ValueError, r"block_table\[1, 0\] = 4"),
    ("block_table", torch.tensor([[-1], [0]], dtype=torch.int32), ValueError, "not a page"),
    ("block_table", torch.tensor([[0], [0]], dtype=torch.int32), ValueError, "same cache slot"),
    ("block_table", torch.tensor([2, 0], dtype=torch.int32), ValueError, "block_table must be"),
    ("is_causal", 1, TypeError, "is_causal must be a bool"),
    ("return_lse", "yes", TypeError, "return_lse must be a bool"),
    ("num_splits", -1, ValueError, "num_splits must be an int >= 0"),
    ("window", (1, -2), ValueError, "window right"),
    ("softcap", 0.0, ValueError, "softcap"),
    ("scale", float("nan"), ValueError, "scale must be finite"),
]


@pytest.mark.parametrize("name, value, error, match", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_input_is_refused_before_any_write(name, value, error, match):
    call = _good_call()
    call[name] = value
    k_cache, v_cache = call["k_cache"], call["v_cache"]
    before = k_cache.clone(), v_cache.clone()
    q = call.pop("q")
    with pytest.raises(error, match=match):
        flash_attention_with_kvcache(q, call.pop("k_cache"), call.pop("v_cache"), **call)
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def test_boundaries_accepted(device):
    """Right at the limits: a cache filled exactly, page 0 and the last page, numpy bools."""
    import numpy as np

    call = _good_call(device)
    call["cache_seqlens"] = torch.tensor([14, 14], dtype=torch.int32, device=device)  # 14 + 2 new = 16
    call["block_table"] = torch.tensor([[0], [3]], dtype=torch.int32, device=device)
    q = call.pop("q")
    out = flash_attention_with_kvcache(
        q, call.pop("k_cache"), call.pop("v_cache"), is_causal=np.bool_(True), **call
    )
    assert torch.isfinite(out).all()


def test_operator_registration(device):
    """The custom op (caches declared mutated) passes torch.library.opcheck."""
    call = _good_call(device)
    args = (call["q"], call["k_cache"], call["v_cache"], call["cache_seqlens"], call["k"], call["v"],
            call["block_table"], 0.25, None, 0, None, 0)  # fmt: skip
    torch.library.opcheck(decode._kvcache_op, args, test_utils=("test_schema", "test_faketensor"))


def test_strided_views_are_read_and_written_in_place(device):
    """q viewed from [B, H, S, D]; caches sliced out of one packed KV buffer (the append lands in it)."""
    batch, heads_kv, dim, lens = 2, 2, 32, [6, 11]
    packed = torch.randn(batch, 16, 2, heads_kv, dim, device=device)
    k_cache, v_cache = packed[:, :, 0], packed[:, :, 1]
    q = torch.randn(batch, 4, 1, dim, device=device).transpose(1, 2)  # [B, 1, H, D], not contiguous
    k_new, v_new = (torch.randn(batch, 1, heads_kv, dim, device=device) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens, k=k_new, v=v_new)
    for b, n in enumerate(lens):
        assert torch.equal(packed[b, n, 0], k_new[b, 0]) and torch.equal(packed[b, n, 1], v_new[b, 0])
        truth, _ = reference(q, packed[b, : n + 1, 0], packed[b, : n + 1, 1], b, torch.float64)
        same, _ = reference(q, packed[b, : n + 1, 0], packed[b, : n + 1, 1], b, torch.float32)
        assert_error_rule("out", out[b], same, truth, OUTPUT_FACTOR, torch.float32)


def test_zero_batch_and_zero_queries(device):
    """batch 0 gives empty results; seq_q 0 still appends the new tokens and returns an empty output."""
    k_cache = torch.zeros(1, 16, 1, 16, device=device)
    empty = flash_attention_with_kvcache(
        torch.randn(0, 1, 2, 16, device=device), k_cache[:0], k_cache[:0], cache_seqlens=0
    )
    assert empty.shape == (0, 1, 2, 16)
    v_cache = torch.zeros_like(k_cache)
    k_new, v_new = torch.ones(1, 2, 1, 16, device=device), torch.full((1, 2, 1, 16), 2.0, device=device)
    out, lse = flash_attention_with_kvcache(
        torch.randn(1, 0, 2, 16, device=device), k_cache, v_cache, cache_seqlens=3, k=k_new, v=v_new,
        return_lse=True,
    )  # fmt: skip
    assert out.shape == (1, 0, 2, 16) and lse.shape == (1, 2, 0)
    assert torch.equal(k_cache[0, 3:5], k_new[0]) and torch.equal(v_cache[0, 3:5], v_new[0])
    assert k_cache[0, :3].eq(0).all() and k_cache[0, 5:].eq(0).all()


def test_profiler_counts_the_visible_cache_of_each_sequence(device):
    """The op table's cost of a decode call is the model's cost summed over the ragged sequences."""
    from llm_speed import ops
    from llm_speed.ops import _kvcache_probe as kvcache_probe
    from llm_speed.perf.kernel_costs import kvcache_decode_cost
    from llm_speed.profiler import CUDAProfiler

    profiler = CUDAProfiler(device)
    with profiler.profile("decode"):
        kvcache_probe(device)
    metrics = profiler.get_metrics()
    # the probe: 40 and 25 cached tokens, one appended; 4 query / 2 KV heads of 32, fp16 on a GPU
    dtype = "fp16" if device.type == "cuda" else "fp32"
    costs = [kvcache_decode_cost(1, 4, 1, n, 32, heads_kv=2, dtype=dtype, seq_new=1) for n in (41, 26)]
    assert metrics.flops == pytest.approx(sum(c.flops for c in costs))
    assert metrics.bytes_moved == pytest.approx(sum(c.bytes_moved for c in costs))
    assert ops.get("attention_kvcache_fwd").probe is not None


# --- value checks off (the CUDA default): invalid entries give NaN rows, touch nothing --------------------


def _finite_outputs(monkeypatch):
    """Outputs start finite (7.0), so a NaN row must have been written by the kernel."""
    from llm_speed.core import tensors

    monkeypatch.setattr(
        tensors, "new_output", lambda shape, dtype, device: torch.full(shape, 7.0, dtype=dtype, device=device)
    )


def _expected_cache(before, new, table, lens, capacity, valid_page):
    """``before`` with new tokens ``new`` [B, S_new, H, D] written where the kernel promises: sequences with
    0 <= lens[b] <= capacity - seq_new, slots whose page is inside the pool."""
    expected = before.clone()
    seq_new = new.shape[1]
    for b, n in enumerate(lens):
        if not 0 <= n <= capacity - seq_new:
            continue
        for j in range(seq_new):
            pos = n + j
            if table is None:
                expected[b, pos] = new[b, j]
                continue
            page = int(table[b, pos // before.shape[1]])
            if valid_page(page):
                expected[page, pos % before.shape[1]] = new[b, j]
    return expected


def _same_or_both_nan(a, b):
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("paged, num_splits", [(False, 1), (True, 3)], ids=["dense-one-split", "paged-split"])
def test_unchecked_bad_cache_seqlens_give_nan_rows_and_no_cache_access(
    paged, num_splits, device, monkeypatch, policy
):
    """cache_seqlens < 0 or past the capacity: those sequences' rows and LSE NaN, their slots untouched; the
    others exactly as in a valid call of the same shapes (the new tokens written by the attention kernel)."""
    policy(decode_append_in_attention=True)
    capacity, seq_new, heads_kv, dim = 192, 2, 2, 32
    good = [7, 60, 0, 190, 100]
    lens = [-3, 60, 191, 190, -(2**31)]  # 191 + 2 > 192; 190 + 2 = 192 fits exactly
    k_cache, v_cache, table, _, _ = make_cache(good, capacity, heads_kv, dim, torch.float32, device,
                                               16 if paged else None)  # fmt: skip
    q = torch.randn(5, 1, 4, dim, device=device)
    k_new, v_new = (torch.randn(5, seq_new, heads_kv, dim, device=device) for _ in range(2))
    kwargs = dict(k=k_new, v=v_new, block_table=table, num_splits=num_splits, return_lse=True)
    clone_k, clone_v = k_cache.clone(), v_cache.clone()
    truth, truth_lse = flash_attention_with_kvcache(
        q, clone_k, clone_v, cache_seqlens=torch.tensor(good, dtype=torch.int32, device=device), **kwargs
    )
    before_k, before_v = k_cache.clone(), v_cache.clone()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    _finite_outputs(monkeypatch)
    launched = [decode.KERNEL_DECODE] + [decode.KERNEL_COMBINE] * (num_splits > 1)  # (appending too)
    with expect_launches(*launched, device=device, only=True):
        out, lse = flash_attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device), **kwargs
        )
    for b in (0, 2, 4):
        assert out[b].isnan().all() and lse[b].isnan().all(), b
    for b in (1, 3):
        assert torch.equal(out[b], truth[b]) and torch.equal(lse[b], truth_lse[b]), b
    in_pool = lambda page: 0 <= page < k_cache.shape[0]  # noqa: E731
    for cache, before, new in ((k_cache, before_k, k_new), (v_cache, before_v, v_new)):
        expected = _expected_cache(before.cpu(), new.cpu(), table, lens, capacity, in_pool)
        assert _same_or_both_nan(cache.cpu(), expected)


@pytest.mark.parametrize(
    "num_splits, options", [(3, {}), (1, {"is_causal": True, "window": (4, None)})],
    ids=["split", "window-away-from-bad-pages"],
)  # fmt: skip
def test_unchecked_bad_block_table_entries_give_nan_rows_and_read_no_such_page(
    num_splits, options, device, monkeypatch
):
    """A page in use outside the pool: the sequence's rows and LSE NaN, that page never read or written (its
    other new tokens are appended); entries of pages not in use are never looked at."""
    capacity, page_size, seq_new, heads_kv, dim = 192, 16, 2, 2, 32
    lens = [100, 40, 40, 40, 70]  # pages in use: 7, 3, 3, 3, 5 (the appended tokens on the last of them)
    k_cache, v_cache, table, _, _ = make_cache(lens, capacity, heads_kv, dim, torch.float32, device,
                                               page_size)  # fmt: skip
    num_blocks = k_cache.shape[0]
    bad_table = table.clone()
    bad_table[0, 5] = -5  # an old token's page, in the second split
    bad_table[1, 2] = num_blocks  # the page the new tokens go to
    bad_table[2, 11] = -1  # not in use: sequence 2 is valid
    bad_table[4, 1] = 2**31 - 1  # an old token's page, first split
    q = torch.randn(5, 1, 4, dim, device=device)
    k_new, v_new = (torch.randn(5, seq_new, heads_kv, dim, device=device) for _ in range(2))
    seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kwargs = dict(cache_seqlens=seqlens, k=k_new, v=v_new, num_splits=num_splits, return_lse=True, **options)
    truth, truth_lse = flash_attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), block_table=table,
                                                    **kwargs)  # fmt: skip
    # NaN pages: a read of a page the kernel should skip would show (a bad entry itself cannot be read).
    before_k, before_v = k_cache.clone(), v_cache.clone()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    _finite_outputs(monkeypatch)
    out, lse = flash_attention_with_kvcache(q, k_cache, v_cache, block_table=bad_table.to(device), **kwargs)
    for b in (0, 1, 4):
        assert out[b].isnan().all() and lse[b].isnan().all(), b
    for b in (2, 3):
        assert torch.equal(out[b], truth[b]) and torch.equal(lse[b], truth_lse[b]), b
    in_pool = lambda page: 0 <= page < num_blocks  # noqa: E731
    for cache, before, new in ((k_cache, before_k, k_new), (v_cache, before_v, v_new)):
        expected = _expected_cache(before.cpu(), new.cpu(), bad_table, lens, capacity, in_pool)
        assert _same_or_both_nan(cache.cpu(), expected)


def test_unchecked_int_cache_seqlens_is_still_checked_on_the_host(monkeypatch):
    """An int is already on the host: checked whatever CHECK_INPUTS says (and filled without a read)."""
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = _good_call()
    q, k_cache, v_cache = call.pop("q"), call.pop("k_cache"), call.pop("v_cache")
    call["cache_seqlens"] = 15  # 15 + 2 new > 16
    with pytest.raises(ValueError, match="cache too small"):
        flash_attention_with_kvcache(q, k_cache, v_cache, **call)
    call["cache_seqlens"] = -1
    with pytest.raises(ValueError, match="cache_seqlens must be an int >= 0"):
        flash_attention_with_kvcache(q, k_cache, v_cache, **call)


# --- the new tokens written by the attention kernel (one launch) or by the append kernel -----------------

E4M3 = torch.float8_e4m3fn
# (name, q dtype, cache dtype, page size, (heads_q, heads_kv), seq_q, seq_new, lens, num_splits, options):
# splits of 64 keys over 192 (three), the new tokens of some sequences crossing from one split into the next.
APPENDS = [
    ("dense-across-splits", torch.float16, torch.float16, None, (8, 2), 1, 3, [62, 0, 127], 3, {}),
    ("paged-across-splits-causal", torch.bfloat16, torch.bfloat16, 16, (4, 4), 2, 2, [63, 10, 126], 3,
     {"is_causal": True}),
    ("rotary-batch-index-one-split", torch.float16, torch.float16, None, (4, 2), 1, 2, [5, 64, 30], 1,
     {"rotary": True, "batch_index": True}),
    ("fp8-paged-rotary-across-splits", torch.bfloat16, E4M3, 16, (8, 2), 1, 4, [61, 190 - 4, 0], 3,
     {"rotary": True, "fp8": True}),
    ("fp8-leftpad-window", torch.float32, E4M3, None, (2, 1), 3, 3, [64, 9, 100], 2,
     {"fp8": True, "leftpad": True, "window": (5, 1)}),
]  # fmt: skip


def _append_call(case, device):
    _, dtype, cache_dtype, page_size, (heads_q, heads_kv), seq_q, seq_new, lens, num_splits, options = case
    capacity, dim = 192, 32
    k_cache, v_cache, table, _, _ = make_cache(lens, capacity, heads_kv, dim, dtype, device, page_size)
    k_cache, v_cache = torch.nan_to_num(k_cache).to(cache_dtype), torch.nan_to_num(v_cache).to(cache_dtype)
    batch = len(lens)
    call = dict(q=torch.randn(batch, seq_q, heads_q, dim, device=device, dtype=dtype), k_cache=k_cache,
                v_cache=v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                k=torch.randn(batch, seq_new, heads_kv, dim, device=device, dtype=dtype),
                v=torch.randn(batch, seq_new, heads_kv, dim, device=device, dtype=dtype), block_table=table,
                num_splits=num_splits, return_lse=True, is_causal=options.get("is_causal", False),
                window=options.get("window"))  # fmt: skip
    if options.get("rotary"):
        angle = torch.rand(capacity, dim // 2) * 6.3
        call.update(rotary_cos=angle.cos().to(device, dtype), rotary_sin=angle.sin().to(device, dtype))
    if options.get("batch_index"):
        call["cache_batch_idx"] = torch.tensor([2, 0, 1], dtype=torch.int32, device=device)
    if options.get("leftpad"):
        call["cache_leftpad"] = torch.tensor([3, 0, 50], dtype=torch.int32, device=device)
    if options.get("fp8"):
        call.update(k_descale=torch.full((heads_kv,), 0.02, device=device),
                    v_descale=torch.tensor(0.03, device=device))  # fmt: skip
    return call


@pytest.mark.parametrize("case", APPENDS, ids=[c[0] for c in APPENDS])
def test_the_attention_kernel_appends_as_the_append_kernel_does(case, device, policy):
    """A decode step's new tokens written by the attention kernel itself (one launch, no append kernel; the
    policy's ``decode_append_in_attention``): the same cache bytes and the same outputs as with the append
    kernel before it, also when a sequence's new tokens cross from one split's keys into the next (each
    split writes its own)."""
    policy(decode_append_in_attention=True)
    call = _append_call(case, device)
    split = case[8] > 1
    q, heads_kv = call["q"], call["k_cache"].shape[2]
    assert decode.appends_in_attention(q.shape[2] // heads_kv * q.shape[1], q.shape[3], q.dtype)
    fused = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    with expect_launches(decode.KERNEL_DECODE, *[decode.KERNEL_COMBINE] * split, device=device, only=True):
        out, lse = flash_attention_with_kvcache(**fused)
    with use_policy(decode_append_in_attention=False), expect_launches(
        decode.KERNEL_APPEND, decode.KERNEL_DECODE, *[decode.KERNEL_COMBINE] * split, device=device, only=True
    ):
        out_apart, lse_apart = flash_attention_with_kvcache(**call)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(fused[name].view(torch.uint8), call[name].view(torch.uint8)), name
    assert torch.equal(out, out_apart) and torch.equal(lse, lse_apart)


@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_more_query_rows_than_a_tile_take_the_append_kernel(paged, device):
    """group x seq_q = 8 x 8 = 64 rows per KV head: two query tiles would race on the new keys, so the
    append kernel writes them first; the cache holds them exactly and the output matches float64."""
    lens, capacity, heads_kv, dim, seq_new = [20, 0], 64, 1, 16, 8
    k_cache, v_cache, table, k_log, v_log = make_cache(lens, capacity, heads_kv, dim, torch.float16, device,
                                                       16 if paged else None)  # fmt: skip
    q = torch.randn(2, 8, 8, dim, device=device, dtype=torch.float16)
    k_new, v_new = (torch.randn(2, seq_new, heads_kv, dim, device=device, dtype=torch.float16) for _ in "kv")
    assert not decode.appends_in_attention(8 * 8, dim, torch.float16)
    with expect_launches(decode.KERNEL_APPEND, decode.KERNEL_DECODE, device=device):
        out = flash_attention_with_kvcache(q, k_cache, v_cache, k=k_new, v=v_new, block_table=table,
                                           cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device),
                                           is_causal=True)  # fmt: skip
    for b, n in enumerate(lens):
        keys, values = gather(k_cache, table, b, n + seq_new), gather(v_cache, table, b, n + seq_new)
        assert torch.equal(keys, torch.cat([k_log[b, :n], k_new[b].cpu()]))
        assert torch.equal(values, torch.cat([v_log[b, :n], v_new[b].cpu()]))
        truth = reference(q, keys, values, b, torch.float64, is_causal=True)
        same = reference(q, keys, values, b, torch.float16, is_causal=True)
        assert_error_rule("out", out[b], same[0], truth[0], OUTPUT_FACTOR, torch.float16)


# --- per-call host work: plans from shapes only, no host read of device data ------------------------------

@pytest.mark.parametrize("paged", [False, True], ids=["dense", "paged"])
def test_plan_and_split_count_depend_on_shapes_only_and_nothing_is_read(paged, monkeypatch, policy):
    """On the CUDA code path (simulated, launches stubbed, checks off): one plan for calls that differ only in
    the values of cache_seqlens (and of the block table), a split count from the capacity, and no tensor
    value read on the host (the new tokens written by the attention kernel)."""

    policy(decode_append_in_attention=True)

    lens_sets = ([0, 0], [1, 150], [190, 3])
    page_size = 16 if paged else None
    k_cache, v_cache, table, _, _ = make_cache([0, 0], 192, 2, 64, torch.float32, "cpu", page_size)
    q = torch.randn(2, 1, 4, 64)
    k_new, v_new = (torch.randn(2, 1, 2, 64) for _ in range(2))
    seqlens = [torch.tensor(lens, dtype=torch.int32) for lens in lens_sets]
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    with launch.simulated_gpu():
        cfg = decode.kernel_config(64, torch.float32, 2, 192, 4, hardware_of(q.device))
        assert cfg.splits == 3  # 4 programs on 132 SMs, 3 key blocks of capacity
        before = runtime.launch_counts()
        with host_reads_raise(monkeypatch):
            for lens in [*seqlens, 5]:
                flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, k=k_new, v=v_new,
                                             block_table=table)  # fmt: skip
        ran = runtime.launch_counts() - before
        info, checked_calls = decode_launch.step_plans.cache_info(), len(decode._DECODE_CALLS)
    # two plans: the first call makes the one the tensor-length calls after it are served with (the calls
    # already checked; no LSE asked for, so it stores none), the int-length call takes the op's (with the
    # LSE it returns to the op's caller)
    assert info.misses == 2 and checked_calls == 1
    assert ran == {decode.KERNEL_DECODE: 4, decode.KERNEL_COMBINE: 4}  # (the attention kernel appends)


# --- the GPU build: the kernels as their plans launch them compile for sm_90 ------------------------------

MAX_SPILL_BYTES = 4096  # per-thread stack (the dense kernels' budgets: tests/kernel_report)
COMPILE_SCRIPT = r'''
import json, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from llm_speed.attention import decode, decode_launch
from llm_speed.attention.options import MaskKey
from llm_speed.core.policy import CANDIDATES
from llm_speed.kernel_report import analysis, build as kernel_build

POLICY = CANDIDATES["decode-append"].policy  # the new tokens written by the attention kernel where they fit

ELEMENT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
           torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
def build(plan, pointers, target):
    signature, constexprs = {}, {}
    for name in plan.kernel.params:
        value = plan.fixed.get(name)
        if name not in plan.fixed:
            signature[name] = pointers.get(name, "fp32")  # per call: tensors, else the float scalars
        elif isinstance(value, (bool, str)) or name.isupper() or value == 1:  # ints == 1, None: constants
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = "i32"
    source = ASTSource(fn=plan.kernel.fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=target, options={"num_warps": plan.num_warps,
                                                              "num_stages": plan.num_stages})
    return compiled


# (dtype, head_dim, batch, heads_q, heads_kv, seq_q, seq_new, paged, window, softcap, flash-attn options):
# the richest variants, the new tokens written by the attention kernel where group * seq_q fits one query
# tile, by the append kernel where it does not (the first and last rows: 64 rows); options: cache_batch_idx,
# cache_leftpad, rotary (rotary_dim, interleaved, tables in float32), ALiBi slopes of 1 or 2 dims, an fp8
# cache (its dtype; descales per KV head). The paged fp8 cache is compiled as launched by the kernel report
# (tests/kernel_report): this build does not specialise ints divisible by 16 nor aligned pointers, which
# there costs the paged 16-bit and fp8 kernels alike about 0.5-0.8 KB of loop spills that the real launch
# does not have (160 and 157 registers, no spill, Triton 3.6).
PROBLEMS = [
    (torch.bfloat16, 128, 2, 32, 8, 16, 16, True, (7, 0), True, {}),
    (torch.bfloat16, 128, 2, 32, 8, 4, 4, True, (7, 0), True, {}),
    (torch.float32, 256, 2, 8, 2, 1, 1, True, (None, None), True, {}),
    (torch.float16, 64, 1, 8, 8, 1, 1, False, (None, 0), False, {}),
    (torch.bfloat16, 128, 2, 32, 8, 4, 4, False, (7, 0), False,
     {"batch_idx": True, "leftpad": True, "rotary": (128, True, False), "alibi": 2}),
    (torch.float16, 64, 2, 8, 2, 1, 1, True, (None, None), True, {"rotary": (32, False, True), "alibi": 1}),
    (torch.bfloat16, 128, 2, 32, 8, 1, 1, False, (None, 0), False,
     {"fp8": torch.float8_e4m3fn, "batch_idx": True, "leftpad": True}),
    (torch.float16, 128, 2, 32, 8, 2, 2, False, (None, None), True,
     {"fp8": torch.float8_e5m2, "rotary": (128, False, False)}),
    (torch.bfloat16, 128, 2, 32, 8, 16, 16, False, (None, 0), False,
     {"fp8": torch.float8_e4m3fn, "batch_idx": True, "rotary": (64, True, True)}),
]
gpu = kernel_build.target_of(sys.argv[1])  # a GPU of the table: "h100-sxm"
target = GPUTarget("cuda", gpu.capability[0] * 10 + gpu.capability[1], 32)
capacity, page = 4096, 256
rows, cubins = [], []
for dtype, dim, batch, heads_q, heads_kv, seq_q, seq_new, paged, (left, right), softcap, options in PROBLEMS:
    element = ELEMENT[dtype]
    cache_element = ELEMENT[options.get("fp8", dtype)]
    cache = (batch * capacity // page, page, heads_kv, dim) if paged else (batch, capacity, heads_kv, dim)
    strides = lambda shape: torch.empty(shape, device="meta").stride()
    new = (strides((batch, seq_new, heads_kv, dim)),) * 2
    rotary = alibi = None
    if "rotary" in options:
        rotary_dim, interleaved, f32_tables = options["rotary"]
        rotary = (capacity + seq_q, rotary_dim, torch.float32 if f32_tables else dtype, interleaved)
    if "alibi" in options:
        alibi = heads_q if options["alibi"] == 2 else 0  # batch stride of the slopes
    append, attend, combine, *_ = decode_launch.step_plans.__wrapped__(
        (batch, seq_q, heads_q, dim), strides((batch, seq_q, heads_q, dim)), cache, strides(cache),
        strides(cache), (batch, capacity // page) if paged else None,
        (capacity // page, 1) if paged else None, 1, seq_new, new, dtype,
        MaskKey(False, left, right, softcap), 0, torch.device("cpu"), options.get("batch_idx", False),
        options.get("leftpad", False), rotary, alibi,
        (options["fp8"], (0, 1), (0, 1)) if "fp8" in options else None, lse=True, policy=POLICY,
    )
    assert combine is not None, "a split variant is meant"
    io = dict(K_CACHE="*" + cache_element, V_CACHE="*" + cache_element, CACHE_SEQLENS="*i32",
              BLOCK_TABLE="*i32", CACHE_BATCH_IDX="*i32", CACHE_LEFTPAD="*i32", ALIBI="*fp32",
              K_DESCALE="*fp32", V_DESCALE="*fp32")
    if rotary is not None:
        io.update(COS="*" + ELEMENT[rotary[2]], SIN="*" + ELEMENT[rotary[2]])
    assert (append is None) == decode.appends_in_attention(heads_q // heads_kv * seq_q, dim, dtype, POLICY)
    io.update(K="*" + element, V="*" + element)
    for plan, pointers in (
        (append, io),
        (attend, dict(io, Q="*" + element, OUT="*fp32", LSE="*fp32")),
        (combine, dict(OUT_PART="*fp32", LSE_PART="*fp32", OUT="*" + element, LSE="*fp32")),
    ):
        if plan is None:
            continue
        compiled = build(plan, pointers, target)
        rows.append({"dtype": element, "cache": cache_element, "head_dim": dim, "softcap": softcap,
                     "options": sorted(options), "kernel": plan.kernel.name,
                     "shared_bytes": compiled.metadata.shared})
        cubins.append(compiled.asm["cubin"])
# (per-thread stack bytes, local-memory instructions inside loops), the SASS of all from one nvdisasm run
for row, (sass, usage) in zip(rows, kernel_build.disassemble_all(cubins, gpu.arch), strict=True):
    row.update(stack_bytes=analysis.resource_usage(usage)["STACK"],
               loop_spills=analysis.Sass.parse(sass).spills_in_loops())
    print(json.dumps(row), flush=True)
'''


def test_kernels_compile_for_h100_as_launched(tmp_path):
    """The append, attention (paged, split, window, softcap, GQA, the flash-attn options: batch index,
    leftpad, rotary, ALiBi, and fp8 caches) and combine kernels, with the arguments their plans fix, compile
    for sm_90 under the GPU machine's Triton, fit the shared memory, do not spill wholesale, and the variants
    with options spill nothing inside a loop. Only the GPU machine's build: the installed Triton (the dev
    pin, which no GPU of ours runs) spills about 4 KB in the softcap variants with core.kernel_math.tanh, a
    known difference, and compiling the twenty kernels with it too cost `make test` 35 s."""
    pytest.importorskip("triton.backends.nvidia", reason="this Triton build has no NVIDIA backend")
    h100 = get_gpu("h100-sxm")
    env = environment(GPU_BUILD_ENV, TRITON_CACHE_DIR=str(tmp_path), TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, h100.id],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 9 * 2 + 2  # an attention and a combine kernel a problem, two append kernels
    assert sum(row["kernel"] == decode.KERNEL_APPEND for row in rows) == 2
    limit = (h100.smem_per_sm_kb - 1) * 1024  # opt-in maximum per block
    assert all(row["shared_bytes"] <= limit for row in rows), rows
    assert not [row for row in rows if row["options"] and row["loop_spills"]], rows
    spilling = [row for row in rows if row["stack_bytes"] > MAX_SPILL_BYTES]
    assert not spilling, spilling


# what the value checks say (off for CUDA tensors: such an entry makes NaN rows instead)
VALUE_ERRORS = (">= 0", "cache too small", r"block_table\[1, 0\] = 4", "not a page", "same cache slot")


def test_a_repeated_decode_step_skips_the_checks(monkeypatch):
    """With the value checks off (as for CUDA tensors), a repeated plain decode step is served from the calls
    checked before: no check, the same launches, the same result and appended cache; every error of the
    metadata is still raised."""

    if not runtime.triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU without TRITON_INTERPRET=1")
    launch.clear_plans()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    checked = record_calls(monkeypatch, decode, "_check_tensors")
    call = _good_call()
    repeat_decode_step(call, checked)
    assert len(checked) == 1
    for name, value, error, match in BAD:
        if match not in VALUE_ERRORS:
            with pytest.raises(error, match=match):
                flash_attention_with_kvcache(**{**call, name: value})


@pytest.mark.parametrize("num_splits", [1, 3], ids=["one-pass", "split"])
def test_a_step_that_returns_no_lse_stores_none(num_splits, monkeypatch):
    """A plain step without return_lse runs plans whose LSE stores are compiled out (the split partials then
    share one workspace): the same output as the step that returns the LSE, and that LSE against float64."""

    if not runtime.triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU without TRITON_INTERPRET=1")
    launch.clear_plans()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    k_cache, v_cache, _, _, _ = make_cache([70, 41], 96, 2, 32, torch.float32, "cpu", None)
    lens = torch.tensor([70, 41], dtype=torch.int32)
    q = torch.randn(2, 1, 4, 32)
    out = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits)
    both = flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, num_splits=num_splits,
                                        return_lse=True)  # fmt: skip
    plans = sorted(decode._DECODE_CALLS.values(), key=lambda p: p[4] is not None)
    assert [p[4] for p in plans] == [None, (2, 4, 1)]  # the LSE's shape, None: not stored
    assert plans[0][1].fixed.get("LSE", "given") is (None if num_splits == 1 else "given")
    combine = plans[0][2]
    assert (combine is None) == (num_splits == 1) and (combine is None or combine.fixed["LSE"] is None)
    assert torch.equal(out, both[0])
    for b, n in enumerate(lens.tolist()):
        keys, values = gather(k_cache, None, b, n), gather(v_cache, None, b, n)
        ref, ref_lse = reference(q, keys, values, b, torch.float64)
        assert (out[b].double() - ref).abs().max() < 1e-5
        assert (both[1][b].double() - ref_lse).abs().max() < 1e-5


def test_a_repeated_step_with_copied_inputs_is_copied_again(monkeypatch):
    """q and the new k/v with a strided last dim are copied before the kernels read them: a repeated step with
    that metadata copies them again (the calls already checked keep only steps that copied nothing)."""

    if not runtime.triton_runs_on(torch.device("cpu")):
        pytest.skip("Triton cannot run on the CPU without TRITON_INTERPRET=1")
    launch.clear_plans()
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    call = _good_call()
    for name in ("q", "k", "v"):
        call[name] = call[name].transpose(2, 3).contiguous().transpose(2, 3)  # last-dim stride != 1
    again = dict(call, k_cache=call["k_cache"].clone(), v_cache=call["v_cache"].clone())
    first = flash_attention_with_kvcache(**call)
    assert torch.equal(flash_attention_with_kvcache(**again), first)
    assert torch.equal(again["k_cache"], call["k_cache"]) and torch.equal(again["v_cache"], call["v_cache"])
