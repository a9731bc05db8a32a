"""Launch choices as one frozen value: what the attention launchers choose between variants of one kernel
(TMA or pointer loads, the forward's overlapped loop, 32-bit row offsets, longest-first order, ...), each
with its shipped default and the GPU run that proves it.

A choice is on in :data:`SHIPPED` only once a GPU run showed it correct and not slower (its :class:`Proof`
in :data:`PROOFS`); an unproven one stays off and is a :class:`Candidate`: :data:`SHIPPED` with that one
choice on, and the problem (``target``) at which ``benchmarks/attention_ab.py --candidates NAME`` times it
against :data:`SHIPPED`. Where a change rewrote a kernel and left no switch, :data:`NOT_SWITCHES` says so:
the proof's correctness step covers it.

The policy is part of the key of every plan and kept call that reads it, so that switching policy never
reuses a plan made under another. :func:`use_policy` selects one for a block (tests, the A/B script, users);
``LLM_SPEED_POLICY=<candidate name>`` selects a process's starting policy. Torch-free: the performance model
reads it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from typing import NamedTuple

ENV = "LLM_SPEED_POLICY"


@dataclasses.dataclass(frozen=True)
class LaunchPolicy:
    """One value per launch choice (the defaults are :data:`SHIPPED`'s)."""

    # Padded head dims at which the 16-bit forward on Hopper issues the next key block's QK^T before this
    # block's softmax (FlashAttention-3's intra-warpgroup overlap, arXiv:2407.08608 section 3.2).
    forward_overlap_head_dims: tuple[int, ...] = ()
    # Padded head dims at which the 16-bit forward (not paged, no ALiBi or dropout) loads its interior K/V
    # tiles through tensor descriptors (TMA).
    forward_tma_kv_head_dims: tuple[int, ...] = ()
    # Padded head dims at which the 16-bit backward loads its streamed tiles (Q and dO in dK/dV, K and V in
    # dQ) through tensor descriptors.
    backward_tma_head_dims: tuple[int, ...] = ()
    # Tiers (``Tier.name`` of the attention tiers) whose default backward computes dQ in a kernel of its own
    # (seven matmuls per tile) instead of adding it by atomics from the dK/dV kernel (five).
    backward_dq_kernel_tiers: tuple[str, ...] = ("227 KB",)
    # Where the dQ kernel is the default: the five-matmul path instead, each dQ tile added by one TMA bulk
    # reduction.
    backward_tma_dq_add: bool = False
    # Causal (or right-bounded) query-block kernels launch the longest blocks first from this many query
    # rows per sequence; None: always in row order.
    lpt_min_rows: int | None = 16384
    # 16-bit kernels compute in-tile row offsets in 32 bits where every row of every tensor fits.
    rows32: bool = False
    # Packed sequences' per-program bounds pass through redux.sync, so ptxas keeps them in uniform
    # registers (compiled for compute capability 8.0+).
    uniform_bounds: bool = False
    # A decode step whose query rows fit one tile has the attention kernel write its new tokens (one launch)
    # instead of the append kernel before it.
    decode_append_in_attention: bool = False
    # fp8 attention converts its softmax weights (in [0, 256]) to e4m3 with the GPU's cast alone, instead of
    # the fp8 GEMM's general cast (clamp and NaN select first).
    fp8_weights_gpu_cast: bool = False
    # Head dims at which a 16-bit dense attention forward on a compute capability 9.0 GPU runs the
    # warp-specialized Gluon kernel (llm_speed.gluon.attention; what it takes: llm_speed.gluon.select).
    gluon_forward_head_dims: tuple[int, ...] = ()
    # Likewise the backward (llm_speed.gluon.attention_bwd: dQ by atomics, so never where a deterministic
    # backward is asked for).
    gluon_backward_head_dims: tuple[int, ...] = ()
    # Block-scaled (1x128 x 128x128) e4m3 GEMMs with b [N, K] on a compute capability 9.0 GPU run the
    # warp-specialized Gluon kernel (llm_speed.gluon.gemm_fp8; which calls: llm_speed.gluon.gemm_fp8_select).
    gluon_gemm_fp8: bool = False
    # 2-D int8 GEMMs (tensor_core_gemm_int8) on a compute capability 9.0 GPU run the warp-specialized Gluon
    # kernel, whose int32 products stay in flight (Triton waits for each: llm_speed.gluon.gemm; which calls:
    # llm_speed.gluon.gemm_int8_select).
    gluon_gemm_int8: bool = False
    # Head dims at which an fp8 (e4m3, descales) dense attention forward on a compute capability 9.0 GPU runs
    # the Gluon forward (V transposed by one copy; llm_speed.gluon.select).
    gluon_fp8_forward_head_dims: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_head_dims") and not (
                isinstance(value, tuple) and all(type(d) is int and d > 0 for d in value)
            ):
                raise TypeError(f"{field.name} must be a tuple of positive ints (padded head dims), got "
                                f"{value!r}")  # fmt: skip
            if field.type == "bool" and type(value) is not bool:
                raise TypeError(f"{field.name} must be a bool, got {value!r}")
        if not (isinstance(self.backward_dq_kernel_tiers, tuple)
                and all(isinstance(t, str) for t in self.backward_dq_kernel_tiers)):  # fmt: skip
            raise TypeError(f"backward_dq_kernel_tiers must be a tuple of tier names, got "
                            f"{self.backward_dq_kernel_tiers!r}")  # fmt: skip
        if self.lpt_min_rows is not None and (type(self.lpt_min_rows) is not int or self.lpt_min_rows < 0):
            raise TypeError(f"lpt_min_rows must be None or an int >= 0, got {self.lpt_min_rows!r}")
        # Plans and kept calls hash the policy on every lookup: once here instead of over every field.
        object.__setattr__(self, "_hash", hash(dataclasses.astuple(self)))

    def __hash__(self) -> int:
        return self._hash

    def dq_kernel_on(self, tier_name: str) -> bool:
        """Whether the attention backward on a device of the attention tier ``tier_name`` computes dQ in a
        kernel of its own by default (seven matmuls per tile, bitwise repeatable) instead of adding it by
        atomics from the dK/dV kernel (five): ``backward_dq_kernel_tiers`` names the tier, and
        ``backward_tma_dq_add`` does not replace it. (The launcher's rule and the performance model's.)"""
        return tier_name in self.backward_dq_kernel_tiers and not self.backward_tma_dq_add


