"""What each rank runs in the multi-process ring attention tests (module-level so spawn can import it)."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from llm_speed import flash_attention
from llm_speed.attention.reference import reference_attention
from llm_speed.core import runtime, tensors
from llm_speed.distributed import (
    clear_sent_messages,
    gather_sequence,
    ring_attention,
    sent_messages,
    shard_sequence,
)
from llm_speed.perf.context_parallel import ring_bytes_per_rank
from llm_speed.perf.distributed import context_parallel_kv_bytes_per_layer
from llm_speed.perf.models import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "attention"))
import attention_testing as at  # noqa: E402 (the shared 2x/3x rule and kernel names)


@dataclass(frozen=True)
class Case:
    layout: str
    is_causal: bool
    dtype: torch.dtype
    heads_q: int
    heads_kv: int
    seq: int
    head_dim: int = 16
    batch: int = 1


def _poison_kernel_outputs() -> None:
    """Kernel outputs start as NaN in this process, so an element a kernel forgets to write shows."""

    def poisoned(shape, dtype, device):
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    tensors.new_output = poisoned


def _problem(case: Case):
    """The same full problem on every rank (same seed): q, k, v, dout, dlse."""
    generator = torch.Generator().manual_seed(1234 + case.seq)
    b, hq, hkv, s, d = case.batch, case.heads_q, case.heads_kv, case.seq, case.head_dim

    def draw(*shape):
        return torch.randn(*shape, generator=generator)

    q, k, v = draw(b, hq, s, d).to(case.dtype), draw(b, hkv, s, d).to(case.dtype), draw(b, hkv, s, d)
    return q, k, v.to(case.dtype), draw(b, hq, s, d).to(case.dtype), draw(b, hq, s)


def _ring_run(case: Case, q, k, v, dout, dlse):
    """Ring forward + backward on this rank's shards; returns the gathered (out, lse, dq, dk, dv)."""
    shard = dict(layout=case.layout)
    leaves = [shard_sequence(t, **shard).requires_grad_() for t in (q, k, v)]
    out, lse = ring_attention(*leaves, is_causal=case.is_causal, layout=case.layout, return_lse=True)
    loss = (out * shard_sequence(dout, **shard)).sum() + (lse * shard_sequence(dlse, **shard)).sum()
    loss.backward()
    gathered = [gather_sequence(t.detach(), **shard) for t in (out, lse)]
    return (*gathered, *(gather_sequence(t.grad, **shard) for t in leaves))


def _with_grads(fn, q, k, v, dout, dlse, dtype, case):
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves, is_causal=case.is_causal, return_lse=True)
    ((out * dout.to(dtype)).sum() + (lse * dlse.to(lse.dtype)).sum()).backward()
    return (out.detach(), lse.detach(), *(t.grad for t in leaves))


def _check_accuracy(case: Case, got, q, k, v, dout, dlse) -> None:
    """2x (out, lse) / 3x (grads) rule against float64, with two baselines in the case's dtype: PyTorch's
    reference and the single-device flash_attention."""
    truth = _with_grads(reference_attention, q, k, v, dout, dlse, torch.float64, case)
    same = _with_grads(reference_attention, q, k, v, dout, dlse, case.dtype, case)
    flash = _with_grads(flash_attention, q, k, v, dout, dlse, case.dtype, case)
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv")):
        assert got[i].dtype == flash[i].dtype and got[i].shape == flash[i].shape, name
        factor = at.OUTPUT_FACTOR if i < 2 else at.GRAD_FACTOR
        for baseline in (same, flash):
            at.assert_error_rule(f"{case} {name}", got[i], baseline[i], truth[i], factor, case.dtype)


def _tiny_model(case: Case) -> ModelConfig:
    return ModelConfig(
        name="ring-test",
        hidden_size=case.heads_q * case.head_dim,
        num_layers=1,
        num_attention_heads=case.heads_q,
        num_kv_heads=case.heads_kv,
        head_dim=case.head_dim,
        intermediate_size=64,
        vocab_size=64,
        max_position_embeddings=case.seq,
    )


