import contextlib
import os

import torch

from llm_speed import _runtime


def test_interpreter_flag_matches_the_environment_the_kernels_were_defined_in():
    assert _runtime.INTERPRETED == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def test_triton_runs_on_cpu_only_through_the_interpreter():
    assert _runtime.triton_runs_on(torch.device("cpu")) == _runtime.INTERPRETED
    assert _runtime.triton_runs_on(torch.device("cuda"))
    assert not _runtime.triton_runs_on(torch.device("meta"))


def test_on_device_of_is_a_no_op_off_cuda():
    assert isinstance(_runtime.on_device_of(torch.empty(1)), contextlib.nullcontext)


def test_launch_counts_accumulate_per_kernel_name():
    before = _runtime.launch_count("test-kernel")
    _runtime.record_launch("test-kernel")
    _runtime.record_launch("test-kernel")
    assert _runtime.launch_count("test-kernel") == before + 2
    assert _runtime.launch_count("never-launched") == 0


def test_launch_counts_is_a_copy_whose_difference_shows_what_ran():
    before = _runtime.launch_counts()
    _runtime.record_launch("test-kernel-2")
    assert _runtime.launch_counts() - before == {"test-kernel-2": 1}
    before["test-kernel-2"] += 5  # changing the copy leaves the real counts alone
    assert _runtime.launch_count("test-kernel-2") == 1
