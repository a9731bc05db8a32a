"""flash_attention_with_kvcache where Triton cannot run (CPU tensors without TRITON_INTERPRET=1): the float32
PyTorch reference (``reference.kvcache_forward``), the new k/v appended into the caches in place.

The kernel tests' own cases and assertions are rerun with Triton switched off (``runtime.triton_runs_on``
says False, as on a plain CPU) and no kernel may launch: every option (paged, cache_batch_idx, leftpad,
rotary, ALiBi, softcap, window, GQA, fp8 caches), the empty problems, and the NaN rows of invalid entries
with the value checks off. One subprocess runs flash-attn's wrapper with the interpreter really off.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import test_attention_kvcache as dense
import test_attention_kvcache_features as features
import test_attention_kvcache_fp8 as fp8
import torch

from llm_speed.core import launch, runtime

CPU = torch.device("cpu")


@pytest.fixture
def without_triton(monkeypatch):
    """Triton unavailable on the CPU; the test fails if a Triton kernel launches anyway. The calls an earlier
    test left kept (``_DECODE_CALLS``: served without asking where Triton runs, which never changes in a real
    process) are forgotten first."""
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    launch.clear_plans()
    before = runtime.launch_counts()
    yield
    assert runtime.launch_counts() == before, "a Triton kernel ran"


@pytest.mark.parametrize("case", dense.CASES, ids=[c[0] for c in dense.CASES])
def test_dense_and_paged_cases(case, without_triton):
    dense.test_matches_float64_reference_and_appends_in_place(case, CPU)


@pytest.mark.parametrize("case", features.CASES, ids=[c.name for c in features.CASES])
def test_every_flash_attn_option(case, without_triton):
    features.test_matches_float64_reference_and_writes_the_caches(case, CPU)


@pytest.mark.parametrize("case", fp8.CASES, ids=[c.name for c in fp8.CASES])
def test_fp8_caches(case, without_triton):
    fp8.test_matches_float64_truth_and_quantizes_the_appended_tokens(case, CPU)


def test_fp8_append_saturates_and_rounds_as_the_kernel(without_triton):
    fp8.test_saturation_nan_infinity_and_rounding_of_the_append(CPU)


def test_empty_problems(without_triton):
    dense.test_zero_batch_and_zero_queries(CPU)
    dense.test_empty_cache_gives_zero_and_minus_inf(CPU)


def test_strided_caches_are_written_in_place(without_triton):
    dense.test_strided_views_are_read_and_written_in_place(CPU)


@pytest.mark.parametrize("paged, num_splits", [(False, 1), (True, 3)], ids=["dense", "paged"])
def test_unchecked_bad_cache_seqlens(paged, num_splits, without_triton, monkeypatch, policy):
    dense.test_unchecked_bad_cache_seqlens_give_nan_rows_and_no_cache_access(
        paged, num_splits, CPU, monkeypatch, policy
    )


def test_unchecked_bad_block_table_entries(without_triton, monkeypatch):
    dense.test_unchecked_bad_block_table_entries_give_nan_rows_and_read_no_such_page(3, {}, CPU, monkeypatch)


def test_unchecked_bad_batch_index_leftpad_and_rotary(without_triton, monkeypatch):
    features.test_unchecked_bad_batch_index_leftpad_and_rotary_give_nan_rows_and_no_cache_access(
        1, CPU, monkeypatch
    )


def test_unchecked_bad_fp8_entries(without_triton, monkeypatch, policy):
    fp8.test_unchecked_bad_entries_give_nan_rows_and_no_fp8_write(CPU, monkeypatch, policy)


def test_bad_input_is_still_refused_before_any_write(without_triton):
    for name, value, error, match in dense.BAD:
        dense.test_bad_input_is_refused_before_any_write(name, value, error, match)


_PLAIN_CPU = """
import torch
from llm_speed.attention.reference import reference_kvcache
from llm_speed.core import runtime
from llm_speed.flash_attn_interface import flash_attn_with_kvcache
assert not runtime.INTERPRETED and not runtime.triton_runs_on(torch.device("cpu"))
torch.manual_seed(0)
q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
k_cache = torch.randn(2, 32, 2, 16, dtype=torch.float16)
v_cache = torch.randn_like(k_cache)
k, v = torch.randn(2, 1, 2, 16, dtype=torch.float16), torch.randn(2, 1, 2, 16, dtype=torch.float16)
lens = torch.tensor([5, 20], dtype=torch.int32)
before = k_cache.clone(), v_cache.clone()
out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, causal=True)
truth, _, k_ref, v_ref = reference_kvcache(q.double(), before[0], before[1], lens, k.double(), v.double(),
                                           is_causal=True)
assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref), "the new tokens were not appended"
assert (out.double() - truth).abs().max() < 2e-3
print("plain CPU ok")
"""


def test_plain_cpu_process_runs_flash_attn_wrapper():
    """The real condition: a process without TRITON_INTERPRET (no monkeypatching)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_INTERPRET"] = "0"
    done = subprocess.run([sys.executable, "-c", _PLAIN_CPU], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "plain CPU ok" in done.stdout
