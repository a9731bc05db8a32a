"""The shared argument checks of the performance model."""

import math

import numpy as np
import pytest

from llm_speed.perf._checks import attention_shape, divisors_text, non_negative_number, positive_int


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