class Proof(NamedTuple):
    """A GPU run that measured a choice against its alternative: ``ratio`` is the alternative's time over
    the choice's (above 1: the choice is faster)."""

    device: str
    commit: str
    results: str  # the committed results file
    ratio: float
    measured: str  # what was timed, in words


class Candidate(NamedTuple):
    """:data:`SHIPPED` with one unproven choice on, and the problem to time it at (``target``: the op, its
    shape and flags, plain values)."""

    name: str
    policy: LaunchPolicy
    target: dict


SHIPPED = LaunchPolicy()

_H100 = "NVIDIA H100 80GB HBM3 (SXM)"
_CALL5 = "benchmarks/results/h100-sxm/4c378d4-ab-fp8/attention_ab.json"
_CALLS4_6 = "benchmarks/results/h100-sxm/unrecorded-ab-overhead/attention_ab.json"

# Per choice (a field of LaunchPolicy), the GPU run behind its shipped value, or None: never measured on a
# GPU (the last lent GPU ran commit f4de76f; every choice added since is None).
PROOFS: dict[str, Proof | None] = {
    "forward_overlap_head_dims": None,
    # Ran in the GPU test suite (0cce093) but never timed against pointer loads.
    "forward_tma_kv_head_dims": None,
    "backward_tma_head_dims": None,
    "backward_dq_kernel_tiers": Proof(
        _H100, "4c378d4", _CALL5, 23.83 / 14.30,
        "backward 1 x 16 x 16384, d=128, fp16, 64x64 x 4 warps: dQ by atomics 23.83 ms, its own kernel 14.30 "
        "(causal 12.43 / 7.51)",
    ),
    # Measured slower: stays off.
    "backward_tma_dq_add": Proof(
        _H100, "not recorded (second 2026-11-25 lease, after 0cce093)", _CALLS4_6, 14.40 / 23.60,
        "backward 1 x 16 x 16384, d=128, fp16: the dQ kernel 14.40 ms, dQ tiles by TMA reductions 23.60",
    ),
    "lpt_min_rows": Proof(
        _H100, "4c378d4", _CALL5, 2.320 / 2.162,
        "causal forward 1 x 16 x 16384, d=128, bf16: row order 2.320 ms, longest first 2.162 (0.93-1.03x "
        "below 16384 rows: hence the threshold)",
    ),
    "rows32": None,
    "uniform_bounds": None,
    "decode_append_in_attention": None,
    "fp8_weights_gpu_cast": None,
    # Never run on a GPU (issue 73; docs/gluon.md).
    "gluon_forward_head_dims": None,
    "gluon_backward_head_dims": None,
    "gluon_gemm_fp8": None,
    "gluon_gemm_int8": None,
    "gluon_fp8_forward_head_dims": None,
}

# Changes since the last GPU run that rewrote a kernel and left no switch: the proof's correctness step (the
# default paths against float64 on the GPU) covers them.
NOT_SWITCHES: dict[str, str] = {
    "backward base-2 LSE": "not a switch; covered by the proof's correctness step",
}

