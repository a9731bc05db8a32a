"""A/B timings of the candidate launch choices (``llm_speed.core.policy.CANDIDATES``) against the shipped
policy, each at its own target problem, on a CUDA GPU.

Each candidate is the shipped policy with one unproven choice on (the forward's overlap, TMA loads, 32-bit
row offsets, packed sequences' bounds in uniform registers, the decode step's append in the attention kernel,
fp8 attention's weight cast, ...). One candidate after the other (in ``CANDIDATES``' order: the largest
predicted gains first), its target is timed under the shipped policy and under the candidate's, back to back,
``--rounds`` times, the pairs alternating which goes first (so drift hits both alike); the JSON keeps every
round's time and the medians over every round, and is rewritten after each pair, so a run cut short keeps
what it measured; no candidate starts after ``--budget-s`` (the first always runs). Plans are keyed on the
policy: switching never reuses a plan made under the other.

    python benchmarks/attention_ab.py --rounds 3 --budget-s 120 --json ab.json
    python benchmarks/attention_ab.py --candidates forward-overlap rows32 --json ab.json
    python benchmarks/attention_ab.py --check   # on a CPU: parse, build each target and plan it, no timing

``ratio`` is the shipped median over the candidate's (above 1: the candidate is faster): what a proof in
``llm_speed.core.policy.PROOFS`` records. Not a test: timing needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from llm_speed.core import launch
from llm_speed.core.policy import CANDIDATES, SHIPPED, Candidate, use_policy


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def make_call(target: dict, device: str) -> Callable[[], object]:
    """A call of the target problem's op on ``device`` (inputs made once): what is timed."""
    from llm_speed.attention.decode import flash_attention_with_kvcache
    from llm_speed.attention.flash import flash_attention
    from llm_speed.attention.varlen import flash_attention_varlen

    op, backward = target["op"], target["pass"] == "forward+backward"
    if op == "gemm_fp8":  # block scaling, b an nn.Linear weight [N, K] (candidate gluon-gemm-fp8)
        from llm_speed.matmul.fp8 import gemm_fp8, quantize_fp8

        a, s_a = quantize_fp8(torch.randn(target["m"], target["k"], device=device), granularity=(1, 128))
        b, s_b = quantize_fp8(torch.randn(target["n"], target["k"], device=device), granularity=(128, 128))
        out_dtype = _dtype(target["out_dtype"])
        return lambda: gemm_fp8(a, b, s_a, s_b, out_dtype=out_dtype, trans_b=True)
    if op == "tensor_core_gemm_int8":  # a [M, K], b an nn.Linear weight [N, K] read as its [K, N] view
        from llm_speed.matmul.gemm import tensor_core_gemm_int8

        a = torch.randint(-128, 128, (target["m"], target["k"]), dtype=torch.int8, device=device)
        w = torch.randint(-128, 128, (target["n"], target["k"]), dtype=torch.int8, device=device)
        return lambda: tensor_core_gemm_int8(a, w.T)
    dtype = _dtype(target["dtype"])
    heads, kv_heads, head_dim = target["heads"], target.get("kv_heads", target["heads"]), target["head_dim"]

    def randn(*shape, grad=False, like=dtype):
        return torch.randn(*shape, device=device, dtype=torch.float32).to(like).requires_grad_(grad)

    if op == "flash_attention":
        batch, seq = target["batch"], target["seq"]
        q = randn(batch, heads, seq, head_dim, grad=backward)
        k, v = (randn(batch, kv_heads, seq, head_dim, grad=backward) for _ in range(2))
        call = lambda: flash_attention(q, k, v, is_causal=target["causal"])  # noqa: E731
    elif op == "flash_attention_fp8":
        batch, seq = target["batch"], target["seq"]
        q, k, v = (randn(batch, h, seq, head_dim, like=dtype) for h in (heads, kv_heads, kv_heads))
        ones = torch.ones(batch, kv_heads, device=device)
        call = lambda: flash_attention(q, k, v, is_causal=target["causal"], descale_q=ones,  # noqa: E731
                                       descale_k=ones, descale_v=ones)  # fmt: skip
    elif op == "flash_attention_varlen":
        lengths = target["lengths"]
        cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
        total, longest = sum(lengths), max(lengths)
        q = randn(total, heads, head_dim, grad=backward)
        k, v = (randn(total, kv_heads, head_dim, grad=backward) for _ in range(2))
        call = lambda: flash_attention_varlen(q, k, v, cu, cu, longest, longest,  # noqa: E731
                                              is_causal=target["causal"])  # fmt: skip
    elif op == "flash_attention_with_kvcache":
        batch, cache, new = target["batch"], target["cache"], target["new_tokens"]
        q = randn(batch, new, heads, head_dim)
        k_cache, v_cache = (randn(batch, cache, kv_heads, head_dim) for _ in range(2))
        k, v = (randn(batch, new, kv_heads, head_dim) for _ in range(2))
        lengths = torch.full((batch,), cache - new, dtype=torch.int32, device=device)
        call = lambda: flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, k=k, v=v,  # noqa: E731
                                                    is_causal=True)  # fmt: skip
    else:
        raise ValueError(f"target op {op!r}: no A/B call for it")
    if not backward:
        return lambda: _no_grad(call)
    leaves = [t for t in (q, k, v) if t.requires_grad]

    def forward_backward():
        out = call()
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    return forward_backward


