#!/usr/bin/env python3
"""The sha256 of ``triton_key()`` (``triton/runtime/cache.py``: the start of every Triton cache key) of an
unpacked Triton, computed from its files without importing it, so one Python can read the key of a wheel
built for another (docs/benchmarks.md: why a Triton cache built here misses on the GPU machine).

    python benchmarks/triton_key.py DIR      DIR holds triton/ (an unpacked wheel, or a --target install)

It reads what ``triton_key()`` reads, in its order: ``runtime/cache.py``, the modules of ``compiler/`` and
``backends/`` as ``pkgutil.walk_packages`` visits them (sorted names, packages depth first),
``_C/libtriton.so``, then ``language/``; and hashes their sha256s joined after the version, as it does.
The proof records the GPU machine's own (``versions.json``: ``triton_key_sha256``).
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path


def _modules(folder: Path) -> Iterator[Path]:
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.is_dir():
            if "." not in path.name and (path / "__init__.py").is_file():
                yield path / "__init__.py"
                yield from _modules(path)
        elif inspect.getmodulename(str(path)) not in (None, "__init__"):
            yield path


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def triton_key_sha256(root: Path) -> str:
    triton = root / "triton"
    version = next(
        line.split("=", 1)[1].strip().strip("'\"")
        for line in (triton / "__init__.py").read_text().splitlines()
        if line.startswith("__version__")
    )
    contents = [_sha(triton / "runtime" / "cache.py")]
    contents += [_sha(p) for p in _modules(triton / "compiler")]
    contents += [_sha(p) for p in _modules(triton / "backends")]
    contents.append(_sha(triton / "_C" / "libtriton.so"))
    contents += [_sha(p) for p in _modules(triton / "language")]
    return hashlib.sha256((version + "-".join(contents)).encode()).hexdigest()


if __name__ == "__main__":
    if len(sys.argv) != 2 or not (Path(sys.argv[1]) / "triton" / "runtime" / "cache.py").is_file():
        print(__doc__, file=sys.stderr)
        sys.exit(2)
    print(triton_key_sha256(Path(sys.argv[1])))
