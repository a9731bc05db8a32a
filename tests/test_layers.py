"""The package's layers, read from every import in the source (function-level imports included): no import
circle, and no module imports a layer above its own.

From the bottom: the foundation (``llm_speed.core``); the analytic model (``llm_speed.perf``, torch-free) and
the kernels and ops (``attention``, ``matmul``, ``fused``, ``moe``, ring attention), which import only the
foundation and each other; then the op table, modules, integrations, profiler, benchmarks, doctor and the
command line.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"

CORE = ("llm_speed.core",)
MODEL = ("llm_speed.perf",)
OPS = ("llm_speed.attention", "llm_speed.matmul", "llm_speed.fused", "llm_speed.moe",
       "llm_speed.distributed.ring", "llm_speed.distributed.layout", "llm_speed.gluon")  # fmt: skip
# The model's command and plotting modules belong to the command line above (they print through _cli).
COMMANDS = ("llm_speed.perf.cli_hardware", "llm_speed.perf.cli_models", "llm_speed.perf.cli_predict",
            "llm_speed.perf._cli_common", "llm_speed.perf.plot")  # fmt: skip
# What each layer may import (its own modules and those below).
ALLOWED = {CORE: CORE, MODEL: CORE + MODEL, OPS: CORE + OPS}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a ``from ... import`` in ``package`` reads from."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    return base


def imports_of(path: Path, module: str) -> set[str]:
    """The llm_speed / cuda_llm_ops modules ``module`` imports anywhere in its file (function bodies too), not
    counting ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    skipped = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for sub in ast.walk(node)
    }
    edges: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            edges.add(base)
            edges.update(f"{base}.{alias.name}" for alias in node.names)
    return {edge for edge in edges if edge.startswith(("llm_speed", "cuda_llm_ops"))}


def _graph() -> dict[str, set[str]]:
    files = {module_name(path): path for path in SRC.rglob("*.py")}
    # An edge to a package that contains the module is no circle: the package is being initialised.
    return {
        module: {
            edge
            for edge in imports_of(path, module)
            if edge in files and edge != module and not module.startswith(edge + ".")
        }
        for module, path in files.items()
    }


def test_no_import_circles():
    graph = _graph()
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = trail[trail.index(target) :] + [target] if target in trail else [module, target]
                pytest.fail(f"import circle: {' -> '.join(cycle)}")
            if target not in state:
                visit(target, [*trail, target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def _layer(module: str) -> tuple[str, ...] | None:
    if module in COMMANDS:
        return None
    for layer in ALLOWED:
        if any(module == prefix or module.startswith(prefix + ".") for prefix in layer):
            return layer
    return None


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for module, edges in sorted(_graph().items()):
        layer = _layer(module)
        if layer is None:
            continue
        for edge in sorted(edges):
            if not any(edge == prefix or edge.startswith(prefix + ".") for prefix in ALLOWED[layer]):
                wrong.append(f"{module} -> {edge}")
    assert not wrong, "imports up or across a layer:\n" + "\n".join(wrong)


def test_the_foundations_torch_free_modules_stay_torch_free():
    """The analytic model imports these without torch (``llm-speed gpus`` starts in well under a second)."""
    for name in ("gpus", "args", "sequence_split", "intmath", "chunking"):
        tree = ast.parse((SRC / "llm_speed" / "core" / f"{name}.py").read_text())
        top = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
        modules = {alias.name for node in top if isinstance(node, ast.Import) for alias in node.names}
        modules |= {node.module or "" for node in top if isinstance(node, ast.ImportFrom)}
        assert not any(m.split(".")[0] in ("torch", "triton", "numpy") for m in modules), name


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(path: Path, module: str, modules: set[str]) -> list[str]:
    """Where ``module`` takes a private name (``_x``, not a dunder) of another llm_speed module: ``from m
    import _x``, or ``m._x`` with ``m`` bound to an imported llm_speed module. A private module itself
    (``llm_speed._cli``: a shared module of the command line) is a module, not a name."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            if not base.startswith("llm_speed"):
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                if target in modules:
                    aliases[alias.asname or alias.name] = target
                elif _private(alias.name) and base != module:
                    found.append(f"{module}:{node.lineno} imports {base}.{alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("llm_speed") and alias.asname:
                    aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                and node.value.id in aliases and aliases[node.value.id] != module):  # fmt: skip
            found.append(f"{module}:{node.lineno} takes {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_module_takes_a_private_name_of_another():
    """A name another module needs is public (in a shared module where several need it): a private one
    may change with its module alone."""
    files = {module_name(path): path for path in SRC.rglob("*.py")}
    found = [use for module, path in sorted(files.items()) for use in private_uses(path, module, set(files))]
    assert not found, "private names taken across modules:\n" + "\n".join(found)


def test_the_private_name_rule_sees_both_spellings(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from llm_speed.attention.decode import _x\nfrom llm_speed.core import runtime\n"
                    "runtime._y\nfrom llm_speed import _cli\n_cli.console\n")  # fmt: skip
    modules = {"llm_speed.core.runtime", "llm_speed._cli", "llm_speed.attention.decode"}
    assert private_uses(path, "llm_speed.other.m", modules) == [
        "llm_speed.other.m:1 imports llm_speed.attention.decode._x",
        "llm_speed.other.m:3 takes llm_speed.core.runtime._y",
    ]
