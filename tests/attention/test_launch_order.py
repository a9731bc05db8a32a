"""Longest-first launch order of causal attention's query-block kernels (``blocks.program_block`` with
``LPT``, as FlashAttention-3's LPT scheduler): every block of every (batch, head) is owned by exactly one
program, the heaviest blocks start first within each L2 section, only causal-like masks get it, and the
results do not change."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from attention_testing import fresh_plans, make_qkv, run_with_grads

from llm_speed.attention import blocks, configs, flash, flash_attention_varlen, launcher, plans
from llm_speed.attention.reference import reference_attention
from llm_speed.core import hardware as hardware_module
from llm_speed.core import launch, runtime
from llm_speed.core.policy import SHIPPED

pytestmark = pytest.mark.skipif(
    not runtime.INTERPRETED,
    reason="checks the order the interpreter runs programs in; kernels run compiled here (a GPU)",
)


@triton.jit
def _order_kernel(
    OUT, CU_Q, CU_K, seq_q, seq_kv, heads, batch, grid_blocks, section,
    BLOCK: tl.constexpr, IS_VARLEN: tl.constexpr, LPT: tl.constexpr, BLOCK_B: tl.constexpr,
):  # fmt: skip
    start, b, h, bos_q, len_q, bos_k, len_k, valid = blocks.program_block(
        CU_Q, CU_K, CU_Q, seq_q, seq_kv, heads, batch, grid_blocks, section,
        BLOCK=BLOCK, OVER_KEYS=False, IS_VARLEN=IS_VARLEN, SEQUSED=False, PAGED=False, BLOCK_B=BLOCK_B,
        LPT=LPT,
    )  # fmt: skip
    p = OUT + tl.program_id(0) * 4
    tl.store(p, start.to(tl.int64))
    tl.store(p + 1, b)
    tl.store(p + 2, h)
    tl.store(p + 3, len_q.to(tl.int64))


def _order(*, batch, heads, seq, block, section, cu=None):
    """(start, b, h, rows) of each query-block program, in program order; ``section`` None: row order."""
    grid, args = plans._grid(seq, block, batch, heads, cu is not None)
    out = torch.full((grid[0], 4), -1, dtype=torch.int64)
    cu = torch.tensor(cu if cu is not None else [0], dtype=torch.int32)
    _order_kernel[grid](
        out, cu, cu, seq, seq, heads, batch, args["grid_blocks"], section or 1,
        BLOCK=block, IS_VARLEN=len(cu) > 1, LPT=section is not None, BLOCK_B=args["BLOCK_B"],
    )  # fmt: skip
    return [tuple(int(x) for x in row) for row in out]


@pytest.mark.parametrize("section", [None, 1, 4, 6])
def test_dense_programs_cover_every_block_once_heaviest_first(section):
    batch, heads, seq, block = 2, 3, 70, 16  # 5 blocks per (batch, head), 6 pairs: sections of 4 and 2
    order = _order(batch=batch, heads=heads, seq=seq, block=block, section=section)
    owned = [(start, b, h) for start, b, h, _ in order]
    expected = {(blk * block, b, h) for blk in range(5) for b in range(batch) for h in range(heads)}
    assert len(owned) == len(expected) and set(owned) == expected
    pairs = [b * heads + h for _, b, h in owned]
    if section is None:  # row order: a pair's blocks adjacent, ascending
        assert owned == sorted(owned, key=lambda o: (o[1] * heads + o[2], o[0]))
        return
    for first in range(0, batch * heads, section):
        positions = [i for i, pair in enumerate(pairs) if first <= pair < first + section]
        assert positions == list(range(positions[0], positions[-1] + 1))  # a section is contiguous
        starts = [owned[i][0] for i in positions]
        assert starts == sorted(starts, reverse=True)  # the last block (most keys visible) first


@pytest.mark.parametrize("section", [None, 1, 2])
def test_packed_programs_cover_every_block_once(section):
    cu = [0, 20, 21, 70]  # blocks of 16: 2, 1 and 4 per sequence; 8 programs per head (one spare)
    heads, block = 2, 16
    order = _order(batch=3, heads=heads, seq=70, block=block, section=section, cu=cu)
    real = [(start, b, h) for start, b, h, rows in order if rows > 0]
    expected = {(i * block, b, h) for h in range(heads) for b, n in enumerate((2, 1, 4)) for i in range(n)}
    assert len(real) == len(expected) and set(real) == expected
    if section is not None:
        for h in range(heads):  # within a sequence, the later block (more keys) first
            for b in range(3):
                starts = [start for start, bb, hh in real if (bb, hh) == (b, h)]
                assert starts == sorted(starts, reverse=True)


def _plans(monkeypatch, call):
    """The forward and backward plans ``call`` makes (fresh caches), launched as no-ops on CPU tensors."""
    fresh_plans(monkeypatch)
    made = []
    for name in ("forward_plan", "backward_plans"):
        real = getattr(launcher, name)

        def recording(*args, _real=real, **kwargs):
            plan = _real(*args, **kwargs)
            made.extend(plan if isinstance(plan, tuple) else (plan,))
            return plan

        monkeypatch.setattr(launcher, name, recording)
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    with launch.simulated_gpu():
        call()
    return {plan.kernel.name: plan.fixed for plan in made}


def _dense_call(**options):
    q, k, v = make_qkv(2, 4, 2, 64, 64, 32, torch.float16, "cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    return lambda: flash.flash_attention(*leaves, deterministic=True, **options).float().sum().backward()


QUERY_KERNELS = (flash.FORWARD.name, "flash_attention_bwd_dq")


@pytest.fixture
def short_lpt(policy):
    """Longest first from any length, so that these small problems take that path (the launcher keeps it for
    sequences of the policy's ``lpt_min_rows`` and more)."""
    policy(lpt_min_rows=0)


@pytest.mark.parametrize(
    "options, lpt",
    [({"is_causal": True}, True), ({"window": (None, 3)}, True), ({}, False), ({"window": (5, 0)}, False)],
)
def test_only_causal_like_masks_launch_longest_first(monkeypatch, short_lpt, options, lpt):
    fixed = _plans(monkeypatch, _dense_call(**options))
    for kernel in QUERY_KERNELS:
        assert fixed[kernel]["LPT"] is lpt
        # the H100's 50 MiB L2 holds every pair's K and V here: one section of all 2 x 4 pairs
        assert fixed[kernel]["section"] == (8 if lpt else 1)
    assert "LPT" not in fixed["flash_attention_bwd_dkdv"]  # key blocks: row order is heaviest first already


def test_sections_follow_the_l2(monkeypatch, short_lpt):
    # K and V of a KV head: 2 x 64 keys x 32 dims x 2 bytes = 8 KiB, shared by 2 query heads; a 12 KiB L2
    # holds 3 query heads' worth
    small = dataclasses.replace(hardware_module.default_hardware(), l2_bytes=12 * 1024)
    monkeypatch.setattr(plans, "hardware_of", lambda device=None: small)
    fixed = _plans(monkeypatch, _dense_call(is_causal=True))
    assert [fixed[kernel]["section"] for kernel in QUERY_KERNELS] == [3, 3]


@pytest.mark.parametrize("l2_kib", [4, 12])
def test_results_do_not_depend_on_the_sections(monkeypatch, short_lpt, l2_kib):
    # Sections of 1 and 3 pairs (the last one partial) over 8 pairs: causal forward and backward, dense and
    # packed, against the float64 reference.
    small = dataclasses.replace(hardware_module.default_hardware(), l2_bytes=l2_kib * 1024)
    monkeypatch.setattr(plans, "hardware_of", lambda device=None: small)
    fresh_plans(monkeypatch)
    q, k, v = make_qkv(2, 4, 2, 37, 45, 32, torch.float32, "cpu")
    dout = torch.randn_like(q)
    options = {"is_causal": True, "deterministic": True}  # the dQ kernel launches longest first too
    out, _, dq, dk, dv = run_with_grads(flash.flash_attention, q, k, v, dout, **options)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(q64, k64, v64, is_causal=True)
    grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert (out.double() - ref).abs().max() < 1e-5
    for got, want in zip((dq, dk, dv), grads, strict=True):
        assert (got.double() - want).abs().max() < 1e-4

    packed = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    cu_q = torch.tensor([0, 10, 37], dtype=torch.int32)
    cu_k = torch.tensor([0, 20, 45], dtype=torch.int32)
    got = flash_attention_varlen(*packed, cu_q, cu_k, 27, 25, is_causal=True)
    for b in range(2):
        bounds = (cu_q, cu_k, cu_k)
        rows = [
            t[cu[b] : cu[b + 1]].transpose(0, 1)[None].double() for t, cu in zip(packed, bounds, strict=True)
        ]
        want = reference_attention(*rows, is_causal=True)[0].transpose(0, 1)
        assert (got[cu_q[b] : cu_q[b + 1]].double() - want).abs().max() < 1e-5


def test_the_performance_model_launches_as_the_kernels_do():
    # llm_speed.perf.predict models the order and the section rule without torch (reading the shipped
    # policy's lpt_min_rows): same block sequence as the kernel's programs, same section as the launcher's.
    from llm_speed.core.gpus import get_gpu
    from llm_speed.perf.predict import LPT_MIN_ROWS, AttentionShape, launch_order, lpt_section

    batch, heads, seq, block, section = 2, 3, 70, 16, 4
    order = _order(batch=batch, heads=heads, seq=seq, block=block, section=section)
    blocks = [start // block for start, _, _, _ in order]
    assert blocks == list(launch_order(list(range(5)), batch * heads, section))

    hardware = hardware_module.default_hardware()
    for seq_kv, heads_q, heads_kv in ((16384, 16, 16), (4096, 32, 8), (131072, 8, 1)):
        launcher = configs.launch_order(True, None, None, hardware, 4 * heads_q, 2 * seq_kv * 128 * 2,
                                       heads_q // heads_kv, seq_kv, SHIPPED)  # fmt: skip
        shape = AttentionShape(4, heads_q, heads_kv, 128, 2, True, ((seq_kv, seq_kv),))
        model = lpt_section(get_gpu(hardware.name), "lpt", shape)
        expected = (
            {"section": 1, "LPT": False}
            if model is None
            else {"section": min(model, 4 * heads_q), "LPT": True}
        )
        assert launcher == expected
        assert (model is None) == (seq_kv < SHIPPED.lpt_min_rows)
    # below lpt_min_rows both launch in row order
    assert LPT_MIN_ROWS == SHIPPED.lpt_min_rows
    seq = SHIPPED.lpt_min_rows // 2
    assert configs.launch_order(True, None, None, hardware, 16, 2 * seq * 256, 1, seq, SHIPPED) == {
        "section": 1,
        "LPT": False,
    }
    assert (
        lpt_section(get_gpu(hardware.name), "lpt", AttentionShape(1, 16, 16, 128, 2, True, ((seq, seq),)))
        is None
    )
