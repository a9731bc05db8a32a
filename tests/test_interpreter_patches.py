"""llm_speed.core.interpreter_patches: the launch costs of the interpreter cut, what kernels compute kept."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from llm_speed.core import runtime

pytestmark = pytest.mark.skipif(not runtime.INTERPRETED, reason="installed under the interpreter only")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _add_twice_kernel(x_ptr, out_ptr, n, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(STEPS):
        acc += _twice(x)  # a helper called STEPS times in each program
    tl.store(out_ptr + offsets, acc, mask=mask)


@triton.jit
def _failing_kernel(x_ptr):
    tl.store(x_ptr + tl.arange(0, 4), _twice(tl.load(x_ptr + tl.arange(0, 8))))


def _swaps(monkeypatch) -> list:
    """Each language module the interpreter swaps builtins of (its ``_patch_lang_core``, called once a module
    by a swap that is really done)."""
    from triton.runtime import interpreter

    swaps = []
    original = interpreter._patch_lang_core

    def counted(lang, scope):
        swaps.append(lang)
        original(lang, scope)

    monkeypatch.setattr(interpreter, "_patch_lang_core", counted)
    return swaps


def test_a_launch_swaps_the_language_a_fixed_number_of_times_and_computes_the_same(monkeypatch):
    """As Triton ships, every helper call swaps again: 1 + 18 swaps for 3 programs of 5 calls and a tl.zeros
    (one of triton.language's own jit functions). Here the launch's own swap and the first call's of a helper
    that sees a module not swapped yet (tl.zeros sees triton.language.core), whatever the number of programs
    and calls (the first launch is left out: it finds the language as Triton imported it)."""
    counts = []
    for programs, steps in ((1, 1), (3, 5), (5, 9)):
        swaps = _swaps(monkeypatch)
        x = torch.randn(128 * programs)
        out = torch.empty_like(x)
        _add_twice_kernel[(programs,)](x, out, x.numel(), STEPS=steps, BLOCK=128)
        torch.testing.assert_close(out, x * 2.0 * steps)
        counts.append(len(swaps))
    assert counts[1] == counts[2] <= 4, counts  # (tl, tl.core), twice at most
    # put back once the launch returned: tl.load is Triton's builtin again, not the interpreter's
    assert tl.core.is_builtin(tl.load)


def test_a_failing_launch_leaves_the_next_one_swapped_in_full(monkeypatch):
    with pytest.raises(Exception, match="shape|incompatible|4|8"):
        _failing_kernel[(1,)](torch.zeros(8))
    assert tl.core.is_builtin(tl.load)
    swaps = _swaps(monkeypatch)
    x = torch.randn(64)
    out = torch.empty(64)
    _add_twice_kernel[(1,)](x, out, 64, STEPS=2, BLOCK=64)
    torch.testing.assert_close(out, x * 4.0)
    assert swaps  # the launch after a failure swaps the language itself


def test_the_patches_are_installed_once_each():
    from triton.runtime import interpreter

    from llm_speed.core import interpreter_patches

    def installed():
        return (interpreter._patch_lang, interpreter._patch_builtin, interpreter._get_np_dtype,
                interpreter.GridExecutor.__call__, tl.core.block_type.__new__, tl.core.block_type.__init__,
                tl.core.tensor.__init__)  # fmt: skip

    before = installed()
    assert interpreter._patch_lang.once_a_launch and interpreter._patch_builtin.names_once
    assert interpreter._get_np_dtype.cached and tl.core.block_type.shared
    interpreter_patches.apply()  # again: nothing is wrapped twice
    assert before == installed()


def test_numpy_types_are_the_interpreters(monkeypatch):
    from triton.runtime import interpreter

    from llm_speed.core import interpreter_patches

    calls = []

    def shipped(tt_dtype):  # stands in for Triton's own, to see what it is asked
        calls.append(tt_dtype)
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return np.dtype(np.uint64)
        return {tl.float32: np.dtype(np.float32), tl.bfloat16: np.dtype(np.uint16)}[tt_dtype]

    monkeypatch.setattr(interpreter, "_get_np_dtype", shipped)  # the installed cache comes back at teardown
    interpreter_patches.cache_numpy_types()
    cached = interpreter._get_np_dtype
    assert cached(tl.float32) == np.float32 and cached(tl.block_type(tl.float32, [4, 8])) == np.float32
    assert cached(tl.block_type(tl.bfloat16, [16])) == np.uint16
    assert cached(tl.block_type(tl.pointer_type(tl.float16), [16])) == np.uint64
    assert cached(tl.float32) == np.float32
    assert calls.count(tl.float32) == 1  # asked once a type


def test_an_interpreter_function_of_other_parameters_is_left_alone(monkeypatch):
    """A Triton whose interpreter changed what a replacement was written against keeps its own."""
    from triton.runtime import interpreter

    from llm_speed.core import interpreter_patches

    def other_np_dtype(tt_dtype, layout):  # another signature than (tt_dtype)
        return np.dtype(np.float32)

    def other_patch_builtin(pkg, scope):  # another signature than (pkg, builder, scope)
        return None

    monkeypatch.setattr(interpreter, "_get_np_dtype", other_np_dtype)
    monkeypatch.setattr(interpreter, "_patch_builtin", other_patch_builtin)
    interpreter_patches.cache_numpy_types()
    interpreter_patches.scan_builtins_once()
    assert interpreter._get_np_dtype is other_np_dtype and interpreter._patch_builtin is other_patch_builtin


def test_block_types_are_shared_and_equal_to_tritons_and_its_errors_kept():
    """A block type of a scalar or pointer element is made once (equal to the one Triton makes, its shape a
    tuple of ints); each tensor gets a shape of its own; a bad shape is still Triton's error."""
    core = tl.core
    assert core.block_type.shared
    a = tl.block_type(tl.float16, [16, 32])
    assert tl.block_type(tl.float16, [tl.constexpr(16), 32]) is a
    assert a.shape == [16, 32] and a.numel == 512 and a.name == "<['16', '32'], fp16>"
    assert tl.block_type(tl.bfloat16, [16, 32]) is not a and tl.block_type(tl.float16, [32, 16]) is not a
    pointers = tl.block_type(tl.pointer_type(tl.float16), [16])
    assert pointers is not tl.block_type(tl.pointer_type(tl.float16, const=True), [16])
    assert pointers.element_ty == tl.pointer_type(tl.float16)
    with pytest.raises(TypeError, match="0d block_type"):
        tl.block_type(tl.float16, [])
    with pytest.raises(ValueError, match="power of 2"):
        tl.block_type(tl.float16, [3])
    first, second = core.tensor(None, a), core.tensor(None, a)
    assert first.shape == second.shape and first.shape is not second.shape
    assert [int(d) for d in first.shape] == [16, 32] and first.numel == 512 and first.dtype == tl.float16
    scalar = core.tensor(None, tl.float32)
    assert len(scalar.shape) == 0 and scalar.numel == 1 and scalar.type is tl.float32

    class Sub(core.block_type):  # a subclass (as Gluon's distributed types are) is made as Triton makes it
        def __init__(self, element_ty, shape, tag):
            super().__init__(element_ty, shape)
            self.tag = tag

    sub = Sub(tl.float16, [16, 32], "x")
    assert sub is not a and sub.tag == "x" and sub.shape == [16, 32] and isinstance(sub, Sub)


def test_only_tritons_own_element_types_and_shapes_it_takes_are_shared():
    """An element Triton checks by identity keeps its identity (a block over an equal dtype made elsewhere
    is not shared); a pointer to a pointer (its pointee's address space is not in its name) and a shape
    Triton refuses (a Python tuple) are made as Triton makes them."""
    other_bf16 = tl.dtype("bf16")
    assert other_bf16 == tl.bfloat16 and other_bf16 is not tl.bfloat16
    assert tl.block_type(other_bf16, [8]).element_ty is other_bf16
    assert tl.block_type(tl.bfloat16, [8]).element_ty is tl.bfloat16
    shared = tl.block_type(tl.pointer_type(tl.pointer_type(tl.float16, "shared")), [8])
    plain = tl.block_type(tl.pointer_type(tl.pointer_type(tl.float16)), [8])
    assert shared is not plain and shared.element_ty.element_ty.address_space == "shared"
    tl.block_type(tl.float16, [8, 8])
    with pytest.raises(AssertionError):
        tl.block_type(tl.float16, (8, 8))
