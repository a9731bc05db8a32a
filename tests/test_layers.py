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
       "llm_speed.distributed.ring", "llm_speed.distributed.layout")  # fmt: skip
# The model's command and plotting modules belong to the command line above (they print through _cli).
COMMANDS = ("llm_speed.perf.cli_hardware", "llm_speed.perf.cli_models", "llm_speed.perf.cli_predict",
            "llm_speed.perf._cli_common", "llm_speed.perf.plot")  # fmt: skip
# What each layer may import (its own modules and those below).
ALLOWED = {CORE: CORE, MODEL: CORE + MODEL, OPS: CORE + OPS}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
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
