"""apply_rotary: both pairings, partial rotary_dim, cos/sin layouts, strides, registration, bad input."""

import contextlib

import pytest
import torch
from fused_testing import DTYPES, GRAD_FACTOR, OUTPUT_FACTOR, assert_error_rule, expect_launches, leaves

import llm_speed.fused.rotary as rotary_module
from llm_speed import apply_rotary
from llm_speed.fused.reference import apply_rotary_reference

ROTARY = rotary_module.KERNEL.name


def _angles(cos_batch, seq, half, base=10000.0):
    """RoPE cos, sin of position * base^(-2i / rotary_dim): [seq, half] or [cos_batch, seq, half]."""
    pos = torch.arange(seq, dtype=torch.float64)
    if cos_batch:
        pos = pos + torch.randint(0, 50, (cos_batch, 1)).double()  # per-sequence offsets, as with a KV cache
    theta = pos[..., None] * base ** (-torch.arange(half, dtype=torch.float64) / half)
    return theta.cos().float(), theta.sin().float()


def _rotate_half_independent(x, cos, sin, interleaved):
    """The textbook form: x * cos + rotate(x) * sin on the rotary dims, cos/sin repeated to full width."""
    half = cos.shape[-1]
    c, s = (cos if cos.dim() == 3 else cos[None])[:, None], (sin if sin.dim() == 3 else sin[None])[:, None]
    rot, rest = x[..., : 2 * half], x[..., 2 * half :]
    if interleaved:
        c, s = c.repeat_interleave(2, -1), s.repeat_interleave(2, -1)
        turned = torch.stack((-rot[..., 1::2], rot[..., 0::2]), -1).flatten(-2)
    else:
        c, s = torch.cat((c, c), -1), torch.cat((s, s), -1)
        turned = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return torch.cat((rot * c + turned * s, rest), -1)


CASES = [  # batch, heads, seq, head_dim, rotary_dim, interleaved, cos batch (0: 2-D cos)
    (1, 1, 1, 8, 8, False, 0),
    (2, 3, 7, 40, 24, False, 2),
    (1, 2, 9, 72, 72, True, 0),
    (2, 1, 5, 48, 18, True, 1),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_accuracy(case, dtype, device):
    batch, heads, seq, head_dim, rotary_dim, interleaved, cos_batch = case
    # [B, S, H, D] viewed as [B, H, S, D]: strided read, no copy
    x = torch.randn(batch, seq, heads, head_dim).mul(3).to(dtype).to(device).transpose(1, 2)
    cos, sin = (t.to(device) for t in _angles(cos_batch, seq, rotary_dim // 2))
    dout = torch.randn(x.shape).to(dtype).to(device)
    results = []
    for fn, x_in in (
        (apply_rotary_reference, leaves(x, dtype=torch.float64)[0]),
        (apply_rotary_reference, leaves(x)[0]),
        (apply_rotary, leaves(x)[0]),
    ):
        c, s = (cos.double().cpu(), sin.double().cpu()) if x_in.dtype == torch.float64 else (cos, sin)
        with expect_launches(ROTARY, device=device) if fn is apply_rotary else contextlib.nullcontext():
            out = fn(x_in, c, s, interleaved=interleaved)
            (out.double() * dout.to(out.device).double()).sum().backward()
        results.append((out.detach(), x_in.grad))
    truth, same, got = results
    assert got[0].dtype == dtype and got[0].shape == x.shape and got[0].is_contiguous()
    assert_error_rule("out", got[0], same[0], truth[0], OUTPUT_FACTOR, dtype, scale=3.0)
    assert_error_rule("dx", got[1], same[1], truth[1], GRAD_FACTOR, dtype, scale=3.0)
    independent = _rotate_half_independent(
        x.double().cpu(), cos.double().cpu(), sin.double().cpu(), interleaved
    )
    torch.testing.assert_close(truth[0], independent, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0][..., rotary_dim:], x[..., rotary_dim:], rtol=0, atol=0)


def test_empty_and_mixed_strides(device):
    x = torch.randn(1, 2, 3, 16, device=device)
    cos, sin = (t.to(device) for t in _angles(0, 3, 4))
    sin_strided = torch.stack((sin, sin), -1)[..., 0]  # same values, other strides than cos
    torch.testing.assert_close(apply_rotary(x, cos, sin_strided), apply_rotary_reference(x, cos, sin))
    empty = torch.randn(0, 2, 3, 16, device=device)
    assert apply_rotary(empty, cos, sin).shape == empty.shape


def test_opcheck_and_compile_fullgraph(device):
    x = torch.randn(2, 2, 5, 24, device=device, requires_grad=True)
    cos, sin = (t.to(device) for t in _angles(2, 5, 8))
    torch.library.opcheck(torch.ops.llm_speed.rotary.default, (x, cos, sin, True, False))
    torch._dynamo.reset()
    compiled = torch.compile(
        lambda a, c, s: apply_rotary(a, c, s).square().sum(), fullgraph=True, backend="aot_eager"
    )
    with expect_launches(ROTARY, device=device):
        compiled(x, cos, sin).backward()
    grad = x.grad.clone()
    x.grad = None
    apply_rotary(x, cos, sin).square().sum().backward()
    torch.testing.assert_close(grad, x.grad, rtol=0, atol=0)


def _bad(**changes):
    args = dict(x=torch.ones(1, 2, 3, 8), cos=torch.ones(3, 4), sin=torch.ones(3, 4), interleaved=False)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (_bad(x=torch.ones(2, 3, 8)), ValueError, r"x must have 4 dims"),
        (_bad(x=torch.ones(1, 2, 3, 8, dtype=torch.int32)), TypeError, "x has dtype"),
        (_bad(cos=torch.ones(3, 4, dtype=torch.float64)), TypeError, "cos has dtype"),
        (_bad(sin=torch.ones(3, 3)), ValueError, "same shape"),
        (_bad(cos=torch.ones(4, 4), sin=torch.ones(4, 4)), ValueError, "cover 4 positions"),
        (_bad(cos=torch.ones(3, 5), sin=torch.ones(3, 5)), ValueError, "rotary_dim"),
        (_bad(cos=torch.ones(2, 3, 4), sin=torch.ones(2, 3, 4)), ValueError, "batch"),
        (_bad(cos=torch.ones(3), sin=torch.ones(3)), ValueError, r"\[seq, rotary_dim // 2\]"),
        (_bad(interleaved=1), TypeError, "interleaved must be a bool"),
        (_bad(cos=torch.ones(3, 4, requires_grad=True)), ValueError, "no gradient"),
    ],
)
def test_bad_input(args, error, match):
    x, cos, sin, interleaved = args["x"], args["cos"], args["sin"], args["interleaved"]
    with pytest.raises(error, match=match):
        apply_rotary(x, cos, sin, interleaved=interleaved)
