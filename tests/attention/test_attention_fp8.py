"""fp8 attention forward (FlashAttention-3's): ``flash_attention`` and ``flash_attention_varlen`` with e4m3 q,
k, v and descale_q / descale_k / descale_v per tensor, per KV head or per sequence and KV head; causal,
windows, softcap, GQA/MQA, ALiBi, packed and paged sequences, the output layout, bad arguments, the
forward-only rule, the op registration and the PyTorch fallback.

Truth: float64 attention over the inputs dequantized exactly (``x.float() * descale``), so the inputs'
quantization is not counted as kernel error. The same-precision version is the float32 reference that rounds
the weights to e4m3 as the kernel does (``reference_forward`` with descales: ``exp(s - max) * 2**8`` to e4m3
before the product with v, bfloat16 output); 2x rule of TESTING.md on out. The LSE never sees the rounded
weights, only the fp8 product q.k^T: its same-precision version takes that product from PyTorch's fp8 matrix
product on the same device (``torch._scaled_mm``, :func:`_same_precision_lse`), the rest in float32. On the
CPU that product is exact (the interpreter's too): the LSE must be float32-exact there. On a Hopper GPU both
run on the fp8 tensor cores, whose accumulation keeps only about 14 bits below the largest addend (the fp8
dot's "imprecise accumulation", as in FlashAttention-3 and DeepSeek-V3's report): about 1e-4 of a score of 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
from attention_testing import (
    OUTPUT_FACTOR,
    assert_error_rule,
    expect_launches,
    fresh_plans,
    nan_poisoned_outputs,
)

from llm_speed import flash_attention, flash_attention_varlen, quantize_fp8
from llm_speed.attention import flash, launcher
from llm_speed.attention.checks import DESCALE_NAMES
from llm_speed.attention.reference import (
    apply_softcap,
    dense_alibi_bias,
    dequantize_attention_inputs,
    descale_rows,
    reference_attention,
    reference_forward,
    varlen_reference_forward,
    visible,
)
from llm_speed.core import runtime

E4M3, BF16, F32, I32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.int32
LSE_RELATIVE = 4e-6  # the LSE in float32: a few ulps of its magnitude


@dataclass
class Case:
    name: str
    batch: int
    heads: tuple[int, int]  # (heads_q, heads_kv)
    seq: tuple[int, int]  # (seq_q, seq_kv)
    head_dim: int
    descales: str  # "tensor" ([]), "one" ([1]), "head" ([heads_kv]), "batch" ([batch, heads_kv]), "none"
    options: dict = field(default_factory=dict)
    alibi: bool = False
    positive: bool = False  # inputs from torch.rand: every weight rounds the same way (bias shows)
    seq_major: bool = False  # q, k, v as [B, S, H, D] tensors viewed [B, H, S, D]


CASES = [
    Case("d64-mha-tensor", 2, (4, 4), (70, 70), 64, "tensor"),
    Case("d128-gqa-head-causal-short-q", 1, (4, 2), (33, 97), 128, "head", {"is_causal": True}),
    Case("d40-mqa-batch-window-softcap", 2, (4, 1), (50, 50), 40, "batch",
         {"is_causal": True, "window": (10, 0), "softcap": 5.0}),
    Case("d16-none-alibi-long-q", 1, (2, 2), (40, 17), 16, "none", {"is_causal": True}, alibi=True),
    Case("d80-one-negative-scale-positive", 1, (2, 1), (31, 64), 80, "one", {"scale": -0.08}, positive=True),
    Case("d256-head-seq-major-window", 1, (2, 2), (20, 45), 256, "head", {"window": (7, 5)}, seq_major=True),
]  # fmt: skip


def _descale(layout: str, batch: int, heads_kv: int):
    """Descales around amax / 448 of randn data (|x| < ~4), different per head and sequence; None for none."""
    if layout == "none":
        return None
    shape = {"tensor": (), "one": (1,), "head": (heads_kv,), "batch": (batch, heads_kv)}[layout]
    return 4.0 / 448 * (0.5 + torch.rand(shape))


def _quantize(x: torch.Tensor, descale, group: int) -> torch.Tensor:
    """``x`` [B, H, S, D] as e4m3 of ``x / descale`` (torch's saturating cast), the descale of head h at
    h // group."""
    if descale is None:
        return x.clamp(-448, 448).to(E4M3)
    batch, heads = x.shape[:2]
    rows = descale.reshape(-1).expand(heads // group) if descale.dim() < 2 else descale
    rows = rows.expand(batch, heads // group).repeat_interleave(group, dim=1)
    return (x / rows[:, :, None, None]).clamp(-448, 448).to(E4M3)


def build(case: Case, device):
    """(q, k, v, descales) on ``device``: e4m3 inputs and float32 descales (None where not given)."""
    (heads_q, heads_kv), (seq_q, seq_kv), dim = case.heads, case.seq, case.head_dim
    draw = torch.rand if case.positive else torch.randn
    descales = tuple(_descale(case.descales, case.batch, heads_kv) for _ in range(3))
    shapes = ((case.batch, heads_q, seq_q, dim), (case.batch, heads_kv, seq_kv, dim))
    spread = 3.0 if case.descales == "none" else 1.0
    q = _quantize(draw(shapes[0]) * spread, descales[0], heads_q // heads_kv)
    k, v = (_quantize(draw(shapes[1]), d, 1) for d in descales[1:])
    if case.seq_major:  # [B, S, H, D] storage, viewed [B, H, S, D]
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return (q.to(device), k.to(device), v.to(device),
            tuple(None if d is None else d.to(device) for d in descales))  # fmt: skip


def _fp8_products(q8: torch.Tensor, k8: torch.Tensor) -> torch.Tensor:
    """``q8 @ k8^T`` per (sequence, query head), ``[B, Hq, Sq, Skv]`` float32 on the CPU, as PyTorch's fp8
    matrix product computes it on the inputs' device: ``torch._scaled_mm`` with unit scales. On a GPU it runs
    on the fp8 tensor cores with their accumulation and no promotion to float32 registers between them
    (``use_fast_accum``), as the kernel's q.k^T does (Triton's fp8 ``tl.dot`` on sm_90 defaults to
    ``max_num_imprecise_acc`` 2**30, i.e. never promotes); on the CPU it is exact. cuBLAS wants K and N
    multiples of 16: the zeros padded on add nothing."""
    batch, heads_q, seq_q, dim = q8.shape
    heads_kv, seq_kv = k8.shape[1], k8.shape[2]
    out = torch.zeros(batch, heads_q, seq_q, seq_kv)
    if out.numel() == 0:
        return out
    pad = torch.nn.functional.pad  # on the bytes: torch has no fp8 pad
    q_pad = pad(q8.view(torch.uint8), (0, -dim % 16)).view(E4M3)
    k_pad = pad(k8.view(torch.uint8), (0, -dim % 16, 0, -seq_kv % 16)).view(E4M3)
    one = torch.ones((), device=q8.device)
    for b in range(batch):
        for h in range(heads_q):
            k_cols = k_pad[b, h // (heads_q // heads_kv)].t()  # column-major, as cuBLAS takes it
            product = torch._scaled_mm(q_pad[b, h], k_cols, one, one, out_dtype=F32, use_fast_accum=True)
            out[b, h] = product[:, :seq_kv].cpu()
    return out


def _same_precision_lse(q8, k8, descales, scale: float, *, is_causal=False, window=None, softcap=None,
                        alibi_slopes=None) -> torch.Tensor:  # fmt: skip
    """The LSE ``[B, Hq, Sq]`` (CPU) in the kernel's own precision: the fp8 product q.k^T as PyTorch computes
    it on q8's device (:func:`_fp8_products`), times scale * descale_q * descale_k in float32 (the kernel's
    folded score scale), then cap, ALiBi, mask and logsumexp in float32."""
    batch, heads_q, seq_q = q8.shape[:3]
    heads_kv, seq_kv = k8.shape[1], k8.shape[2]
    factor = torch.full((batch, heads_q), scale, dtype=F32)
    for descale in descales[:2]:
        if descale is not None:
            rows = descale_rows(descale.cpu(), batch, heads_kv).repeat_interleave(heads_q // heads_kv, dim=1)
            factor = factor * rows
    scores = apply_softcap(_fp8_products(q8, k8) * factor[:, :, None, None], softcap)
    if alibi_slopes is not None:
        scores = scores + dense_alibi_bias(alibi_slopes.cpu().float(), seq_q, seq_kv)
    if is_causal or window is not None:
        seen = visible(seq_q, seq_kv, is_causal=is_causal, window=window)
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.logsumexp(scores, -1)


def _options(case: Case, heads_q: int) -> dict:
    options = dict(case.options)
    if case.alibi:
        options["alibi_slopes"] = torch.rand(heads_q) * 0.3
    return options


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_matches_float64_truth(case, device, monkeypatch):
    nan_poisoned_outputs(monkeypatch)
    _check_against_truth(case, device)


def _check_against_truth(case: Case, device) -> None:
    """The kernel's out and LSE for ``case`` against the float64 truth, by the 2x rule (see the module)."""
    q, k, v, descales = build(case, device)
    options = _options(case, case.heads[0])
    on_device = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in options.items()}
    with expect_launches(flash.FORWARD.name, device=device):
        out, lse = flash_attention(q, k, v, descale_q=descales[0], descale_k=descales[1],
                                   descale_v=descales[2], return_lse=True, **on_device)  # fmt: skip
    assert out.dtype == BF16 and out.shape == q.shape and lse.dtype == F32 and lse.shape == q.shape[:3]
    if case.seq_major:  # written so that out.transpose(1, 2) is contiguous, as for 16-bit inputs
        assert out.transpose(1, 2).is_contiguous()
    cpu = [t.cpu() for t in (q, k, v)]
    cpu_descales = tuple(None if d is None else d.cpu() for d in descales)
    scale = options.pop("scale", 1.0 / math.sqrt(case.head_dim))
    wide = dequantize_attention_inputs(*cpu, cpu_descales, torch.float64)
    alibi = options.get("alibi_slopes")
    truth_options = dict(options, alibi_slopes=None if alibi is None else alibi.double())
    truth, truth_lse = reference_attention(*wide, scale=scale, return_lse=True, **truth_options)
    reference_options = {"window": None, "softcap": None, "is_causal": False, **options}
    same, _ = reference_forward(*cpu, scale=scale, descales=cpu_descales, **reference_options)
    assert_error_rule("out", out, same, truth, OUTPUT_FACTOR, BF16)
    # (the same-precision LSE was the truth itself, error 0, until the H100 showed the fp8 product's own
    # error; on the CPU this adds twice a float32 logsumexp's rounding, ~1e-6, to the bound)
    same_lse = _same_precision_lse(q, k, descales, scale, **options)
    lse_cap = LSE_RELATIVE * max(1.0, truth_lse[torch.isfinite(truth_lse)].abs().max().item())
    assert_error_rule("lse", lse, same_lse, truth_lse, OUTPUT_FACTOR, cap=lse_cap)


# Ragged shapes for the transposed-V path: key counts not a multiple of the key block (64 at head_dim <= 64,
# 128 above) nor of V^T's 16-byte row alignment, head dims below their power of two, GQA, masks.
V_T_CASES = [
    Case("d72-gqa-ragged-129", 1, (4, 2), (45, 129), 72, "head"),
    Case("d40-causal-alibi-ragged-83", 2, (2, 2), (83, 83), 40, "batch", {"is_causal": True}, alibi=True),
    Case("d96-mqa-window-softcap-ragged-150", 1, (3, 1), (61, 150), 96, "tensor",
         {"window": (40, 9), "softcap": 6.0}),
    Case("d128-causal-long-q-ragged-17", 1, (2, 2), (70, 17), 128, "one", {"is_causal": True}),
]  # fmt: skip


@pytest.mark.parametrize("case", V_T_CASES, ids=[c.name for c in V_T_CASES])
def test_dense_fp8_reads_v_transposed(case, device, monkeypatch):
    """Dense fp8 attention hands the kernel V^T (keys contiguous, rows 16-byte aligned: the layout the PV
    product's fp8 wgmma pipelines) and fixes ``V_TRANSPOSED`` in its plan; the output and LSE meet the float64
    truth on ragged shapes. V^T's padding is NaN here: a GPU's 0 * NaN would show a read of it in the output
    (Triton's interpreter's fp8 dot gives 0 there, so on the CPU only a non-zero weight on it would)."""
    nan_poisoned_outputs(monkeypatch)
    fresh_plans(monkeypatch)
    plans, copies = [], []
    make_plan, transpose = launcher.forward_plan, flash.transposed_values

    def recorded_plan(*args, **kwargs):
        plans.append(make_plan(*args, **kwargs))
        return plans[-1]

    def nan_padded(v):
        v_t = transpose(v)
        batch, heads_kv, head_dim, seq_kv = v_t.shape
        row = v_t.stride(2)
        whole = torch.as_strided(v_t, (batch, heads_kv, head_dim, row), v_t.stride())
        whole[..., seq_kv:].view(torch.uint8).fill_(0x7F)  # e4m3 NaN
        copies.append(v_t)
        return v_t

    monkeypatch.setattr(launcher, "forward_plan", recorded_plan)
    monkeypatch.setattr(launcher, "transposed_values", nan_padded)
    _check_against_truth(case, device)
    (v_t,) = copies
    (plan,) = plans
    batch, (_, heads_kv), (_, seq_kv), dim = case.batch, case.heads, case.seq, case.head_dim
    assert v_t.shape == (batch, heads_kv, dim, seq_kv) and v_t.stride(3) == 1
    assert v_t.stride(2) % flash.V_T_ALIGN == 0 and v_t.stride(2) >= seq_kv
    assert plan.fixed["V_TRANSPOSED"] is True and plan.fixed["stride_vn"] == v_t.stride(2)
    assert plan.fixed["stride_vh"] == v_t.stride(1) and plan.fixed["stride_vb"] == v_t.stride(0)


def test_v_is_transposed_for_dense_fp8_only(device, monkeypatch):
    """16-bit attention and packed fp8 attention read V as it is (``V_TRANSPOSED`` off, no copy)."""
    fresh_plans(monkeypatch)
    plans = []
    make_plan = launcher.forward_plan

    def recorded_plan(*args, **kwargs):
        plans.append(make_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(launcher, "forward_plan", recorded_plan)
    monkeypatch.setattr(launcher, "transposed_values", lambda v: pytest.fail("V transposed"))
    q, k, v = (torch.randn(1, 2, 19, 32, device=device) for _ in range(3))
    flash_attention(q, k, v, is_causal=True)
    cu = torch.tensor([0, 19], dtype=I32, device=device)
    flash_attention_varlen(*(t.to(E4M3)[0].transpose(0, 1) for t in (q, k, v)), cu, cu, 19, 19)
    distinct = list({id(plan): plan for plan in plans}.values())  # a repeated lookup finds the same plan
    assert [plan.fixed["V_TRANSPOSED"] for plan in distinct] == [False, False]


def test_the_weights_are_rounded_to_e4m3_scaled_by_256(device):
    """One dominant key (value 0) and many small weights: straight to e4m3 the small weights (below 2**-10)
    would flush to 0 and the output with them; scaled by 2**8 they are e4m3 normals, and the kernel's output
    is within a few percent of the truth."""
    seq_kv, dim = 64, 32
    q = torch.zeros(1, 1, 1, dim)
    q[..., 0] = 8.0
    k = torch.zeros(1, 1, seq_kv, dim)
    k[0, 0, 0, 0] = 8.0  # score 8 against <= 0.5 for the others: weights near exp(-7.7)
    k[0, 0, 1:, 0] = torch.rand(seq_kv - 1) * 0.5
    v = torch.randn(1, 1, seq_kv, dim)
    v[0, 0, 0] = 0.0  # the output is the small weights' alone
    q8, k8, v8 = (t.to(E4M3) for t in (q, k, v))
    out = flash_attention(q8.to(device), k8.to(device), v8.to(device), scale=0.125).cpu().double()
    wide = [t.double() for t in (q8, k8, v8)]
    truth = reference_attention(*wide, scale=0.125)
    weights = torch.softmax((wide[0] @ wide[1].transpose(-1, -2)) * 0.125, -1)
    assert (weights[..., 1:] < 2.0**-10).all() and (weights[..., 1:] * 256 > 2.0**-6).all()
    assert weights[..., 1:].to(E4M3).eq(0).all()  # what e4m3 makes of them unscaled
    err = (out - truth).abs().max().item()
    assert err < 0.05 * truth.abs().max().item()


def test_descales_are_exact_factors(device):
    """Powers-of-two descales per (sequence, KV head): the scores' descales act as the scale they multiply
    and v's as a factor of the output, bit for bit (rounding commutes with powers of two)."""
    batch, heads_q, heads_kv, seq, dim = 2, 4, 2, 37, 32
    q8, k8, v8 = (torch.randn(batch, h, seq, dim).mul(20).to(E4M3).to(device)
                  for h in (heads_q, heads_kv, heads_kv))  # fmt: skip
    one = torch.ones((), device=device)
    powers = torch.tensor([[2.0**-3, 2.0**-1], [2.0**-2, 2.0**-4]], device=device)  # [batch, heads_kv]
    base = flash_attention(q8, k8, v8, scale=0.05, descale_q=one, is_causal=True)
    scaled_v = flash_attention(q8, k8, v8, scale=0.05, descale_v=powers, is_causal=True)
    factor = powers.repeat_interleave(heads_q // heads_kv, dim=1)[:, :, None, None]
    assert torch.equal(scaled_v, (base.float() * factor).to(BF16))
    for b in range(batch):
        for h in range(heads_kv):
            s = 0.05 * powers[b, h].item() * 2.0**-2
            expect = flash_attention(q8[b : b + 1], k8[b : b + 1], v8[b : b + 1], scale=s, is_causal=True)
            got = flash_attention(q8[b : b + 1], k8[b : b + 1], v8[b : b + 1], scale=0.05, is_causal=True,
                                  descale_q=powers[b : b + 1], descale_k=torch.full((heads_kv,), 0.25,
                                                                                  device=device))  # fmt: skip
            heads = slice(h * 2, h * 2 + 2)
            assert torch.equal(got[:, heads], expect[:, heads])


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged16"])
def test_varlen_matches_float64_truth_and_paged_equals_packed(paged, device, monkeypatch):
    nan_poisoned_outputs(monkeypatch)
    heads_q, heads_kv, dim = 4, 2, 48
    lens_q, lens_k = [5, 33, 0, 40], [9, 33, 6, 70]
    batch = len(lens_q)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=I32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=I32)
    descales = (4.0 / 448 * (0.5 + torch.rand(batch, heads_kv)), 4.0 / 448 * (0.5 + torch.rand(heads_kv)),
                torch.tensor(4.0 / 448))  # fmt: skip
    seq_of_q = torch.repeat_interleave(torch.arange(batch), torch.tensor(lens_q))
    q_rows = descales[0][seq_of_q].repeat_interleave(heads_q // heads_kv, dim=1)[:, :, None]
    q8 = (torch.randn(int(cu_q[-1]), heads_q, dim) / q_rows).clamp(-448, 448).to(E4M3)
    k8 = (torch.randn(int(cu_k[-1]), heads_kv, dim) / descales[1][None, :, None]).clamp(-448, 448).to(E4M3)
    v8 = (torch.randn(int(cu_k[-1]), heads_kv, dim) / descales[2]).clamp(-448, 448).to(E4M3)
    options = dict(is_causal=True, window=(20, 0), softcap=8.0)
    kv, extra = (k8, v8), {}
    if paged:
        page = 16
        pages = [-(-n // page) for n in lens_k]
        table = torch.zeros(batch, max(pages), dtype=I32)
        order = torch.randperm(sum(pages) + 2)[: sum(pages)]
        pool_k = torch.full((sum(pages) + 2, page, heads_kv, dim), float("nan")).to(E4M3)
        pool_v = pool_k.clone()
        i = 0
        for b, n in enumerate(lens_k):
            for c in range(pages[b]):
                rows = slice(int(cu_k[b]) + c * page, int(cu_k[b]) + min(n, (c + 1) * page))
                table[b, c] = order[i]
                pool_k[order[i], : rows.stop - rows.start] = k8[rows]
                pool_v[order[i], : rows.stop - rows.start] = v8[rows]
                i += 1
        kv, extra = (pool_k, pool_v), {"block_table": table.to(device)}
    args = (q8.to(device), *(t.to(device) for t in kv), cu_q.to(device), cu_k.to(device), 40, 70)
    with expect_launches(flash.FORWARD.name, device=device):
        out, lse = flash_attention_varlen(*args, descale_q=descales[0].to(device),
                                          descale_k=descales[1].to(device), descale_v=descales[2].to(device),
                                          return_lse=True, **options, **extra)  # fmt: skip
    assert out.dtype == BF16 and lse.shape == (heads_q, int(cu_q[-1]))
    scale = 1.0 / math.sqrt(dim)
    same, _ = varlen_reference_forward(q8, k8, v8, cu_q, cu_k, scale=scale, descales=descales, **options)
    truth_out, truth_lse, same_lse = [], [], []
    q_dev, k_dev = args[0], k8.to(device)  # the fp8 products of the same-precision LSE on the kernel's device
    for b in range(batch):
        rows_q, rows_k = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        parts = [t[rows].transpose(0, 1)[None] for t, rows in ((q8, rows_q), (k8, rows_k), (v8, rows_k))]
        seq_descales = tuple(d if d.dim() < 2 else d[b : b + 1] for d in descales)
        wide = dequantize_attention_inputs(*parts, seq_descales, torch.float64)
        o, l_ = reference_attention(*wide, scale=scale, return_lse=True, **options)
        truth_out.append(o[0].transpose(0, 1))
        truth_lse.append(l_[0])
        q_b, k_b = (t[rows].transpose(0, 1)[None] for t, rows in ((q_dev, rows_q), (k_dev, rows_k)))
        same_lse.append(_same_precision_lse(q_b, k_b, seq_descales, scale, **options)[0])
    truth, truth_l, same_l = torch.cat(truth_out), torch.cat(truth_lse, 1), torch.cat(same_lse, 1)
    assert_error_rule("out", out, same, truth, OUTPUT_FACTOR, BF16)
    lse_cap = LSE_RELATIVE * truth_l[torch.isfinite(truth_l)].abs().max().item()
    assert_error_rule("lse", lse, same_l, truth_l, OUTPUT_FACTOR, cap=lse_cap)
    if paged:  # the same tiles in the same order: the same bits as packed keys
        packed = flash_attention_varlen(args[0], k8.to(device), v8.to(device), *args[3:],
                                        descale_q=descales[0].to(device), descale_k=descales[1].to(device),
                                        descale_v=descales[2].to(device), **options)  # fmt: skip
        assert torch.equal(out, packed)


def test_quantize_fp8_output_feeds_it(device):
    """quantize_fp8's (x_fp8, scale) pairs are (input, descale) pairs as they are (per tensor here)."""
    q, k, v = (torch.randn(1, 2, 24, 64, device=device) * 3 for _ in range(3))
    (q8, sq), (k8, sk), (v8, sv) = (quantize_fp8(t.reshape(-1, 64)) for t in (q, k, v))
    q8, k8, v8 = (t.view(1, 2, 24, 64) for t in (q8, k8, v8))
    out = flash_attention(q8, k8, v8, descale_q=sq, descale_k=sk, descale_v=sv, is_causal=True)
    cpu = [t.cpu() for t in (q8, k8, v8)]
    descales = (sq.cpu(), sk.cpu(), sv.cpu())
    truth = reference_attention(*dequantize_attention_inputs(*cpu, descales, torch.float64), is_causal=True)
    same, _ = reference_forward(*cpu, is_causal=True, window=None, softcap=None, scale=0.125,
                                descales=descales)  # fmt: skip
    assert_error_rule("out", out, same, truth, OUTPUT_FACTOR, BF16)


def test_pytorch_fallback_rounds_like_the_kernel(monkeypatch):
    """Where Triton cannot run (CPU without the interpreter) the float32 reference answers, with the same
    rounding of the weights: within the 2x rule of the kernel's truth."""
    q, k, v, descales = build(CASES[1], "cpu")
    kernel = flash_attention(q, k, v, descale_q=descales[0], descale_k=descales[1], descale_v=descales[2],
                             is_causal=True)  # fmt: skip
    monkeypatch.setattr(runtime, "triton_runs_on", lambda device: False)
    fallback = flash_attention(q, k, v, descale_q=descales[0], descale_k=descales[1], descale_v=descales[2],
                               is_causal=True)  # fmt: skip
    assert fallback.dtype == BF16
    wide = dequantize_attention_inputs(q, k, v, descales, torch.float64)
    truth = reference_attention(*wide, is_causal=True)
    assert_error_rule("fallback", kernel, fallback, truth, OUTPUT_FACTOR, BF16)


def test_empty_sizes(device):
    q = torch.zeros(0, 2, 5, 32, device=device).to(E4M3)
    k = torch.zeros(0, 2, 7, 32, device=device).to(E4M3)
    assert flash_attention(q, k, k).dtype == BF16
    q = torch.zeros(1, 2, 5, 32, device=device).to(E4M3)
    k = torch.zeros(1, 2, 0, 32, device=device).to(E4M3)
    out, lse = flash_attention(q, k, k, return_lse=True)
    assert out.dtype == BF16 and out.eq(0).all() and lse.eq(float("-inf")).all()


def _fp8_inputs(device, heads_kv=2):
    return (torch.randn(2, 4, 8, 32, device=device).to(E4M3),
            *(torch.randn(2, heads_kv, 8, 32, device=device).to(E4M3) for _ in range(2)))  # fmt: skip


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda q, k, v: dict(q=q.float().to(torch.float8_e5m2), k=k.float().to(torch.float8_e5m2),
                              v=v.float().to(torch.float8_e5m2)),
         TypeError, r"q has dtype torch.float8_e5m2; accepted \(fp8 attention.*\): float8_e4m3fn"),
        (lambda q, k, v: dict(k=k.to(BF16)), TypeError, "k has dtype torch.bfloat16; accepted"),
        (lambda q, k, v: dict(q=q.to(BF16)), TypeError,
         "k has dtype torch.float8_e4m3fn, q torch.bfloat16: fp8 attention takes q, k and v all"),
        (lambda q, k, v: dict(q=q.to(BF16), k=k.to(BF16), v=v.to(BF16), descale_q=torch.ones(())),
         TypeError, "q has dtype torch.bfloat16; accepted"),
        (lambda q, k, v: dict(descale_k=torch.ones(3)), ValueError, r"descale_k must be \[\] or \[1\]"),
        (lambda q, k, v: dict(descale_v=torch.ones(2, dtype=torch.float16)), TypeError,
         "descale_v must be float32"),
        (lambda q, k, v: dict(descale_q=1.0), TypeError, "descale_q must be a torch.Tensor"),
        (lambda q, k, v: dict(dropout_p=0.1), ValueError, "forward-only .*dropout_p must be 0"),
        (lambda q, k, v: dict(descale_q=torch.ones((), device=q.device, requires_grad=True)), ValueError,
         r"forward-only .*torch.no_grad\(\)"),
    ],
    ids=["e5m2", "mixed-k", "mixed-q", "16bit-with-descale", "descale-shape", "descale-dtype",
         "descale-float", "dropout", "requires-grad"],
)  # fmt: skip
def test_bad_arguments_raise_before_any_work(change, error, match, device):
    q, k, v = _fp8_inputs(device)
    call = dict(q=q, k=k, v=v)
    # (a descale that requires grad is made on q's device: a CPU one would fail the device check first)
    call.update({n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in change(q, k, v).items()})
    before = runtime.launch_count(flash.FORWARD.name)
    with pytest.raises(error, match=match):
        flash_attention(**call)
    assert runtime.launch_count(flash.FORWARD.name) == before


def test_descale_values_are_checked_where_values_are(device, monkeypatch):
    # The check reads the descales on the host: on for every device here (CUDA's default is off; then the
    # kernel writes NaN rows: test_unchecked_bad_descales_give_nan_rows_only_where_they_scale).
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)
    q, k, v = _fp8_inputs(device)
    bad = torch.tensor([0.1, -1.0], device=device)
    with pytest.raises(ValueError, match="descale_k must be finite and > 0, got -1.0"):
        flash_attention(q, k, v, descale_k=bad)
    cu = torch.tensor([0, 8, 16], dtype=I32, device=device)
    packed_q, packed_kv = q.reshape(16, 4, 32), k.reshape(16, 2, 32)
    with pytest.raises(ValueError, match="descale_v must be finite and > 0, got nan"):
        flash_attention_varlen(packed_q, packed_kv, packed_kv, cu, cu, 8, 8,
                               descale_v=torch.tensor(float("nan"), device=device))  # fmt: skip


def test_unchecked_bad_descales_give_nan_rows_only_where_they_scale(device, monkeypatch):
    """Value checks off (CUDA's default): a descale of (sequence 1, KV head 0) that is not finite and > 0
    makes NaN the rows of that sequence's query heads 0 and 1 (output and LSE), dense and packed; every other
    row is exactly the call's with good descales."""
    if not runtime.triton_runs_on(device):
        pytest.skip("Triton cannot run on this device (CPU without TRITON_INTERPRET=1)")
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    q, k, v = _fp8_inputs(device)  # batch 2, heads 4 over 2 KV heads, seq 8
    good = torch.tensor([[0.01, 0.02], [0.03, 0.04]], device=device)
    nan = torch.zeros(2, 4, dtype=torch.bool, device=device)
    nan[1, :2] = True
    cu = torch.tensor([0, 8, 16], dtype=I32, device=device)
    packed = (q.transpose(1, 2).reshape(16, 4, 32), *(t.transpose(1, 2).reshape(16, 2, 32) for t in (k, v)))
    want, want_lse = flash_attention(q, k, v, return_lse=True, **dict.fromkeys(DESCALE_NAMES, good))
    for name, bad in zip((*DESCALE_NAMES, "descale_q"), (float("nan"), -1.0, 0.0, float("inf")), strict=True):
        spoilt = good.clone()
        spoilt[1, 0] = bad
        descales = {**dict.fromkeys(DESCALE_NAMES, good), name: spoilt}
        out, lse = flash_attention(q, k, v, return_lse=True, **descales)
        assert out[nan].isnan().all() and lse[nan].isnan().all(), name
        assert torch.equal(out[~nan], want[~nan]) and torch.equal(lse[~nan], want_lse[~nan]), name
        got, got_lse = flash_attention_varlen(*packed, cu, cu, 8, 8, return_lse=True, **descales)
        assert torch.equal(got.reshape(2, 8, 4, 32).transpose(1, 2).isnan().all(-1).all(-1), nan), name
        assert torch.equal(got_lse.reshape(4, 2, 8).transpose(0, 1).isnan().all(-1), nan), name


def test_no_grad_mode_accepts_inputs_that_require_grad(device):
    q, k, v = _fp8_inputs(device)
    descale = torch.ones((), device=device, requires_grad=True)
    with torch.no_grad():
        out = flash_attention(q, k, v, descale_q=descale)
    assert out.dtype == BF16 and not out.requires_grad


def test_opcheck_and_torch_compile(device):
    q, k, v = _fp8_inputs(device)
    descale = torch.full((2,), 0.5, device=device)
    args = (q, k, v, descale, None, descale, True, 0.2)
    # (opcheck's schema test multiplies the inputs, which torch has no fp8 kernel for on the CPU)
    torch.library.opcheck(torch.ops.llm_speed.flash_attention_fp8_forward.default, args,
                          test_utils=("test_faketensor",))  # fmt: skip
    torch._dynamo.reset()

    def call(q, k, v, descale):
        return flash_attention(q, k, v, descale_q=descale, descale_v=descale, is_causal=True, scale=0.2)

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    with expect_launches(flash.FORWARD.name, device=device):
        got = compiled(q, k, v, descale)
    assert torch.equal(got, call(q, k, v, descale))


def test_flash_attn_interface_takes_flashattention3_descales(device):
    """flash_attn_func / flash_attn_varlen_func with FlashAttention-3's q_descale, k_descale, v_descale
    ([batch, heads_k]) on [batch, seq, heads, dim] tensors: the same bits as flash_attention."""
    from llm_speed.flash_attn_interface import flash_attn_func, flash_attn_varlen_func

    q, k, v = (torch.randn(2, 19, h, 32).mul(20).to(E4M3).to(device) for h in (4, 2, 2))
    descales = [torch.rand(2, 2, device=device) * 0.1 + 0.01 for _ in range(3)]
    out = flash_attn_func(q, k, v, causal=True, q_descale=descales[0], k_descale=descales[1],
                          v_descale=descales[2])  # fmt: skip
    want = flash_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                           descale_q=descales[0], descale_k=descales[1], descale_v=descales[2])  # fmt: skip
    assert out.dtype == BF16 and torch.equal(out, want.transpose(1, 2))
    cu = torch.tensor([0, 19, 38], dtype=I32, device=device)
    packed = flash_attn_varlen_func(q.reshape(38, 4, 32), k.reshape(38, 2, 32), v.reshape(38, 2, 32), cu, cu,
                                    19, 19, causal=True, q_descale=descales[0], k_descale=descales[1],
                                    v_descale=descales[2])  # fmt: skip
    assert torch.equal(packed, out.reshape(38, 4, 32))
