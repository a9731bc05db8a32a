"""The shared argument checks of the performance model and the kernels."""

import math

import numpy as np
import pytest

from llm_speed.core.args import check_flag, non_negative_number, positive_int, type_name
from llm_speed.perf._checks import attention_shape, divisors_text


def test_positive_int():
    assert positive_int("n", 3) == 3
    assert positive_int("n", np.int64(4)) == 4 and type(positive_int("n", np.int64(4))) is int
    assert positive_int("n", 0, allow_zero=True) == 0
    with pytest.raises(ValueError, match="n must be a positive int, got 0"):
        positive_int("n", 0)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        positive_int("n", -1, allow_zero=True)
    for bad in (2.0, True, "3", None):
        with pytest.raises(TypeError, match="n must be an int"):
            positive_int("n", bad)


def test_non_negative_number():
    assert non_negative_number("x", 0) == 0.0 and non_negative_number("x", np.float32(1.5)) == 1.5
    for bad in (-1, math.nan, math.inf):
        with pytest.raises(ValueError, match="x must be a finite number >= 0"):
            non_negative_number("x", bad)
    for bad in (False, "1", None):
        with pytest.raises(TypeError, match="x must be a number"):
            non_negative_number("x", bad)


def test_attention_shape_and_divisors():
    assert attention_shape(1, 8, 4, 6, 64, None) == (1, 8, 4, 6, 64, 8)
    assert attention_shape(1, 8, 4, 6, 64, 2)[-1] == 2
    assert divisors_text(12) == "1, 2, 3, 4, 6, 12"
    with pytest.raises(ValueError, match="valid heads_kv: 1, 2, 3, 4, 6, 12"):
        attention_shape(1, 12, 4, 4, 64, 5)


def test_check_flag_takes_bools_and_numpy_bools_only():
    for value in (True, False, np.bool_(True), np.False_):
        assert check_flag("f", value) is bool(value)
    for bad, shown in ((1, "int 1"), (0.0, "float 0.0"), ("no", "str 'no'"), (None, "NoneType None"),
                       (np.int64(1), "numpy.int64")):  # fmt: skip
        with pytest.raises(TypeError) as info:
            check_flag("f", bad)
        assert str(info.value).startswith(f"f must be a bool (True or False) or a numpy.bool_, got {shown}")


def test_check_flag_refuses_tensors_with_a_hint():
    torch = pytest.importorskip("torch", reason="needs torch (a dependency of llm-speed)")
    with pytest.raises(TypeError, match=r"is_causal must be a bool .*got torch.Tensor .*tensor.item\(\)"):
        check_flag("is_causal", torch.tensor(True))


def test_type_name_qualifies_non_builtins():
    assert type_name(1) == "int" and type_name(np.int64(1)) == "numpy.int64"
