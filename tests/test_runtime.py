import contextlib
import os

import pytest
import torch

from llm_speed.core import runtime


def test_interpreter_flag_matches_the_environment_the_kernels_were_defined_in():
    assert runtime.INTERPRETED == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


def test_triton_runs_on_cpu_only_through_the_interpreter():
    assert runtime.triton_runs_on(torch.device("cpu")) == runtime.INTERPRETED
    assert runtime.triton_runs_on(torch.device("cuda"))
    assert not runtime.triton_runs_on(torch.device("meta"))


def test_on_device_of_is_a_no_op_off_cuda():
    assert isinstance(runtime.on_device_of(torch.empty(1)), contextlib.nullcontext)


def test_launch_counts_accumulate_per_kernel_name():
    before = runtime.launch_count("test-kernel")
    runtime.record_launch("test-kernel")
    runtime.record_launch("test-kernel")
    assert runtime.launch_count("test-kernel") == before + 2
    assert runtime.launch_count("never-launched") == 0


def test_launch_counts_is_a_copy_whose_difference_shows_what_ran():
    before = runtime.launch_counts()
    runtime.record_launch("test-kernel-2")
    assert runtime.launch_counts() - before == {"test-kernel-2": 1}
    before["test-kernel-2"] += 5  # changing the copy leaves the real counts alone
    assert runtime.launch_count("test-kernel-2") == 1


@pytest.mark.skipif(not runtime.INTERPRETED, reason="the fix is installed under the interpreter only")
def test_interpreter_scalars_of_one_dimension_convert_to_int():
    """Triton 3.6's interpreter (the GPU machine's, torch 2.11's pin) holds scalars as one-element 1-D arrays
    and converted them with int(array), which NumPy 2.4 refuses: every kernel loop failed there. The fix
    replaces the interpreter's tensor patch with one that squeezes first, whatever the Triton version."""
    import types

    import numpy as np
    from triton.runtime import interpreter

    assert interpreter._patch_lang_tensor.squeezes_index
    changes = {}
    scope = types.SimpleNamespace(set_attr=lambda obj, name, value: changes.__setitem__(name, value))
    interpreter._patch_lang_tensor(type("Tensor", (), {}), scope)
    one_element = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7], dtype=np.int32)))
    assert changes["__index__"](one_element) == 7