# The attention problems the A/B times at (batch, heads, seq, head_dim; kv_heads for GQA).
_FWD_D128 = {"op": "flash_attention", "pass": "forward", "batch": 1, "heads": 16, "seq": 16384,
             "head_dim": 128, "dtype": "float16", "causal": False}  # fmt: skip
_BWD_D128 = dict(_FWD_D128, **{"pass": "forward+backward"})
_PACKED = {"op": "flash_attention_varlen", "pass": "forward+backward",
           "lengths": (3000, 1000, 2500, 1500, 4000, 500, 2384, 1500), "heads": 16, "kv_heads": 4,
           "head_dim": 128, "dtype": "bfloat16", "causal": True}  # fmt: skip
_DECODE = {"op": "flash_attention_with_kvcache", "pass": "forward", "batch": 8, "heads": 32, "kv_heads": 8,
           "cache": 4096, "new_tokens": 1, "head_dim": 128, "dtype": "bfloat16"}  # fmt: skip
_FP8 = {"op": "flash_attention_fp8", "pass": "forward", "batch": 1, "heads": 16, "seq": 16384, "head_dim": 64,
        "dtype": "float8_e4m3fn", "causal": False, "family": "fp8_attention"}  # fmt: skip
# DeepSeek-V3's block scaling at 4096^3: e4m3 a with 1x128 scales, b an nn.Linear weight [N, K] with 128x128.
_FP8_BLOCK_GEMM = {"op": "gemm_fp8", "pass": "forward", "m": 4096, "n": 4096, "k": 4096,
                   "dtype": "float8_e4m3fn", "scaling": "block", "trans_b": True, "out_dtype": "bfloat16",
                   "family": "gemm_fp8"}  # fmt: skip
# W8A8 int8 at 4096^3: a [M, K], b an nn.Linear weight (b [K, N] K-major: the kernel reads b.mT), int32 out.
_INT8_GEMM = {"op": "tensor_core_gemm_int8", "pass": "forward", "m": 4096, "n": 4096, "k": 4096,
              "dtype": "int8", "trans_b": True, "family": "gemm"}  # fmt: skip


def _candidate(name: str, target: dict, **on) -> Candidate:
    return Candidate(name, dataclasses.replace(SHIPPED, **on), target)


# In the order the proof checks and times them when its budget cannot take them all (the first round of its
# A/B compiles every candidate's kernels): the largest predicted gains on the largest gaps first. The
# five-matmul backward 1.07-1.3x on the backward (0.68-0.71x cuDNN); the overlapped forward 505-575 against
# 480 TFLOP/s; the Gluon int8 GEMM ~0.11-0.12 against 0.298 ms; the Gluon attention, issue 73's bet; then
# the rest (docs/guides: attention-hopper, fp8, gemm, decode).
CANDIDATES: dict[str, Candidate] = {
    c.name: c
    for c in (
        _candidate("backward-atomic-dq", _BWD_D128, backward_dq_kernel_tiers=()),  # a RETEST
        _candidate("forward-overlap", _FWD_D128, forward_overlap_head_dims=(128,)),
        _candidate("gluon-gemm-int8", _INT8_GEMM, gluon_gemm_int8=True),
        _candidate("gluon-forward", _FWD_D128, gluon_forward_head_dims=(128,)),
        _candidate("gluon-backward", _BWD_D128, gluon_backward_head_dims=(128,)),
        _candidate("fp8-weights-gpu-cast", _FP8, fp8_weights_gpu_cast=True),
        _candidate("gluon-gemm-fp8", _FP8_BLOCK_GEMM, gluon_gemm_fp8=True),
        _candidate("forward-tma-kv", _FWD_D128, forward_tma_kv_head_dims=(128, 256)),
        _candidate("forward-overlap-tma-kv", _FWD_D128, forward_overlap_head_dims=(128,),
                   forward_tma_kv_head_dims=(128, 256)),  # fmt: skip
        _candidate("backward-tma", _BWD_D128, backward_tma_head_dims=(128,)),
        # (32-bit rows change the forward's kernels as well as the backward's: both families rerun)
        _candidate("rows32", dict(_BWD_D128, head_dim=64, family=("flash", "flash_bwd")), rows32=True),
        _candidate("uniform-bounds", _PACKED, uniform_bounds=True),
        _candidate("decode-append", _DECODE, decode_append_in_attention=True),
        _candidate("gluon-forward-fp8", dict(_FP8, head_dim=128), gluon_fp8_forward_head_dims=(128,)),
    )
}


