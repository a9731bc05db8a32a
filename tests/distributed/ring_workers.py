"""Run a function on W processes joined by a gloo group on localhost, with a hard timeout, and the checks
those processes run. Spawned children inherit ``TRITON_INTERPRET=1`` (set by tests/conftest.py) and
``PYTHONPATH`` through the environment, so the flash kernels run interpreted on CPU in every rank."""

from __future__ import annotations

import datetime
import os
import socket
import time
from unittest import mock

import torch
import torch.multiprocessing as mp

# A collective waiting longer fails instead of hanging; generous because on 2 busy cores the other ranks
# wait in a barrier while rank 0 computes the references.
GROUP_TIMEOUT = datetime.timedelta(seconds=180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # W ranks share the machine's cores
    dist.init_process_group(
        "gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}", timeout=GROUP_TIMEOUT
    )
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout_s: float = 300.0) -> None:
    """``fn(rank, world, *args)`` on ``world`` spawned processes; an exception in any of them fails the
    caller with its traceback; past ``timeout_s`` every process is killed and the caller fails."""
    # The ranks run CPU tensors over gloo, so their Triton kernels need the interpreter, also on a machine
    # with a GPU (where this process has it off): spawned processes take the environment at their start.
    with mock.patch.dict(os.environ, TRITON_INTERPRET="1"):
        context = mp.start_processes(
            _entry, args=(world, free_port(), fn, args), nprocs=world, join=False, start_method="spawn"
        )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise TimeoutError(f"{world} ranks did not finish within {timeout_s} s")