def _check_traffic(case: Case, rank: int, world: int) -> None:
    """The bytes this rank sent, message by message, are the model's; forward totals are the perf model's
    context-parallel K/V bytes whenever the sequence splits evenly."""
    sent = sent_messages()
    model = ring_bytes_per_rank(
        batch=case.batch,
        heads_kv=case.heads_kv,
        seq_len=case.seq,
        head_dim=case.head_dim,
        world=world,
        layout=case.layout,
        dtype=case.dtype,
    )[rank]
    by_kind = {
        key: [m.nbytes for m in sent if (m.phase, m.what) == kind]
        for key, kind in (
            ("forward_kv", ("forward", "kv")),
            ("backward_kv", ("backward", "kv")),
            ("backward_dkv", ("backward", "dkv")),
        )
    }
    assert by_kind == model, (by_kind, model)
    assert [m.step for m in sent if m.phase == "forward"] == list(range(world - 1))
    if case.seq % (2 * world if case.layout == "zigzag" else world) == 0:
        dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[case.dtype]
        expected = context_parallel_kv_bytes_per_layer(
            _tiny_model(case), seq_len=case.seq, micro_batch_size=case.batch, cp=world, dtype=dtype
        )
        assert sum(by_kind["forward_kv"]) == expected


def accuracy(rank: int, world: int, cases: tuple[Case, ...]) -> None:
    """Every case: ring forward/backward vs float64 (rank 0), bytes vs the model and kernel launches (all)."""
    assert runtime.triton_runs_on(torch.device("cpu")), "spawned rank did not inherit TRITON_INTERPRET=1"
    _poison_kernel_outputs()
    for case in cases:
        q, k, v, dout, dlse = _problem(case)
        clear_sent_messages()
        before = runtime.launch_counts()
        got = _ring_run(case, q, k, v, dout, dlse)
        ran = runtime.launch_counts() - before
        for kernel in (*at.FORWARD_KERNELS, *at.BACKWARD_KERNELS):
            assert ran[kernel] > 0, f"rank {rank}: Triton kernel {kernel} did not run ({case})"
        _check_traffic(case, rank, world)
        if rank == 0:
            _check_accuracy(case, got, q, k, v, dout, dlse)
        dist.barrier()


