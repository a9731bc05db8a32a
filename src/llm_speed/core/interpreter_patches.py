"""What llm-speed changes in Triton's interpreter (``TRITON_INTERPRET=1``), in this process, applied by
:mod:`llm_speed.core.runtime` when the interpreter is on: one fix, and four costs of every launch that do
not change what a kernel computes. Each checks that the interpreter has what it replaces, with the same
parameters (Triton 3.6, the GPU machine's, and 3.9, the dev pin, do), and otherwise leaves it alone.

Measured on this repository's interpreted attention tests (accuracy and overlap, 54 tests, one process,
2-core development CPU): 43.4 s as Triton ships, 28.7 s with :func:`patch_language_once_a_launch`, 23.8 s
with :func:`scan_builtins_once` too, 22.6 s with :func:`cache_numpy_types` too. :func:`share_block_types`
(2026-12-07): an interpreted causal forward + backward (1 x 2 heads x 200 tokens, d = 64) three times, CPU
seconds, three runs each way alternated: 1.89, 2.25, 1.37 without, 1.51, 1.59, 1.05 with (0.71-0.80x;
Triton 3.6: 2.05 against 1.50), the same bits out.
"""

from __future__ import annotations

import inspect
from typing import Any


def _interpreter():
    try:
        from triton.runtime import interpreter
    except ImportError:  # a Triton without the interpreter: nothing to change
        return None
    return interpreter


def _takes(function, *names: str) -> bool:
    """Whether ``function`` exists and takes exactly these parameters: a replacement is only put where the
    interpreter's function is the one it was written against (another Triton keeps its own)."""
    try:
        return tuple(inspect.signature(function).parameters) == names
    except (TypeError, ValueError):  # None, or not introspectable
        return False


def apply() -> None:
    """All of them (each once)."""
    squeeze_scalar_index()
    patch_language_once_a_launch()
    scan_builtins_once()
    cache_numpy_types()
    share_block_types()


def squeeze_scalar_index() -> None:
    """Triton 3.6's interpreter (torch 2.11's pin) converts a scalar to a Python int with ``int(array)``, and
    its scalars are one-element arrays of one dimension, which NumPy 2.4 no longer converts: every ``range``
    over a computed bound (all our kernels' loops) fails. Later Triton squeezes the array first; this does
    the same for the interpreter's patched ``tl.tensor``."""
    interpreter = _interpreter()
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if getattr(original, "squeezes_index", False) or not _takes(original, "tensor", "scope"):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.squeezes_index = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def patch_language_once_a_launch() -> None:
    """The interpreter swaps ``triton.language``'s builtins for interpreted ones when a kernel launches and
    puts them back when it returns (``GridExecutor.__call__``); it swaps them again on every call of a
    ``@triton.jit`` helper inside the kernel (``_patch_lang``), each time scanning the language's members to
    find them swapped already: ~0.6 ms a call, paid per program per loop iteration, 40% of an interpreted
    attention test. Here a helper's call skips it when the launch running it has swapped every language
    module the helper sees; a launch's own swap, and the first call of a helper that sees a module not swapped
    yet, are done as before (Triton never puts a helper's swap back: the next calls find it done)."""
    interpreter = _interpreter()
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    done = getattr(original, "once_a_launch", False)
    if done or None in (executor, scope_type) or not _takes(original, "fn"):
        return
    import triton.language as tl

    languages: dict[Any, frozenset] = {}  # a jit function -> the language modules its globals see
    launches: list[frozenset | None] = []  # per running launch: the modules it swapped (None: not yet)

    def languages_of(fn) -> frozenset:
        found = languages.get(fn)
        if found is None:
            seen = fn.__globals__.values()
            found = languages[fn] = frozenset(v for v in seen if inspect.ismodule(v) and v in (tl, tl.core))
        return found

    def patch_lang(fn):
        if launches and launches[-1] is not None and languages_of(fn) <= launches[-1]:
            return scope_type()  # swapped already: the launch's own scope puts everything back
        scope = original(fn)
        if launches:  # the launch's own swap, or a helper's of a module the launch had not swapped (such as
            # triton.language.core for triton.language's own jit functions): swapped from here on
            launches[-1] = languages_of(fn) | (launches[-1] or frozenset())
        return scope

    run_launch = executor.__call__

    def call(self, *args, **kwargs):
        launches.append(None)
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            launches.pop()

    patch_lang.once_a_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = call


def scan_builtins_once() -> None:
    """A launch's swap finds the builtins of ``tl``, ``tl.core``, ``tl.tensor``, ``tl.math`` and tensor
    descriptors with ``inspect.getmembers`` (which sorts a few hundred members: ~0.15 ms each, five a
    launch); here from the names the first scan of each found, checked to be builtins still."""
    interpreter = _interpreter()
    original = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    fits = _takes(original, "pkg", "builder", "scope") and _takes(
        patch_attr, "obj", "name", "member", "builder", "scope"
    )
    if getattr(original, "names_once", False) or not fits:
        return
    import triton.language as tl

    names_of: dict[Any, tuple[str, ...]] = {}  # a module or class -> its builtins' names

    def patch_builtin(pkg, builder, scope) -> None:
        names = names_of.get(pkg)
        if names is None:
            names = names_of[pkg] = tuple(
                name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)
            )
        for name in names:
            member = getattr(pkg, name, None)
            if tl.core.is_builtin(member):
                patch_attr(pkg, name, member, builder, scope)

    patch_builtin.names_once = True
    interpreter._patch_builtin = patch_builtin


