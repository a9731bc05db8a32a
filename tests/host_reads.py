"""The guard every "no host read of device data" test runs its calls under: inside
:func:`host_reads_raise`, every way of reading a tensor's values on the host raises :class:`HostRead`.

A host read in an op's default path is a GPU synchronisation and makes the call impossible to capture in a
CUDA graph (tests/core/test_no_host_reads.py runs every public op under it; the op families' own tests run
their plan-cache checks under it)."""

from __future__ import annotations

import contextlib

import torch

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero",
         "unique")  # fmt: skip


class HostRead(AssertionError):
    pass


@contextlib.contextmanager
def host_reads_raise(monkeypatch):
    def refuse(name):
        def method(*args, **kwargs):
            raise HostRead(f"Tensor.{name} read device data on the host")

        return method

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, refuse(name))
        for name in ("nonzero", "unique", "equal"):
            patch.setattr(torch, name, refuse(f"torch.{name}"))
        yield
