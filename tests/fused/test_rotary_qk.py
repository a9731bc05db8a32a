"""apply_rotary_qk: Hugging Face's apply_rotary_pos_emb (and DeepSeek's interleaved variant) for q and k in
one launch: float64 truth (2x/3x), both layouts, GQA, partial rotary dims, cos/sin layouts, position ids,
registration, bad input."""

import contextlib

import pytest
import torch
from fused_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, leaves

import llm_speed.fused.rotary_qk as rotary_qk_module
from llm_speed import apply_rotary_qk
from llm_speed.core import runtime
from llm_speed.fused.reference import apply_rotary_qk_reference

KERNEL = rotary_qk_module.KERNEL.name


def _hf_rotary(q, k, cos, sin, unsqueeze_dim, interleaved):
    """Hugging Face's own code (transformers' Phi-3 apply_rotary_pos_emb with partial rotary, and
    DeepSeek-V3's apply_rotary_pos_emb_interleave), written out here as the independent spec."""
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if interleaved:
        c = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
        s = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
        return tuple(torch.cat([x[..., 0::2] * c - x[..., 1::2] * s, x[..., 1::2] * c + x[..., 0::2] * s], -1)
                     for x in (q, k))  # fmt: skip
    c, s = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    d = c.shape[-1]

    def rotate_half(x):
        return torch.cat((-x[..., d // 2 :], x[..., : d // 2]), -1)

    return tuple(torch.cat([x[..., :d] * c + rotate_half(x[..., :d]) * s, x[..., d:]], -1) for x in (q, k))


def _cos_sin(batch, seq, rotary_dim, base=10000.0):
    """Hugging Face's cos/sin: cat(freqs, freqs) of (position + per-sequence offset) * inv_freq, [b, s, d]."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    pos = torch.arange(seq, dtype=torch.float64) + torch.randint(0, 50, (batch, 1)).double()
    freqs = pos[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos(), emb.sin()


CASES = [  # batch, heads_q, heads_k, seq, head_dim, rotary_dim, unsqueeze_dim, interleaved, cos batch
    (1, 1, 1, 1, 8, 8, 1, False, 1),
    (2, 4, 2, 7, 40, 40, 1, False, 2),
    (2, 3, 1, 5, 96, 32, 2, False, 1),  # partial rotary (Phi-3), [b, s, h, d], cos batch broadcast
    (1, 2, 1, 9, 64, 64, 1, True, 1),  # DeepSeek's interleaved pairs, one shared rotary key head
    (3, 2, 2, 17, 72, 72, 2, False, 0),  # cos [seq, d]
]


def _qk(case, dtype, device):
    batch, hq, hk, seq, head_dim, *_ = case
    unsqueeze_dim = case[6]

    def make(heads):
        # strided: a view of a wider projection, the way attention modules slice q, k
        shape = (batch, heads, seq, head_dim + 8) if unsqueeze_dim == 1 else (batch, seq, heads, head_dim + 8)
        return (torch.randn(shape) * 3).to(dtype).to(device)[..., 8:]

    return make(hq), make(hk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_accuracy_against_hugging_faces_formula(case, dtype, device):
    batch, _, _, seq, _, rotary_dim, unsqueeze_dim, interleaved, cos_batch = case
    q, k = _qk(case, dtype, device)
    cos, sin = _cos_sin(max(cos_batch, 1), seq, rotary_dim)
    if cos_batch == 0:
        cos, sin = cos[0], sin[0]
    dq, dk = torch.randn(q.shape).to(dtype), torch.randn(k.shape).to(dtype)
    kw = dict(unsqueeze_dim=unsqueeze_dim, interleaved=interleaved)
    results = []
    for fn, inputs, c, s in (
        (apply_rotary_qk_reference, leaves(q, k, dtype=torch.float64), cos, sin),
        (apply_rotary_qk_reference, leaves(q, k), cos.float().to(device), sin.float().to(device)),
        (apply_rotary_qk, leaves(q, k), cos.float().to(device), sin.float().to(device)),
    ):
        with expect_launches(KERNEL, device=device) if fn is apply_rotary_qk else contextlib.nullcontext():
            oq, ok = fn(*inputs, c, s, **kw)
            ((oq.double() * dq.to(oq.device).double()).sum() + (ok.double() * dk.to(ok.device).double()).sum()
             ).backward()  # fmt: skip
        results.append((oq.detach(), ok.detach(), inputs[0].grad, inputs[1].grad))
    truth, same, got = results
    assert got[0].dtype == dtype and got[0].shape == q.shape and got[0].is_contiguous()
    assert got[1].shape == k.shape
    hf = _hf_rotary(q.double().cpu(), k.double().cpu(), cos, sin, unsqueeze_dim, interleaved)
    torch.testing.assert_close(truth[:2], hf, rtol=1e-12, atol=1e-12)
    for i, name in enumerate(("q_embed", "k_embed", "dq", "dk")):
        factor = OUTPUT_FACTOR if i < 2 else GRAD_FACTOR
        assert_error_rule(name, got[i], same[i], truth[i], factor, dtype, scale=3.0)
    if not interleaved and rotary_dim < q.shape[-1]:  # the pass-through dims are copied exactly
        assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])


def test_cos_sin_whose_halves_differ_follow_hugging_faces_formula(device):
    # both halves of cos and sin are read: any cos/sin gives x * cos + rotate_half(x) * sin
    q, k = torch.randn(1, 2, 4, 16, device=device), torch.randn(1, 1, 4, 16, device=device)
    cos, sin = torch.randn(1, 4, 16, device=device), torch.randn(1, 4, 16, device=device)
    got = apply_rotary_qk(q, k, cos, sin)
    expected = _hf_rotary(q, k, cos, sin, 1, False)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def test_position_ids_gather_a_table_in_the_kernel(monkeypatch, device):
    table = 40
    inv = 10000.0 ** (-torch.arange(0, 8, 2) / 8)
    emb = torch.arange(table)[:, None] * inv
    emb = torch.cat((emb, emb), -1)
    cos, sin = emb.cos().to(device), emb.sin().to(device)
    q, k = torch.randn(2, 3, 6, 8, device=device), torch.randn(2, 1, 6, 8, device=device)
    position_ids = torch.randint(0, table, (2, 6), device=device)
    with expect_launches(KERNEL, device=device):
        got = apply_rotary_qk(q, k, cos, sin, position_ids=position_ids)
    expected = _hf_rotary(q, k, cos[position_ids], sin[position_ids], 1, False)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    # per-position cos/sin (Hugging Face today): position_ids unused, as in Hugging Face
    per_position = cos[position_ids], sin[position_ids]
    torch.testing.assert_close(apply_rotary_qk(q, k, *per_position, position_ids=position_ids), expected)
    bad = position_ids.clone()
    bad[1, 4] = table
    monkeypatch.setattr(runtime, "CHECK_INPUTS", True)  # checked (CPU tensors' default), on every device
    before = runtime.launch_counts()
    with pytest.raises(ValueError, match=f"position_ids holds {table}"):
        apply_rotary_qk(q, k, cos, sin, position_ids=bad)
    assert runtime.launch_counts() == before  # before any work
    # unchecked (CUDA tensors' default): the rows of an id past either end turn NaN, the others are right
    monkeypatch.setattr(runtime, "CHECK_INPUTS", False)
    bad[0, 2] = -3
    with expect_launches(KERNEL, device=device):
        oq, ok = apply_rotary_qk(q, k, cos, sin, position_ids=bad)
    rows = torch.zeros(2, 6, dtype=torch.bool, device=device)
    rows[1, 4] = rows[0, 2] = True
    for got, want in ((oq, expected[0]), (ok, expected[1])):
        got, want = got.transpose(1, 2), want.transpose(1, 2)  # [batch, seq, heads, d]
        assert torch.isnan(got[rows]).all()
        torch.testing.assert_close(got[~rows], want[~rows], rtol=1e-6, atol=1e-6)


def test_one_output_unused_and_empty(device):
    q = torch.randn(1, 2, 3, 8, device=device, requires_grad=True)
    k = torch.randn(1, 1, 3, 8, device=device, requires_grad=True)
    cos, sin = (t.float().to(device) for t in _cos_sin(1, 3, 8))
    oq, _ = apply_rotary_qk(q, k, cos, sin)
    oq.sum().backward()
    assert torch.equal(k.grad, torch.zeros_like(k)) and q.grad is not None
    empty = torch.randn(0, 2, 3, 8, device=device)
    assert apply_rotary_qk(empty, empty[:, :1], cos[:0], sin[:0])[0].shape == empty.shape


def test_opcheck_and_compile_fullgraph(device):
    q = torch.randn(2, 2, 5, 24, device=device, requires_grad=True)
    k = torch.randn(2, 1, 5, 24, device=device, requires_grad=True)
    cos, sin = (t.float().to(device) for t in _cos_sin(2, 5, 16))
    for interleaved in (False, True):
        args = (q, k, cos, sin, None, 1, interleaved)
        torch.library.opcheck(torch.ops.llm_speed.rotary_qk_forward.default, args)
        torch.library.opcheck(
            torch.ops.llm_speed.rotary_qk_backward.default, (q.detach(), k.detach(), *args[2:])
        )
    positions = torch.randint(0, 5, (5,), device=device)
    torch.library.opcheck(
        torch.ops.llm_speed.rotary_qk_forward.default, (q, k, cos[0], sin[0], positions, 1, False)
    )
    torch._dynamo.reset()

    def loss(a, b):
        oq, ok = apply_rotary_qk(a, b, cos, sin)
        return oq.square().sum() + ok.sum()

    with expect_launches(KERNEL, device=device):
        torch.compile(loss, fullgraph=True, backend="aot_eager")(q, k).backward()
    grads = q.grad.clone(), k.grad.clone()
    q.grad = k.grad = None
    loss(q, k).backward()
    torch.testing.assert_close(grads, (q.grad, k.grad), rtol=0, atol=0)


def _bad(**changes):
    args = dict(q=torch.ones(1, 2, 3, 8), k=torch.ones(1, 1, 3, 8), cos=torch.ones(1, 3, 8),
                sin=torch.ones(1, 3, 8))  # fmt: skip
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (_bad(q=torch.ones(2, 3, 8)), ValueError, r"q must have 4 dims"),
        (_bad(k=torch.ones(1, 1, 3, 8, dtype=torch.float16)), TypeError, "q and k must share one dtype"),
        (_bad(k=torch.ones(1, 1, 4, 8)), ValueError, "must agree in batch, sequence"),
        (_bad(sin=torch.ones(1, 3, 6)), ValueError, "same shape"),
        (_bad(cos=torch.ones(1, 3, 7), sin=torch.ones(1, 3, 7)), ValueError, "an even number from 2"),
        (_bad(cos=torch.ones(1, 3, 10), sin=torch.ones(1, 3, 10)), ValueError, r"head_dim \(8\)"),
        (_bad(cos=torch.ones(2, 3, 8), sin=torch.ones(2, 3, 8)), ValueError, r"\[batch or 1, seq"),
        (_bad(cos=torch.ones(4, 8), sin=torch.ones(4, 8)), ValueError, "cover 4 positions"),
        (_bad(unsqueeze_dim=3), ValueError, "unsqueeze_dim is 3"),
        # True == 1: check_choice's `in` accepted it (and 1.0) as 1
        (_bad(unsqueeze_dim=True), TypeError, r"unsqueeze_dim must be an int \(1 or 2\), got bool"),
        (_bad(unsqueeze_dim=1.0), TypeError, r"unsqueeze_dim must be an int \(1 or 2\), got float"),
        (_bad(interleaved=1), TypeError, "interleaved must be a bool"),
        (_bad(cos=torch.ones(9, 8), sin=torch.ones(9, 8), position_ids=torch.ones(2, 3, dtype=torch.int64)),
         ValueError, r"position_ids has shape \(2, 3\)"),
        (_bad(cos=torch.ones(9, 8), sin=torch.ones(9, 8), position_ids=torch.ones(3)), TypeError,
         "position_ids has dtype"),
        (_bad(cos=torch.ones(1, 3, 8, requires_grad=True)), ValueError, "no gradient"),
    ],
)
def test_bad_input(args, error, match):
    q, k, cos, sin = (args.pop(name) for name in ("q", "k", "cos", "sin"))
    with pytest.raises(error, match=match):
        apply_rotary_qk(q, k, cos, sin, **args)


def test_a_repeated_call_skips_the_checks(device, monkeypatch):
    """A repeated call with Hugging Face's per-position cos/sin and the metadata of one checked before
    launches the kept plan: in inference directly, with grad inside the op's autograd node; the same outputs
    and gradients, as float64 says; cos that requires grad is still refused."""
    from call_records import record_checks

    checked = record_checks(monkeypatch, device, rotary_qk_module, "_validate")
    q = torch.randn(2, 4, 9, 32, device=device, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 9, 32, device=device, dtype=torch.bfloat16)
    cos, sin = (torch.randn(2, 9, 32, device=device, dtype=torch.bfloat16) for _ in range(2))
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    with torch.no_grad():
        first = apply_rotary_qk(q, k, cos, sin)
        with expect_launches(rotary_qk_module.KERNEL.name, device=device):
            again = apply_rotary_qk(q.clone(), k.clone(), cos, sin)
    results = []
    for _ in range(2):
        lq, lk = leaves(q, k)
        oq, ok = apply_rotary_qk(lq, lk, cos, sin)
        torch.autograd.backward((oq, ok), (dq, dk))
        results.append((oq.detach(), ok.detach(), lq.grad, lk.grad))
    assert len(checked) == 1  # the first call: the others (with grad too: the same launch) were kept
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    q64, k64 = leaves(q, k, dtype=torch.float64)
    truth = apply_rotary_qk_reference(q64, k64, cos.cpu().double(), sin.cpu().double())  # (leaves: CPU)
    torch.autograd.backward(truth, (dq.cpu().double(), dk.cpu().double()))
    same = apply_rotary_qk_reference(q, k, cos, sin)
    for i, name in enumerate(("q", "k")):
        assert_error_rule(name, results[1][i], same[i], truth[i], OUTPUT_FACTOR, torch.bfloat16)
    assert (results[1][2].cpu().double() - q64.grad).abs().max() <= 2e-2 * q64.grad.abs().max()
    with pytest.raises(ValueError, match="cos and sin get no gradient"):
        apply_rotary_qk(q, k, cos.clone().requires_grad_(), sin)
