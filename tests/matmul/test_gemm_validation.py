"""Bad input: each error is a ValueError/TypeError naming the argument; a passing case at each boundary."""

import numpy as np
import pytest
import torch

import llm_speed


def f32(*shape):
    return torch.randn(*shape)


A, B = f32(4, 6), f32(6, 5)

BAD_GEMM_CALLS = [
    # (description, args, kwargs, error type, text the message must contain)
    ("a not a tensor", ([[1.0]], B), {}, TypeError, "a must be a torch.Tensor"),
    ("a rank 1", (f32(6), B), {}, ValueError, "a must be 2-D"),
    ("b rank 4", (A, f32(1, 1, 6, 5)), {}, ValueError, "b must be 2-D"),
    (
        "a unsupported dtype",
        (A.double(), B.double()),
        {},
        TypeError,
        "a has dtype torch.float64; accepted: float16, bfloat16, float32",
    ),
    ("b int8 in gemm", (A, torch.ones(6, 5, dtype=torch.int8)), {}, TypeError, "b has dtype torch.int8"),
    ("dtype mismatch", (A, B.half()), {}, TypeError, "a and b must have the same dtype"),
    ("inner dims", (A, f32(5, 5)), {}, ValueError, "op(a) has shape (4, 6) and op(b) has shape (5, 5)"),
    ("inner dims after trans_a", (A, B), {"trans_a": True}, ValueError, "op(a) has shape (6, 4)"),
    ("inner dims after trans_b", (A, B), {"trans_b": True}, ValueError, "op(b) has shape (5, 6)"),
    ("batch mismatch", (f32(2, 4, 6), f32(3, 6, 5)), {}, ValueError, "batch dimensions of a and b"),
    ("trans flag not bool", (A, B), {"trans_a": 1}, TypeError, "trans_a must be a bool"),
    ("trans flag a string", (A, B), {"trans_b": "no"}, TypeError, "trans_b must be a bool (True or False)"),
    ("trans flag numpy int", (A, B), {"trans_a": np.int64(0)}, TypeError, "got numpy.int64"),
    ("beta without c", (A, B), {"beta": 0.5}, ValueError, "c is required when beta != 0"),
    (
        "c wrong shape",
        (A, B),
        {"beta": 1.0, "c": f32(5, 4)},
        ValueError,
        "c must have the output shape (4, 5)",
    ),
    (
        "c bigger than out",
        (A, B),
        {"beta": 1.0, "c": f32(2, 4, 5)},
        ValueError,
        "c must have the output shape",
    ),
    (
        "c int dtype",
        (A, B),
        {"beta": 1.0, "c": torch.ones(4, 5, dtype=torch.int32)},
        TypeError,
        "c has dtype torch.int32; accepted",
    ),
    ("bias wrong length", (A, B), {"bias": f32(4)}, ValueError, "bias must have shape (N,) = (5,)"),
    ("bias 2-D", (A, B), {"bias": f32(1, 5)}, ValueError, "bias must have shape"),
    ("bias not tensor", (A, B), {"bias": [0.0] * 5}, TypeError, "bias must be a torch.Tensor"),
    (
        "unknown activation",
        (A, B),
        {"activation": "tanh"},
        ValueError,
        "activation is 'tanh'; accepted: None",
    ),
    ("out_dtype int", (A, B), {"out_dtype": torch.int32}, TypeError, "out_dtype must be None or one of"),
    ("alpha not a number", (A, B), {"alpha": "2"}, TypeError, "alpha must be a real number"),
    ("beta bool", (A, B), {"beta": True, "c": f32(4, 5)}, TypeError, "beta must be a real number"),
]


@pytest.mark.parametrize(
    "description, args, kwargs, error, text", BAD_GEMM_CALLS, ids=[c[0] for c in BAD_GEMM_CALLS]
)
def test_bad_gemm_input(description, args, kwargs, error, text):
    with pytest.raises(error) as info:
        llm_speed.gemm(*args, **kwargs)
    assert text in str(info.value)


