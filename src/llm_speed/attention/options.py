"""The mask and score options of one attention call as one value: :class:`ScoreMods`.

Which keys a query sees (the causal flag and a local window) and how its scores change before the softmax (a
softcap, ALiBi slopes, dropout with its random state) travel from the op implementations through the
launchers and the plans as one immutable value (the reference takes its fields), in the spirit of
FlexAttention's ``mask_mod``/``score_mod`` (PyTorch, ``torch.nn.attention.flex_attention``) and
FlashAttention-4's mask module (Dao-AILab/flash-attention ``flash_attn/cute/mask.py``): host-side only, the
kernels keep their constexpr switches, which the plans read off the value's :attr:`ScoreMods.key`.

The ``torch.library`` ops keep flat, schema-typed arguments (``torch.compile``, fake tensors and autograd's
saved arguments read those): a call crosses the op boundary as the schema's ``is_causal``, ``window_left``,
``window_right``, ``softcap``, ``alibi_slopes``, ``dropout_p`` and ``rng``, and each op implementation
rebuilds the value once, with :func:`from_op` (no construction for the common calls: :data:`NO_MODS`,
:data:`CAUSAL`). The public functions check each option with ``checks.py`` before any work, so a value holds
checked options only."""

from __future__ import annotations

import functools
from collections import namedtuple
from typing import NamedTuple

import torch


class MaskKey(NamedTuple):
    """What a plan reads of a call's options (hashable, no tensor): the causal flag, the window's sides as
    given (None: unbounded), whether scores are capped, the dims of the ALiBi slopes (0 without; 1:
    ``[heads_q]``; 2: ``[batch, heads_q]``) and whether dropout is on."""

    is_causal: bool = False
    left: int | None = None
    right: int | None = None
    capped: bool = False
    alibi: int = 0
    dropout: bool = False

    @property
    def has_left(self) -> bool:
        """Keys are bounded on the left (``HAS_LEFT``)."""
        return self.left is not None

    @property
    def has_right(self) -> bool:
        """Keys are bounded on the right (``HAS_RIGHT``): a causal mask is a right bound of 0."""
        return self.is_causal or self.right is not None

    @property
    def right_bound(self) -> int:
        """The right bound the kernels take (``window_right``): 0 when causal or unbounded."""
        return 0 if self.is_causal or self.right is None else self.right


_new = tuple.__new__  # a namedtuple's own __new__ is a Python function: half the cost of a value
_Fields = namedtuple(
    "_Fields", ("is_causal", "window_left", "window_right", "softcap", "alibi_slopes", "dropout_p", "rng",
                "key", "window", "cap"),
)  # fmt: skip


class ScoreMods(_Fields):
    """The mask and score options of one call, immutable. Fields as the kernels read them (checked by the
    public functions):

    - ``is_causal``: query i sees keys ``j <= i + seq_kv - seq_q`` (bottom-right aligned);
    - ``window_left``, ``window_right``: the local window's sides, None for an unbounded one;
    - ``softcap``: ``c`` (scores become ``c * tanh(s / c)``) or None;
    - ``alibi_slopes``: float32 ``[heads_q]`` or ``[batch, heads_q]`` contiguous, or None;
    - ``dropout_p`` in [0, 1) and ``rng``, the int64 (seed, offset) of its Philox draws (None when 0);
    - derived once here, read on every call: ``key``, the :class:`MaskKey` plans are keyed on; ``window``,
      ``(left, right)`` as the public functions take it (None without a window: the profiler's report);
      ``cap``, the kernels' ``softcap`` argument (1.0, never read, when scores are not capped).

    A tuple underneath: cheap to make and hash, its fields read in C (a property costs a Python call on
    every launch); equal when every option is and the tensors are the same objects."""

    __slots__ = ()

    def __new__(cls, is_causal: bool = False, window_left: int | None = None,
                window_right: int | None = None, softcap: float | None = None,
                alibi_slopes: torch.Tensor | None = None, dropout_p: float = 0.0,
                rng: torch.Tensor | None = None):  # fmt: skip
        return _value(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)

    def __getnewargs__(self):  # copy and pickle rebuild the key
        return tuple(self[:7])

    def __eq__(self, other) -> bool:
        if type(other) is not ScoreMods:  # not even a tuple of the same fields: a value, not a sequence
            return False
        return (self[:4] == other[:4] and self.dropout_p == other.dropout_p
                and self.alibi_slopes is other.alibi_slopes and self.rng is other.rng)  # fmt: skip

    def __ne__(self, other) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((*self[:4], self.dropout_p, id(self.alibi_slopes), id(self.rng)))

    def __repr__(self) -> str:
        shown = []
        for name, value in zip(self._fields[:7], self[:7], strict=True):
            default = _DEFAULTS[name]
            if (value is not None) if default is None else value != default:  # (tensors: by None only)
                shown.append(f"{name}={value!r}")
        return f"ScoreMods({', '.join(shown)})"

    @property
    def capped(self) -> bool:
        return self.softcap is not None

    @property
    def alibi_dims(self) -> int:
        return self.key.alibi

    @property
    def dropout(self) -> bool:
        return self.key.dropout


def _value(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng) -> ScoreMods:
    """A :class:`ScoreMods` with its derived fields (:func:`from_op` calls it without the class's own call:
    a fifth of a value's cost)."""
    key = _new(MaskKey, (is_causal, window_left, window_right, softcap is not None,
                         0 if alibi_slopes is None else alibi_slopes.dim(), dropout_p > 0.0))  # fmt: skip
    window = None if window_left is None and window_right is None else (window_left, window_right)
    return _new(ScoreMods, (is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng, key,
                            window, 1.0 if softcap is None else softcap))  # fmt: skip


_DEFAULTS = {"is_causal": False, "window_left": None, "window_right": None, "softcap": None,
             "alibi_slopes": None, "dropout_p": 0.0, "rng": None}  # fmt: skip

# The common calls' values, made once: no construction on their path.
NO_MODS = ScoreMods()
CAUSAL = ScoreMods(True)


def from_op(is_causal: bool, window_left=None, window_right=None, softcap=None, alibi_slopes=None,
            dropout_p: float = 0.0, rng=None) -> ScoreMods:  # fmt: skip
    """The value of an op's flat arguments, already checked by the public function (the schemas' names:
    each op passes those it has). Values without a tensor are made once (:func:`_tensor_free`)."""
    if alibi_slopes is None and rng is None and not dropout_p:
        if window_left is None and window_right is None and softcap is None:
            return CAUSAL if is_causal else NO_MODS
        return _tensor_free(is_causal, window_left, window_right, softcap)
    return _value(is_causal, window_left, window_right, softcap, alibi_slopes, dropout_p, rng)


# A model has a few windows and caps: a lookup instead of a new value a call (the checks and the ops' schemas
# give ints and floats, so 30 and 30.0 never meet here)
@functools.lru_cache(maxsize=256)
def _tensor_free(is_causal: bool, window_left, window_right, softcap) -> ScoreMods:
    return ScoreMods(is_causal, window_left, window_right, softcap)
