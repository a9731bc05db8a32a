"""Run the kernel report: start the workers under the Triton build to check, gather their rows.

The build: the GPU machine's Triton (3.6, torch 2.11's pin) when ``LLM_SPEED_TRITON_GPU`` names the
directory ``make test`` unpacked it into, else the installed one (or a directory given explicitly). Its wheel
ships ``ptxas``, ``nvdisasm`` and ``cuobjdump``, which is all the compile and the disassembly need: no GPU, no
CUDA toolkit.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

GPU_BUILD_ENV = "LLM_SPEED_TRITON_GPU"
PACKAGE_ROOT = pathlib.Path(__file__).resolve().parents[2]  # the directory holding llm_speed/


def gpu_build() -> str | None:
    """The directory of the GPU machine's Triton build when ``LLM_SPEED_TRITON_GPU`` names one that holds
    it, else None (the installed Triton)."""
    directory = os.environ.get(GPU_BUILD_ENV)
    if directory and (pathlib.Path(directory) / "triton").is_dir():
        return directory
    return None


def worker_environment(build: str | None, cache_dir: str) -> dict[str, str]:
    """The environment of a worker: ``build`` first on the path (None: the installed Triton), this
    llm_speed next, compiled kernels (no interpreter), a fresh Triton cache."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    paths = [p for p in (build, str(PACKAGE_ROOT), env.get("PYTHONPATH")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["TRITON_CACHE_DIR"] = cache_dir
    return env


def first_workers(workers: int, cpus: int | None = None) -> int:
    """The workers started before the kernel count is known: ``workers``, but no more than the CPUs (each
    captures every problem; more would only wait for a CPU, and a count past the kernels' would start
    processes with nothing to compile)."""
    return max(1, min(workers, cpus or os.cpu_count() or 1))


def shards(workers: int, kernels: int) -> int:
    """The processes that compile: ``workers``, but never more than there are ``kernels`` (at least one)."""
    return max(1, min(workers, kernels))


def _drain(stream, into: list[str]) -> None:
    into.append(stream.read())


def run_report(
    *,
    gpu: str = "h100-sxm",
    ops: list[str] | None = None,
    options: dict | None = None,
    problem_set: str = "default",
    workers: int | None = None,
    build: str | None = None,
    sass_dir: str | None = None,
    timeout: float = 900,
    progress: Callable[[int, int | None], None] | None = None,
) -> dict:
    """Compile the kernels of the problems and read them (:mod:`llm_speed.kernel_report.worker`).

    ``problem_set``: "default" (the op-table rows' problems, :func:`problems.default_problems`), "shipped"
    (every attention configuration of the GPU's tier, :func:`problems.shipped_problems`, the default
    problems and the candidate launch choices', :func:`problems.candidate_problems`) or "tier" (the
    tier's attention configurations only).

    Returns ``{"gpu", "triton_build", "rows": [...]}`` with one row per distinct kernel, in the order the
    problems first launch them. ``workers`` processes share the compiles (default: the CPU count; never more
    than there are kernels: the result's ``workers`` says how many compiled).
    ``progress(compiled, total)`` is called as the workers report: once the kernel count is known (total
    None until then), and after each kernel."""
    workers = max(1, workers or os.cpu_count() or 1)
    request = {"gpu": gpu, "set": problem_set, "ops": ops, "options": options or {}, "sass_dir": sass_dir}
    if sass_dir:
        pathlib.Path(sass_dir).mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    totals: list[int] = []
    problem_errors: list[str] = []
    lock = threading.Lock()
    counted = threading.Event()  # a worker has counted the kernels

    def collect(stream) -> None:
        # Each worker prints its kernel count first, then one row per compiled kernel, as it goes.
        for line in stream:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            with lock:
                if "kernels" in record:
                    totals.append(record["kernels"])
                    counted.set()
                elif "problem_error" in record:
                    problem_errors.append(record["problem_error"])
                else:
                    rows.append(record)
                if progress is not None:
                    progress(len(rows), totals[0] if totals else None)

    with tempfile.TemporaryDirectory(prefix="llm-speed-kernels-") as cache:
        processes, readers, errors = [], [], []

        def start(shard: int, shards: int | None) -> subprocess.Popen:
            env = worker_environment(build, os.path.join(cache, str(shard)))
            process = subprocess.Popen(
                [sys.executable, "-m", "llm_speed.kernel_report.worker",
                 json.dumps(dict(request, shard=shard, shards=shards))],
                stdin=subprocess.PIPE if shards is None else subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
            )  # fmt: skip
            error: list[str] = []
            readers.extend([
                threading.Thread(target=collect, args=(process.stdout,), daemon=True),
                threading.Thread(target=_drain, args=(process.stderr, error), daemon=True),
            ])  # fmt: skip
            readers[-2].start()
            readers[-1].start()
            processes.append(process)
            errors.append(error)
            return process

        deadline = time.monotonic() + timeout
        # The kernel count is known only once a worker has captured the problems: the first workers (no more
        # than the CPUs, which their captures keep busy) start at once and learn the compile processes' count
        # from the first count, then the rest start (shards(): never more than there are kernels).
        early = [start(shard, None) for shard in range(first_workers(workers))]
        while not counted.wait(0.05):
            if all(p.poll() is not None for p in early) or time.monotonic() > deadline:
                break
        with lock:
            compile_processes = shards(workers, totals[0]) if totals else 0
        failures = []
        if not totals and any(p.poll() is None for p in early):  # past the deadline before a count
            failures.append(f"a worker ran past {timeout:g} s")
            for process in early:
                process.kill()
        for process in early:
            try:
                process.stdin.write(json.dumps({"shards": compile_processes}) + "\n")
                process.stdin.close()
            except OSError:  # the worker has already exited (its error is read below)
                pass
        for shard in range(len(early), compile_processes):
            start(shard, compile_processes)
        for process in processes:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                failures.append(f"a worker ran past {timeout:g} s")
        for reader in readers:
            reader.join()
        for process, error in zip(processes, errors, strict=True):
            if process.returncode:
                failures.append("".join(error)[-3000:])
    total = totals[0] if totals else None
    if problem_errors:  # bad input (every worker makes the same problems: one says it for all)
        raise ValueError(f"the problems cannot be made: {problem_errors[0]}")
    if failures:
        raise RuntimeError("the kernel report's workers failed:\n" + "\n".join(failures))
    rows.sort(key=lambda row: row["index"])
    if total is not None and len(rows) != total:
        raise RuntimeError(f"the kernel report's workers returned {len(rows)} of {total} kernels")
    version = rows[0]["triton"] if rows else None
    return {"gpu": gpu, "triton_build": build or "installed", "triton": version, "workers": compile_processes,
            "rows": rows}