def cache_numpy_types() -> None:
    """The interpreter's NumPy type of a Triton type builds its 19-entry table on every call (one an
    operation of every program); here each type's answer is kept. A block's type is its element's (a block of
    pointers: a pointer's, uint64), as the interpreter answers."""
    interpreter = _interpreter()
    original = getattr(interpreter, "_get_np_dtype", None)
    if getattr(original, "cached", False) or not _takes(original, "tt_dtype"):
        return
    import triton.language as tl

    found: dict[Any, Any] = {}

    def get_np_dtype(tt_dtype):
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return found[element]
        except KeyError:
            answer = found[element] = original(element)
            return answer
        except TypeError:  # an unhashable type: asked each time, as the interpreter does
            return original(tt_dtype)

    get_np_dtype.cached = True
    interpreter._get_np_dtype = get_np_dtype


def share_block_types() -> None:
    """Every operation of every program makes a block type for its result (``tl.block_type``: the shape
    checked, a power of two each, and its name formatted) and a tensor that turns that shape into a tuple of
    ``constexpr`` values (``tl.tensor``): about a fifth of an interpreted attention test. Here a block type of
    one of Triton's own scalar types (or a pointer to one) and whole-number dims is made once and shared
    (Triton never changes one: its shape is copied into a list wherever a new one is derived), and a plain
    tensor's shape and element count are made from those its type's first tensor got (its own tuple each,
    over the same constexpr values). What a kernel computes is unchanged: the types are equal to the ones they
    replace (checked against Triton 3.6 and 3.9: the same output bits, and the same TTIR to PTX when a real
    compile runs beside the patch; audit 19)."""
    import triton.language as tl

    core = tl.core
    block, tensor = core.block_type, core.tensor
    fits = _takes(block.__init__, "self", "element_ty", "shape")
    fits = fits and _takes(tensor.__init__, "self", "handle", "type")
    if getattr(block, "shared", False) or not fits:
        return
    make_block, make_tensor = block.__init__, tensor.__init__
    elements = (core.dtype, core.pointer_type)
    blocks: dict[tuple, Any] = {}  # (element's class, name, address space, const, dims) -> the block type
    # Triton's own dtype objects: Triton checks some elements by identity (``is tl.bfloat16``), so a block
    # type is shared only over these (a pointer's pointee too), never over an equal dtype made elsewhere.
    canonical = {d.name: d for d in vars(tl).values() if type(d) is core.dtype}

    def key_of(element_ty, shape) -> tuple | None:
        if type(shape) not in (list, core.tuple):  # what Triton refuses (a Python tuple, None) it refuses
            return None
        leaf = element_ty.element_ty if type(element_ty) is core.pointer_type else element_ty
        if type(leaf) is not core.dtype or canonical.get(leaf.name) is not leaf:
            return None  # a pointer to a pointer (its pointee's address space is not in the name), ...
        dims = [s.value if isinstance(s, core.constexpr) else s for s in shape]
        if not all(type(d) is int for d in dims):
            return None  # anything else is made as Triton makes it (its errors included)
        flags = (getattr(element_ty, "address_space", None), getattr(element_ty, "const", None))
        return (type(element_ty), element_ty.name, *flags, *dims)

    def new_block(cls, *args, **kwargs):
        if cls is not block or kwargs or len(args) != 2:  # a subclass, or another call: Triton's own
            return object.__new__(cls)
        key = key_of(*args)
        found = blocks.get(key) if key is not None else None
        if found is None:
            found = object.__new__(cls)
            make_block(found, *args)
            found.__dict__["_shared"] = True
            if key is not None:
                blocks[key] = found
        return found

    def init_block(self, element_ty, shape):
        if not self.__dict__.get("_shared"):  # not made by new_block: a subclass's, made here
            make_block(self, element_ty, shape)

    shapes: dict[tuple, tuple] = {}  # a type's (class, name) -> (its shape's values, their tuple type, numel)
    plain = (block, *elements)  # types whose name says their shape (a subclass's may not)

    def init_tensor(self, handle, type):
        key = (type.__class__, type.name) if type.__class__ in plain and self.__class__ is tensor else None
        found = shapes.get(key) if key is not None else None
        if found is None:
            make_tensor(self, handle, type)
            if key is not None and isinstance(self.shape, core.tuple):
                shapes[key] = (list(self.shape.values), self.shape.type, self.numel)
            return
        values, shape_type, numel = found
        self.handle = handle
        self.numel = numel
        self.type = type
        self.dtype = type.scalar
        self.shape = core.tuple(values, shape_type)

    block.__new__ = staticmethod(new_block)
    block.__init__ = init_block
    block.shared = True
    tensor.__init__ = init_tensor