def bad_input(rank: int, world: int) -> None:
    """Each bad call raises on every rank (no rank is left waiting); a good call afterwards still works."""
    q = torch.randn(1, 2, 4, 16)
    k = torch.randn(1, 2, 4, 16)

    def expect(error, match, *args, **kwargs):
        with pytest.raises(error, match=match):
            ring_attention(*args, **kwargs)

    # Shapes exchanged first: a shard with other heads on one rank.
    other_heads = torch.randn(1, 4, 4, 16) if rank == 1 else q
    expect(ValueError, "rank 1's call differs", other_heads, k, k)
    # Flags and layout must agree too.
    expect(ValueError, "differs", q, k, k, is_causal=rank == 0)
    # Shard lengths that no layout split gives (5 + 3 over 2 ranks contiguous is 4 + 4).
    uneven = torch.randn(1, 2, 5 if rank == 0 else 3, 16)
    expect(ValueError, r"hold \[5, 3\] tokens.*\[4, 4\]", uneven, uneven, uneven, layout="contiguous")
    # Too short for the layout: zigzag on 2 ranks needs 4 chunks, 3 tokens in all.
    short = torch.randn(1, 2, 2 if rank == 0 else 1, 16)
    expect(ValueError, "at least 4", short, short, short)
    # A rank whose own checks fail raises its error; the others learn it failed.
    if rank == 1:
        expect(TypeError, "is_causal must be a bool", q, k, k, is_causal=1)
    else:
        expect(ValueError, r"ranks \[1\] .*rejected", q, k, k, is_causal=True)
    bad_dtype = q.to(torch.float64) if rank == 0 else q
    expect(TypeError if rank == 0 else ValueError, "dtype|rejected", bad_dtype, k, k)
    # gather_sequence checks shapes the same way.
    with pytest.raises(ValueError, match="differs"):
        gather_sequence(torch.zeros(1, 2 + rank, 4, 16))
    with pytest.raises(ValueError, match="not a 'zigzag' split"):
        gather_sequence(torch.zeros(1, 2, 3 + 2 * rank, 16))
    # After all that the group is clean: a correct call runs and agrees with flash on the full sequence.
    full = [torch.randn(1, 2, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    out = ring_attention(*(shard_sequence(t) for t in full), is_causal=True)
    torch.testing.assert_close(gather_sequence(out), flash_attention(*full, is_causal=True))


def _record_order(events: list[str]):
    """Patch the p2p start, the flash ops and the waits so that their order lands in ``events``."""
    from llm_speed.attention import flash

    start, forward, backward = dist.batch_isend_irecv, flash.forward_op, flash.backward_op

    class Waited:
        def __init__(self, work, name):
            self.work, self.name = work, name

        def wait(self):
            events.append(f"wait {self.name}")
            return self.work.wait()

    def started(ops):
        name = f"t{len([e for e in events if e.startswith('start')])}"
        events.append(f"start {name}")
        return [Waited(work, name) for work in start(ops)]

    def kernel(op, label):
        def run(*args, **kwargs):
            events.append(label)
            return op(*args, **kwargs)

        return run

    dist.batch_isend_irecv = started
    flash.forward_op, flash.backward_op = kernel(forward, "fwd"), kernel(backward, "bwd")

    def restore():
        dist.batch_isend_irecv = start
        flash.forward_op, flash.backward_op = forward, backward

    return restore


def _check_overlap(rank: int) -> None:
    """Each transfer is started before a flash kernel runs and waited on only after it (the compute it can
    hide under), in forward and in backward."""
    events: list[str] = []
    restore = _record_order(events)
    try:
        q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
        ring_attention(q, k, v, is_causal=False).sum().backward()
    finally:
        restore()
    starts = [e.split()[1] for e in events if e.startswith("start")]
    assert len(starts) == 1 + 1 + 2, events  # forward K/V; backward K/V and two dK/dV
    for name in starts:
        begin, end = events.index(f"start {name}"), events.index(f"wait {name}")
        assert begin < end, events
        if name != starts[-1]:  # the last dK/dV goes home after the last block: nothing left to hide under
            assert any(e in ("fwd", "bwd") for e in events[begin:end]), (name, events)


def accuracy_bad_input_overlap(rank: int, world: int, cases: tuple[Case, ...]) -> None:
    """All three checks in one set of processes (starting a rank costs seconds)."""
    accuracy(rank, world, cases)
    bad_input(rank, world)
    _check_overlap(rank)


def _check_subgroups(rank: int, world: int) -> None:
    """Rings over sub-groups {0, 2} and {1, 3} at once: group ranks differ from global ranks, so the
    neighbours must be translated; each ring agrees with flash_attention on its own problem."""
    groups = [dist.new_group([r for r in range(world) if r % 2 == parity]) for parity in (0, 1)]
    group = groups[rank % 2]
    generator = torch.Generator().manual_seed(rank % 2)
    full = [torch.randn(1, 2, 9, 16, generator=generator) for _ in range(3)]
    leaves = [shard_sequence(t, group=group).requires_grad_() for t in full]
    out = ring_attention(*leaves, group=group, is_causal=True)
    out.sum().backward()
    got = [gather_sequence(t, group=group) for t in (out.detach(), *(x.grad for x in leaves))]
    expected_leaves = [t.clone().requires_grad_() for t in full]
    expected = flash_attention(*expected_leaves, is_causal=True)
    expected.sum().backward()
    for a, b in zip(got, (expected.detach(), *(x.grad for x in expected_leaves)), strict=True):
        torch.testing.assert_close(a, b)
    # The other ring's handle: what dist.new_group returned here, outside it (a sentinel, not a group).
    other = groups[1 - rank % 2]
    with pytest.raises(ValueError, match="not a member of the given process group"):
        ring_attention(*full, group=other)


def accuracy_and_subgroups(rank: int, world: int, cases: tuple[Case, ...]) -> None:
    accuracy(rank, world, cases)
    _check_subgroups(rank, world)
