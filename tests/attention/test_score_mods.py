"""The mask and score options as one value (attention/options.py): construction, equality and hashing, the
derived properties the plans read, and the round trip through the ops' flat arguments."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from attention_testing import make_qkv

from llm_speed import flash_attention, flash_attention_varlen
from llm_speed.attention import decode_launch, launcher
from llm_speed.attention.options import CAUSAL, NO_MODS, MaskKey, ScoreMods, from_op
from llm_speed.attention.plans import forward_plan
from llm_speed.core.policy import current_policy


def test_defaults_and_fields():
    mods = ScoreMods()
    assert (mods.is_causal, mods.window_left, mods.window_right, mods.softcap) == (False, None, None, None)
    assert (mods.alibi_slopes, mods.dropout_p, mods.rng) == (None, 0.0, None)
    assert mods.key == MaskKey() == (False, None, None, False, 0, False)
    assert mods == NO_MODS and ScoreMods(True) == CAUSAL and CAUSAL != NO_MODS
    slopes = torch.ones(2, 4)
    rng = torch.zeros(2, dtype=torch.int64)
    mods = ScoreMods(True, 7, None, 30.0, slopes, 0.25, rng)
    assert mods.key == MaskKey(True, 7, None, True, 2, True)
    assert mods.alibi_slopes is slopes and mods.rng is rng and mods.dropout_p == 0.25
    assert repr(ScoreMods(True, 7, softcap=30.0)) == "ScoreMods(is_causal=True, window_left=7, softcap=30.0)"
    assert repr(ScoreMods(window_right=0, dropout_p=float("0.0"))) == "ScoreMods(window_right=0)"
    assert repr(ScoreMods(alibi_slopes=slopes)).startswith("ScoreMods(alibi_slopes=tensor(")


def test_immutable():
    mods = ScoreMods(True, 3, 0)
    with pytest.raises(AttributeError):
        mods.window_left = 5
    with pytest.raises(AttributeError):
        mods.extra = 1  # no instance dict


def test_equal_and_hash_by_options_and_tensor_identity():
    slopes = torch.ones(4)
    a = ScoreMods(False, 3, 2, 50.0, slopes)
    b = ScoreMods(False, 3, 2, 50.0, slopes)
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    # the same values in another tensor: another value (no elementwise comparison, no error)
    assert a != ScoreMods(False, 3, 2, 50.0, slopes.clone())
    for other in (ScoreMods(False, 3, 2, 50.0), ScoreMods(False, 3, 1, 50.0, slopes),
                  ScoreMods(False, 3, 2, 30.0, slopes), ScoreMods(True, 3, 2, 50.0, slopes)):  # fmt: skip
        assert a != other
    assert ScoreMods(dropout_p=0.1) != ScoreMods(dropout_p=0.2)
    # the plan key ignores the values the kernels take per call (the cap, the rate, the tensors)
    assert ScoreMods(softcap=30.0).key == ScoreMods(softcap=50.0).key
    assert ScoreMods(alibi_slopes=slopes).key == ScoreMods(alibi_slopes=slopes.clone()).key
    assert ScoreMods(alibi_slopes=slopes).key != ScoreMods(alibi_slopes=slopes[None]).key
    assert a != (False, 3, 2, 50.0, slopes, 0.0, None, a.key)  # not a plain tuple


def test_copy_and_pickle_rebuild_the_key():
    mods = ScoreMods(True, 5, None, 20.0)
    for again in (copy.copy(mods), copy.deepcopy(mods), pickle.loads(pickle.dumps(mods))):
        assert again == mods and again.key == mods.key and type(again) is ScoreMods


@pytest.mark.parametrize(
    ("mods", "left", "right", "has_left", "has_right"),
    [
        (ScoreMods(), 0, 0, False, False),
        (ScoreMods(True), 0, 0, False, True),  # causal: a right bound of 0
        (ScoreMods(True, 7, 3), 7, 0, True, True),  # causal wins over a right side
        (ScoreMods(False, None, 3), 0, 3, False, True),
        (ScoreMods(False, 4, None), 4, 0, True, False),
    ],
)  # fmt: skip
def test_derived_mask_properties(mods, left, right, has_left, has_right):
    assert (mods.key.has_left, mods.key.has_right, mods.key.right_bound) == (has_left, has_right, right)
    assert (mods.key.left or 0) == left
    assert mods.window == (None if mods.window_left is None and mods.window_right is None
                           else (mods.window_left, mods.window_right))  # fmt: skip


def test_derived_score_properties():
    assert not NO_MODS.capped and NO_MODS.cap == 1.0 and not NO_MODS.dropout and NO_MODS.alibi_dims == 0
    assert NO_MODS.window is None and ScoreMods(window_left=3).window == (3, None)
    capped = ScoreMods(softcap=30.0)
    assert capped.capped and capped.cap == 30.0
    slopes = ScoreMods(alibi_slopes=torch.ones(3, 4))
    assert slopes.alibi_dims == 2 and not slopes.dropout
    dropped = ScoreMods(dropout_p=0.5, rng=torch.zeros(2, dtype=torch.int64))
    assert dropped.dropout and dropped.alibi_dims == 0 and not dropped.capped


def test_from_op_makes_nothing_for_the_common_calls():
    assert from_op(False) is NO_MODS and from_op(True) is CAUSAL
    assert from_op(False, None, None, None, None, 0.0, None) is NO_MODS
    mods = from_op(True, 3, None, 20.0)
    assert mods == ScoreMods(True, 3, None, 20.0) and mods is not CAUSAL
    assert from_op(True, 3, None, 20.0) is mods  # options without a tensor: made once
    slopes = torch.ones(4)
    assert from_op(True, 3, None, 20.0, slopes) is not from_op(True, 3, None, 20.0, slopes)  # (per call)
    assert from_op(False, None, 0) == ScoreMods(False, None, 0) != CAUSAL  # (the decode step's causal)
    assert decode_launch.DECODE_CAUSAL.key.has_right and decode_launch.DECODE_CAUSAL.key.right_bound == 0


def _record_mods(monkeypatch, name: str) -> list:
    """Every value ``launcher.<name>`` receives (the op implementations call it with the rebuilt value)."""
    seen, function = [], getattr(launcher, name)

    def spy(*args, **kwargs):
        seen.extend(arg for arg in (*args, *kwargs.values()) if type(arg) is ScoreMods)
        return function(*args, **kwargs)

    monkeypatch.setattr(launcher, name, spy)
    return seen


def test_round_trip_through_the_dense_ops(device, monkeypatch):
    """A value flattened into the registered ops' schema arguments comes back equal inside them (forward and
    backward ops alike), and the plan keys on its MaskKey."""
    q, k, v = make_qkv(2, 2, 2, 16, 24, 16, torch.float32, device)
    slopes = torch.rand(2, 2, device=device)
    rng = torch.tensor([11, 0], dtype=torch.int64, device=device)
    mods = ScoreMods(True, 5, None, 20.0, slopes, 0.25, rng)
    forwards = _record_mods(monkeypatch, "attention_forward")
    backwards = _record_mods(monkeypatch, "attention_backward")
    flat = (mods.window_left, mods.window_right, mods.softcap, False, mods.alibi_slopes, mods.dropout_p,
            mods.rng)  # fmt: skip
    out, lse = torch.ops.llm_speed.flash_attention_forward(q, k, v, mods.is_causal, 0.25, *flat)
    dout = torch.ones_like(out)
    torch.ops.llm_speed.flash_attention_backward(dout, q, k, v, out, lse, None, mods.is_causal, 0.25, *flat)
    assert forwards == [mods] and backwards == [mods]
    # the same call through the public function: the same value reaches the launcher
    torch.manual_seed(0)
    flash_attention(q, k, v, is_causal=True, window=(5, None), softcap=20.0, alibi_slopes=slopes,
                    dropout_p=0.25)  # fmt: skip
    seen = forwards[-1]
    assert seen.key == mods.key and seen.alibi_slopes is slopes and seen.rng is not None


def test_round_trip_through_the_packed_op(device, monkeypatch):
    seen = _record_mods(monkeypatch, "packed_forward")
    q, k, v = (torch.randn(10, 2, 16, device=device) for _ in range(3))
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    flash_attention_varlen(q, k, v, cu, cu, 6, 6, is_causal=True, window=(2, None), softcap=10.0)
    assert seen == [ScoreMods(True, 2, None, 10.0)]


def test_plans_key_on_the_mask_key_only(device):
    """Two calls whose options differ only in per-call values (the cap, the slopes' values) share a plan."""
    q, k, v = make_qkv(1, 2, 2, 16, 16, 16, torch.float32, device)
    plans = [forward_plan(*launcher.dense_plan_key(q, k, v, mods.key, False), lse=True,
                          policy=current_policy())
             for mods in (ScoreMods(True, 3, softcap=10.0), ScoreMods(True, 3, softcap=50.0))]  # fmt: skip
    assert plans[0] is plans[1]
    other = forward_plan(*launcher.dense_plan_key(q, k, v, ScoreMods(True, 4, softcap=10.0).key, False),
                         lse=True, policy=current_policy())  # fmt: skip
    assert other is not plans[0] and other.fixed["window_left"] == 4 and other.fixed["SOFTCAP"]