def test_different_devices_are_refused():
    meta_b = torch.empty(6, 5, device="meta")
    with pytest.raises(ValueError, match="a, b must be on one device, got a cpu, b meta"):
        llm_speed.gemm(A, meta_b)
    with pytest.raises(ValueError, match="a, bias must be on one device"):
        llm_speed.gemm(A, B, bias=torch.empty(5, device="meta"))
    with pytest.raises(ValueError, match="a, c must be on one device"):
        llm_speed.gemm(A, B, beta=1.0, c=torch.empty(4, 5, device="meta"))


BOUNDARY_CALLS = [
    # Accepted cases right next to the refused ones above.
    ("rank 3 both", (f32(2, 4, 6), f32(2, 6, 5)), {}),
    ("batch 1 broadcasts", (f32(1, 4, 6), f32(3, 6, 5)), {}),
    ("K = 1", (f32(4, 1), f32(1, 5)), {}),
    ("beta 0 without c", (A, B), {"beta": 0.0}),
    ("integer beta with c", (A, B), {"beta": 1, "c": f32(4, 5)}),
    ("c broadcast [N]", (A, B), {"beta": 1.0, "c": f32(5)}),
    ("c of another float dtype", (A, B), {"beta": 1.0, "c": f32(4, 5).half()}),
    ("bias of length N in bf16", (A, B), {"bias": f32(5).bfloat16()}),
    ("every activation name", (A, B), {"activation": "gelu_tanh"}),
    ("out_dtype bf16", (A, B), {"out_dtype": torch.bfloat16}),
    ("numpy bool flags", (A, B.mT), {"trans_a": np.bool_(False), "trans_b": np.bool_(True)}),
]


@pytest.mark.parametrize("description, args, kwargs", BOUNDARY_CALLS, ids=[c[0] for c in BOUNDARY_CALLS])
def test_boundary_cases_pass(description, args, kwargs):
    out = llm_speed.gemm(*args, **kwargs)
    assert out.isfinite().all()


def test_validate_gemm_inputs_returns_the_problem_size():
    shape = llm_speed.validate_gemm_inputs(f32(3, 6, 4), f32(5, 6), trans_a=True, trans_b=True)
    assert (shape.batch, shape.m, shape.n, shape.k) == (3, 4, 5, 6)
    assert shape.out_shape == (3, 4, 5)
    assert llm_speed.validate_gemm_inputs(A, B).out_shape == (4, 5)
    with pytest.raises(ValueError, match="inner dimensions"):
        llm_speed.validate_gemm_inputs(A, A)


def test_tensor_core_gemm_dtypes():
    with pytest.raises(TypeError, match=r"a has dtype torch.float32; accepted: float16, bfloat16$"):
        llm_speed.tensor_core_gemm(A, B)
    with pytest.raises(ValueError, match="c is required"):
        llm_speed.tensor_core_gemm(A.half(), B.half(), beta=1.0)
    assert llm_speed.tensor_core_gemm(A.bfloat16(), B.bfloat16()).dtype == torch.float32


def test_int8_gemm_bad_input():
    a8, b8 = torch.ones(4, 6, dtype=torch.int8), torch.ones(6, 5, dtype=torch.int8)
    with pytest.raises(TypeError, match=r"a has dtype torch.float32; accepted: int8$"):
        llm_speed.tensor_core_gemm_int8(A, b8)
    with pytest.raises(TypeError, match="b has dtype torch.uint8; accepted: int8"):
        llm_speed.tensor_core_gemm_int8(a8, b8.to(torch.uint8))
    with pytest.raises(ValueError, match="inner dimensions"):
        llm_speed.tensor_core_gemm_int8(a8, a8)
    with pytest.raises(ValueError, match="a must be 2-D"):
        llm_speed.tensor_core_gemm_int8(a8[0], b8)
    assert torch.equal(llm_speed.tensor_core_gemm_int8(a8, b8), torch.full((4, 5), 6, dtype=torch.int32))