# Candidates that time a proven choice against its alternative again, because the alternative's kernel changed
# after the proof's run (the proof compared the kernels as they were): candidate -> what changed.
RETESTS: dict[str, str] = {
    "backward-atomic-dq": "the five-matmul backward (dQ by atomics from the dK/dV kernel) takes the d = 128 "
    "head dim in halves since 6a2b66b (two blocks per SM, no spills; docs/guides/attention-hopper.md "
    "predicts 11-13.5 ms against the dQ kernel's 14.30), after the proof's run at 4c378d4",
}


def candidate_of(field: str) -> Candidate | None:
    """The candidate that turns ``field`` on alone, if any."""
    for candidate in CANDIDATES.values():
        changed = [f.name for f in dataclasses.fields(LaunchPolicy)
                   if getattr(candidate.policy, f.name) != getattr(SHIPPED, f.name)]  # fmt: skip
        if changed == [field]:
            return candidate
    return None


def _from_environment() -> LaunchPolicy:
    name = os.environ.get(ENV, "")
    if not name or name == "shipped":
        return SHIPPED
    if name not in CANDIDATES:
        raise ValueError(f"{ENV}={name!r}: not a candidate policy; accepted: shipped, "
                         f"{', '.join(CANDIDATES)}")  # fmt: skip
    return CANDIDATES[name].policy


_current = _from_environment()
# Each distinct policy's number: what the calls already checked put in their keys (an int hashes in C; the
# policy's own hash is a Python call, a tenth of a microsecond on a 7 us call).
_numbers: dict[LaunchPolicy, int] = {}
_current_number = _numbers.setdefault(_current, len(_numbers))


def current_policy() -> LaunchPolicy:
    """The policy launches made now follow."""
    return _current


def current_number() -> int:
    """The current policy's number, the same for equal policies: a key of calls already checked."""
    return _current_number


def _resolve(policy_or_candidate_name, field_changes: dict) -> LaunchPolicy:
    if policy_or_candidate_name is None:
        base = _current
    elif isinstance(policy_or_candidate_name, LaunchPolicy):
        base = policy_or_candidate_name
    elif isinstance(policy_or_candidate_name, str):
        if policy_or_candidate_name == "shipped":
            base = SHIPPED
        elif policy_or_candidate_name in CANDIDATES:
            base = CANDIDATES[policy_or_candidate_name].policy
        else:
            raise ValueError(f"use_policy: {policy_or_candidate_name!r} is not a candidate; accepted: "
                             f"shipped, {', '.join(CANDIDATES)}")  # fmt: skip
    else:
        raise TypeError(f"use_policy: expected a LaunchPolicy, a candidate name or None, got "
                        f"{type(policy_or_candidate_name).__name__}")  # fmt: skip
    names = {f.name for f in dataclasses.fields(LaunchPolicy)}
    unknown = sorted(set(field_changes) - names)
    if unknown:
        raise TypeError(f"use_policy: unknown launch choice(s) {unknown}; accepted: {sorted(names)}")
    return dataclasses.replace(base, **field_changes) if field_changes else base


@contextlib.contextmanager
def use_policy(
    policy_or_candidate_name: LaunchPolicy | str | None = None, **field_changes
) -> Iterator[LaunchPolicy]:
    """Launch under ``policy_or_candidate_name`` (a :class:`LaunchPolicy`, a candidate's name, "shipped", or
    None: the current policy) with ``field_changes`` applied, inside the block; yields that policy. Plans
    are keyed on the policy, so nothing made under another is reused."""
    global _current, _current_number
    policy = _resolve(policy_or_candidate_name, field_changes)
    saved = _current, _current_number
    _current, _current_number = policy, _numbers.setdefault(policy, len(_numbers))
    try:
        yield policy
    finally:
        _current, _current_number = saved


def proof_lines() -> list[tuple[str, str, str]]:
    """(choice, shipped value, its proof in words or "unproven") for every choice, then every change that
    is not a switch: what ``llm-speed doctor`` lists."""
    rows = []
    for field in dataclasses.fields(LaunchPolicy):
        proof = PROOFS[field.name]
        value = repr(getattr(SHIPPED, field.name))
        if proof is None:
            text = "unproven (off)"
        else:
            text = f"{proof.device}, commit {proof.commit}, {proof.ratio:.2f}x: {proof.results}"
            shipped = getattr(SHIPPED, field.name)
            retests = [name for name in RETESTS if getattr(CANDIDATES[name].policy, field.name) != shipped]
            if retests:
                text += f"; to be retimed by {', '.join(retests)} (its alternative changed since)"
        rows.append((field.name, value, text))
    rows += [(name, "-", text) for name, text in NOT_SWITCHES.items()]
    return rows