def _no_grad(call):
    with torch.no_grad():
        return call()


def time_ms(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _commit() -> str | None:
    if os.environ.get("LLM_SPEED_GIT_COMMIT"):
        return os.environ["LLM_SPEED_GIT_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=os.path.dirname(os.path.abspath(__file__)))  # fmt: skip
    except OSError:
        return None
    return done.stdout.strip() or None


def check(candidates: list[Candidate]) -> int:
    """On the CPU (launches stubbed by ``simulated_gpu``, the H100 standing in): each target's call under
    the shipped policy and under its candidate's; the plans each makes, and the constexprs that differ. A
    candidate that changes no plan at its target fails the check."""
    failures = 0
    for candidate in candidates:
        plans = {}
        for name, chosen in (("shipped", SHIPPED), (candidate.name, candidate.policy)):
            launch.clear_plans()
            made: list = []
            original = launch.Plan._first

            def first(plan, _original=original, _made=made, **per_call):
                _made.append(plan)
                return _original(plan, **per_call)

            launch.Plan._first = first
            try:
                with launch.simulated_gpu(), use_policy(chosen):
                    make_call(_small(candidate.target), "cpu")()
            finally:
                launch.Plan._first = original
            seen: dict[str, int] = {}
            plans[name] = {}
            for plan in made:  # the n-th plan of each kernel
                seen[plan.kernel.name] = seen.get(plan.kernel.name, 0) + 1
                plans[name][(plan.kernel.name, seen[plan.kernel.name])] = plan
        shipped, chosen = plans["shipped"], plans[candidate.name]
        changes = []
        for key in sorted(set(shipped) | set(chosen)):
            a, b = shipped.get(key), chosen.get(key)
            if a is None or b is None:
                changes.append(f"{key[0]}: {'added' if a is None else 'dropped'}")
                continue
            changes += [f"{key[0]}.{n}: {a.fixed.get(n)!r} -> {b.fixed.get(n)!r}"
                        for n in sorted(set(a.fixed) | set(b.fixed))
                        if str(a.fixed.get(n)) != str(b.fixed.get(n))]  # fmt: skip
            if sorted(a.descriptors) != sorted(b.descriptors):
                changes.append(f"{key[0]} descriptors: {sorted(a.descriptors)} -> {sorted(b.descriptors)}")
        status = "ok" if changes else "FAILS: no plan changes at its target"
        failures += not changes
        print(f"{candidate.name} ({candidate.target['op']} {candidate.target['pass']}): {status}; "
              + "; ".join(changes[:6]), flush=True)  # fmt: skip
    launch.clear_plans()
    return 1 if failures else 0


def _small(target: dict) -> dict:
    """The target at a size the CPU plans quickly; the switches a plan reads are those of the full size
    (head dim, dtype, masks), the lengths only decide longest-first order, which no candidate changes."""
    small = dict(target)
    if "seq" in small:
        small["seq"] = min(small["seq"], 512)
    if "cache" in small:
        small["cache"] = min(small["cache"], 512)
    if "lengths" in small:
        small["lengths"] = tuple(min(n, 300) for n in small["lengths"])
    return small


def run(candidates: list[Candidate], rounds: int, budget_s: float, path: str, *, device: str = "cuda",
        timer: Callable[[Callable[[], object]], float] = time_ms,
        clock: Callable[[], float] = time.monotonic) -> int:  # fmt: skip
    """Time each candidate against the shipped policy, ``rounds`` pairs in a row, one candidate after the
    other, the JSON rewritten after every pair: a run cut anywhere keeps what it measured, and each candidate
    it started has all its rounds (its kernels' cold compile, not the timing, is what a short budget pays
    for). The pairs alternate which policy runs first, so drift and warm-up order hit both alike. No
    candidate starts after ``budget_s`` seconds (the first always runs); one that raises gets an ``error``
    and the rest go on. A SIGINT (the suite's time cap) writes the record and returns 124."""
    start = clock()
    name = torch.cuda.get_device_name() if device == "cuda" else device
    record = {"device": name, "torch": torch.__version__, "commit": _commit(), "rounds_asked": rounds,
              "budget_s": budget_s, "stopped": None, "candidates": {}}  # fmt: skip
    for c in candidates:
        record["candidates"][c.name] = {"target": c.target, "shipped_ms": [], "candidate_ms": []}
    try:
        for index, c in enumerate(candidates):
            if index and clock() - start > budget_s:
                left = [n.name for n in candidates[index:]]
                record["stopped"] = f"budget of {budget_s:.0f} s spent; not timed: {', '.join(left)}"
                print(record["stopped"], flush=True)
                break
            entry = record["candidates"][c.name]
            _time_candidate(c, rounds, entry, device, timer, lambda: _write(record, path))
    except KeyboardInterrupt:  # the suite's cap (timeout -s INT): keep what was timed
        record["stopped"] = f"interrupted after {clock() - start:.0f} s"
        print(record["stopped"], flush=True)
        _write(record, path)
        return 124
    _write(record, path)
    return 0


def _time_candidate(c: Candidate, rounds: int, entry: dict, device: str, timer,
                    save: Callable[[], None]) -> None:  # fmt: skip
    """``rounds`` pairs (shipped, candidate; then candidate, shipped; ...) into ``entry``, saved after each;
    an exception recorded as the entry's ``error``, the pairs before it kept."""
    try:
        call = make_call(c.target, device)  # inputs made here and dropped after: one target in memory at once
        for round_index in range(rounds):
            times = {}
            order = ((SHIPPED, "shipped_ms"), (c.policy, "candidate_ms"))
            for policy, key in order if round_index % 2 == 0 else order[::-1]:
                with use_policy(policy):
                    call()  # the plans (and compiles) outside the timing
                    times[key] = timer(call)
            for key, value in times.items():
                entry[key].append(value)
            shipped, chosen = statistics.median(entry["shipped_ms"]), statistics.median(entry["candidate_ms"])
            entry.update(shipped_median_ms=shipped, candidate_median_ms=chosen, ratio=shipped / chosen)
            print(f"{c.name} round {round_index + 1}: shipped {times['shipped_ms']:.4f} ms, "
                  f"candidate {times['candidate_ms']:.4f} ms; medians ratio {entry['ratio']:.3f}",
                  flush=True)  # fmt: skip
            save()
    except Exception as error:  # a candidate that fails to build or run: the others still time
        entry["error"] = f"round {len(entry['candidate_ms']) + 1}: {type(error).__name__}: {error}"[:2000]
        print(f"{c.name}: {entry['error']}", flush=True)
        save()


def _write(record: dict, path: str) -> None:
    with open(path, "w") as file:
        json.dump(record, file, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--candidates", nargs="*", metavar="NAME",
                        help=f"candidates to time (default: all): {', '.join(CANDIDATES)}")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3, help="pairs per candidate, each timing its target "
                        "under the shipped policy and under the candidate's (default 3)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no candidate after this many seconds (the first always runs)")
    parser.add_argument("--json", metavar="OUT", help="where the results go (required unless --check)")
    parser.add_argument("--check", action="store_true", help="plan each target on the CPU, no timing")
    args = parser.parse_args(argv)
    names = args.candidates or list(CANDIDATES)
    unknown = [name for name in names if name not in CANDIDATES]
    if unknown:
        parser.error(f"--candidates: unknown {unknown}; accepted: {', '.join(CANDIDATES)}")
    if args.rounds < 1:
        parser.error(f"--rounds: must be >= 1, got {args.rounds}")
    if not args.budget_s > 0:
        parser.error(f"--budget-s: must be > 0, got {args.budget_s}")
    candidates = [CANDIDATES[name] for name in names]
    if args.check:
        return check(candidates)
    if not args.json:
        parser.error("--json OUT is required to time (or --check)")
    if not torch.cuda.is_available():
        print("attention_ab.py: timing needs a CUDA GPU (--check plans on a CPU)", file=sys.stderr)
        return 2
    return run(candidates, args.rounds, args.budget_s, args.json)


if __name__ == "__main__":
    sys.exit(main())
