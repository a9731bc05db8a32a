"""Compile the attention kernels of an old commit at the tiles a GPU sweep measured, and read what the
compiler made of them: registers, spills (bytes, and local-memory instructions inside loops), shared
memory, occupancy, tensor-core instructions and the wgmma wait depth of the loop.

The H100 block-size sweeps (``benchmarks/results/h100-sxm/unrecorded-tile-sweep-1/sweep.jsonl``,
``unrecorded-tile-sweep-2/sweep2.jsonl``) timed commit af147ec's kernels. A performance model that explains
those timings needs the real registers, spills and occupancy of each measured kernel, not today's kernels at
the same tile. So:

1. ``git archive`` the commit's ``src/llm_speed`` into a temporary directory as the package
   ``llm_speed_at_<sha>`` (every ``llm_speed`` name in its sources rewritten, torch.library namespaces
   included), importable beside the current ``llm_speed``.
2. Worker processes (``--workers``, default 2) run with the GPU machine's Triton first on ``PYTHONPATH``
   (``LLM_SPEED_TRITON_GPU``, else ``.cache/triton-3.6.0`` when it exists, else the installed Triton),
   ``TRITON_INTERPRET`` unset and a fresh ``TRITON_CACHE_DIR`` each, as the kernel report's workers do
   (:func:`llm_speed.kernel_report.report.worker_environment`). For every distinct (direction, causal,
   head_dim, config) of the sweeps' flash rows, plus the commit's own default tiles (fp16, head_dim 64 and
   128, causal and not) and the sanity-check tile below, a worker forces the tile the way the sweep did
   (``launch.forward_config`` / ``launch.backward_config`` replaced) and calls the old launcher
   (``launch.forward`` / ``launch.backward``) with CPU tensors of the sweep's problem (fp16, dense
   ``[batch, heads, seq, head_dim]``) under the kernel report's stand-in H100 driver
   (:func:`llm_speed.kernel_report.build.stand_in_driver`). ``JITFunction.run`` is replaced meanwhile: it
   records each launch (kernel, grid, keyword arguments, warps, stages) and launches nothing. Each recorded
   launch is then specialised, compiled for sm_90a and read by the kernel report's own helpers
   (``build.specialise``, ``compile_build``, ``disassemble``, ``analyse``).
3. One row per kernel (forward; dK/dV and dQ of a backward) goes to ``--output`` (JSON). ``config`` is the
   tile as the sweep names it (``[BLOCK_M, BLOCK_N, num_warps, num_stages]``; for a backward, the dK/dV
   tile, also on its dQ row, whose kernel runs with BLOCK_M and BLOCK_N swapped: see ``tile``), so rows join
   the sweep on (direction, causal, head_dim, config). A kernel that compiles but cannot launch (shared
   memory over the H100's 227 KiB per block) keeps its numbers and gets an ``error``; so does one that
   fails to compile. ``sources`` says why a tile is there, ``measured_ms`` what the sweeps timed (None for a
   row that failed there). About a minute on two CPU cores (68 kernels).

Works for commits whose attention launcher has af147ec's API: ``launch.forward(q, k, v, masking, scale,
two_pass=False, packed=None)``, ``launch.backward(dout, q, k, v, out, lse, dlse, masking, scale,
packed=None)``, ``launch.Masking(is_causal=...)``, tiles from ``forward_config(block_d, dtype)`` /
``backward_config(block_d, dtype)`` imported into ``launch``; and with the kernel names of
``KERNELS`` below. The current checkout must have ``llm_speed.kernel_report``. No GPU is needed.

    python benchmarks/compile_measured_tiles.py --commit af147ec \\
        --sweeps benchmarks/results/h100-sxm/unrecorded-tile-sweep-1/sweep.jsonl \\
                 benchmarks/results/h100-sxm/unrecorded-tile-sweep-2/sweep2.jsonl \\
        --output benchmarks/results/h100-sxm/compiled-af147ec.json

(run with the repository's Python, ``.venv/bin/python``, from the repository root).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import queue
import re
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # the current llm_speed (its kernel report), also when not installed

from llm_speed.kernel_report import report  # noqa: E402

# Our name of each kernel -> the Triton function the old launcher starts.
KERNELS = {
    "forward": "_attention_fwd_kernel",
    "dkdv": "_flash_bwd_dkdv_kernel",
    "dq": "_flash_bwd_dq_kernel",
}
KERNELS_OF = {"fwd": ("forward",), "bwd": ("dkdv", "dq")}
# The sweep's problem (benchmarks/attention_sweep.py at 66100d9): 16384 tokens, 2048 model width.
SEQ, TOKENS, WIDTH = 16384, 16384, 2048
DEFAULT_HEAD_DIMS = (64, 128)
# The numbers for af147ec's d=128 dK/dV kernel at 64 x 64, 4 warps, 2 stages: compiled here too.
CHECK = [("bwd", causal, 128, (64, 64, 4, 2)) for causal in (False, True)]


# --- the old package ----------------------------------------------------------------------------------------


def resolve(commit: str) -> str:
    """The full hash of ``commit``."""
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", f"{commit}^{{commit}}"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip


def unpack(full: str, root: pathlib.Path) -> str:
    """Unpack ``src/llm_speed`` of commit ``full`` as the package ``llm_speed_at_<sha7>`` under ``root``."""
    name = f"llm_speed_at_{full[:7]}"
    archive = subprocess.run(["git", "-C", str(REPO), "archive", full, "src/llm_speed"],
                             capture_output=True, check=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    package = root / name
    (root / "src" / "llm_speed").rename(package)
    word = re.compile(r"\bllm_speed\b")
    for path in package.rglob("*.py"):
        path.write_text(word.sub(name, path.read_text()))
    return name


# --- what to compile ----------------------------------------------------------------------------------------


def problem_of(head_dim: int) -> dict:
    return {"seq": SEQ, "batch": max(1, TOKENS // SEQ), "heads": WIDTH // head_dim}


def sweep_jobs(paths: list[str]) -> dict[tuple, dict]:
    """(direction, causal, head_dim, config) -> job, for every flash row of the sweeps."""
    jobs: dict[tuple, dict] = {}
    for path in paths:
        for line in pathlib.Path(path).read_text().splitlines():
            row = json.loads(line) if line.strip() else {}
            if row.get("impl") != "flash":
                continue
            key = (row["direction"], row["causal"], row["head_dim"], tuple(row["config"]))
            problem = {name: row[name] for name in ("seq", "batch", "heads")}
            job = jobs.setdefault(key, {"key": key, "problem": problem, "sources": [], "measured": []})
            if job["problem"] != problem:
                raise SystemExit(f"{key}: measured on two problems, {job['problem']} and {problem}")
            job["sources"].append(f"sweep {pathlib.Path(path).parent.name}/{pathlib.Path(path).name}")
            job["measured"].append(row.get("ms"))  # None: the row has an "error"
    return jobs


def add(jobs: dict, key: tuple, source: str) -> None:
    job = jobs.setdefault(key, {"key": key, "problem": problem_of(key[2]), "sources": [], "measured": []})
    if source not in job["sources"]:
        job["sources"].append(source)


# --- the worker ---------------------------------------------------------------------------------------------


def capture_launches(package: str, direction: str, causal: bool, head_dim: int, config, problem: dict):
    """The launches the old launcher makes for one problem and forced tile: ``build.capture.Launch`` rows
    whose plans carry what the kernel report's helpers read (kernel, grid, fixed arguments, warps, stages)."""
    import importlib
    import types

    import torch
    from triton.runtime.jit import JITFunction

    launch = importlib.import_module(f"{package}.attention.launch")
    from llm_speed.kernel_report import capture

    launches = []

    def record(self, *args, grid, warmup, **kwargs):
        if args:
            raise RuntimeError(f"{self.__name__}: positional arguments, this script expects keywords only")
        num_warps, num_stages = kwargs.pop("num_warps", 4), kwargs.pop("num_stages", 3)
        plan = types.SimpleNamespace(kernel=types.SimpleNamespace(fn=self, name=self.__name__), grid=grid,
                                     fixed=kwargs, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
        launches.append(capture.Launch(direction, json.dumps(problem), plan, {}))
        return None

    name = "forward_config" if direction == "fwd" else "backward_config"
    forced = launch.BlockConfig(*config)
    saved_config, saved_run = getattr(launch, name), JITFunction.run
    setattr(launch, name, lambda block_d, dtype, device=None: forced)
    JITFunction.run = record
    try:
        shape = (problem["batch"], problem["heads"], problem["seq"], head_dim)
        q, k, v, out, dout = (torch.empty(shape, dtype=torch.float16) for _ in range(5))
        lse = torch.empty(shape[:3], dtype=torch.float32)
        masking, scale = launch.Masking(is_causal=causal), head_dim**-0.5
        if direction == "fwd":
            launch.forward(q, k, v, masking, scale)
        else:  # autograd hands the unused LSE a gradient of zeros
            launch.backward(dout, q, k, v, out, lse, torch.zeros_like(lse), masking, scale)
    finally:
        setattr(launch, name, saved_config)
        JITFunction.run = saved_run
    return launches


def compile_item(package: str, item: dict, target) -> dict:
    """One kernel of one job, compiled and read."""
    from llm_speed.kernel_report import build

    direction, causal, head_dim, config = item["key"]
    row = {"direction": direction, "kernel": item["kernel"], "causal": causal, "head_dim": head_dim,
           "dtype": "fp16", "config": list(config)}  # fmt: skip
    try:
        with build.stand_in_driver(target):
            launches = capture_launches(package, direction, causal, head_dim, config, item["problem"])
            (taken,) = [one for one in launches if one.plan.kernel.name == KERNELS[item["kernel"]]]
            made = build.specialise(taken)
        plan = taken.plan
        compiled, log, seconds = build.compile_build(made)
        sass, usage = build.disassemble(compiled.asm["cubin"], target.arch)
        read = build.analyse(compiled, log, sass, usage, target, plan)
    except Exception as error:  # a tile that does not compile is a finding
        return dict(row, error=f"{type(error).__name__}: {error}"[:2000])
    row.update({name: read[name] for name in (
        "registers", "spill_store_bytes", "spill_load_bytes", "spill_instructions", "loop_spill_instructions",
        "inner_loop_spill_instructions", "shared_bytes", "blocks_per_sm", "warps_per_sm", "tensor_cores",
        "wgmma_wait")})  # fmt: skip
    row.update({
        "tile": dict({name: plan.fixed[name] for name in ("BLOCK_M", "BLOCK_N", "BLOCK_D")},
                     num_warps=plan.num_warps, num_stages=plan.num_stages),
        "stack_bytes": read["stack_bytes"],
        "loops": read["loops"],
        "occupancy_limited_by": read["occupancy_limited_by"],
        "cp_async_wait": read["cp_async_wait"],
        "tma": read["tma"],
        "compile_seconds": round(seconds, 2),
        "error": None,
    })  # fmt: skip
    if read["shared_bytes"] > read["shared_limit"]:  # compiles, but the launch is refused on the GPU
        row["error"] = (f"OutOfResources: out of resource: shared memory, Required: {read['shared_bytes']}, "
                        f"Hardware limit: {read['shared_limit']}")  # fmt: skip
    return row


def defaults(package: str, head_dims) -> dict:
    """The commit's own fp16 tiles on the H100 (its stand-in device): {"fwd/128": [BM, BN, w, s], ...}."""
    import importlib

    import torch

    launch = importlib.import_module(f"{package}.attention.launch")
    tiles = {}
    for direction, lookup in (("fwd", launch.forward_config), ("bwd", launch.backward_config)):
        for head_dim in head_dims:
            cfg = lookup(head_dim, torch.float16)
            tiles[f"{direction}/{head_dim}"] = [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]
    return tiles


def worker(package: str, gpu: str) -> int:
    """One JSON line on stdout per JSON request line on stdin (a kernel item, or ``{"defaults": [..]}``)."""
    import importlib

    import triton

    from llm_speed.kernel_report import build

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    if importlib.import_module(f"{package}._runtime").INTERPRETED:
        raise SystemExit(f"{package}._runtime.INTERPRETED is set: its constexprs would be the interpreter's")
    target = build.target_of(gpu)
    for line in sys.stdin:
        request = json.loads(line)
        if "defaults" in request:
            answer = {"defaults": defaults(package, request["defaults"])}
        else:
            answer = compile_item(package, request, target)
            answer.update(target=target.arch, triton=triton.__version__)
        print(json.dumps(answer), flush=True)
    return 0


# --- the driver ---------------------------------------------------------------------------------------------


class Pool:
    """``workers`` worker processes fed one request at a time from a shared queue."""

    def __init__(self, workers: int, package: str, old_root: str, triton_build: str | None, gpu: str,
                 cache: str):  # fmt: skip
        self.processes = []
        for index in range(workers):
            env = report.worker_environment(triton_build, os.path.join(cache, str(index)))
            env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], old_root])
            self.processes.append(subprocess.Popen(
                [sys.executable, __file__, "--worker", package, "--gpu", gpu],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(REPO),
            ))  # fmt: skip

    @staticmethod
    def ask(process, request: dict) -> dict:
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker exited (status {process.wait()}) on {request}")
        return json.loads(line)

    def map(self, requests: list[dict], progress) -> list[dict]:
        todo: queue.Queue = queue.Queue()
        for index, request in enumerate(requests):
            todo.put((index, request))
        answers: list = [None] * len(requests)
        failures: list[str] = []

        def serve(process):
            while not failures:
                try:
                    index, request = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    answers[index] = self.ask(process, request)
                except Exception as error:
                    failures.append(str(error))
                    return
                progress(answers[index])

        threads = [threading.Thread(target=serve, args=(process,)) for process in self.processes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise RuntimeError("; ".join(failures))
        return answers

    def close(self) -> None:
        for process in self.processes:
            process.stdin.close()
            process.wait()


def default_triton_build() -> str | None:
    local = REPO / ".cache" / "triton-3.6.0"
    return report.gpu_build() or (str(local) if (local / "triton").is_dir() else None)


def sort_key(row: dict):
    return (row["direction"] != "fwd", row["head_dim"], row["causal"], row["config"],
            list(KERNELS).index(row["kernel"]))  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commit", default="af147ec", help="the commit whose kernels the sweeps timed")
    parser.add_argument("--sweeps", nargs="+", default=[], help="sweep JSON-lines files (attention_sweep.py)")
    parser.add_argument("--output", help="JSON file to write (default: stdout)")
    parser.add_argument("--gpu", default="h100-sxm", help="GPU table entry compiled for")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--triton",
        default=default_triton_build(),
        help="the Triton build's directory (default: the GPU machine's)",
    )
    parser.add_argument(
        "--causal-sweep",
        action="store_true",
        help="also compile every sweep tile causal (the sweeps measured non-causal only)",
    )
    parser.add_argument("--worker", metavar="PACKAGE", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.gpu)

    began = time.perf_counter()
    full = resolve(args.commit)
    with tempfile.TemporaryDirectory(prefix="compile-measured-") as scratch:
        old_root = os.path.join(scratch, "old")
        package = unpack(full, pathlib.Path(old_root))
        cache = os.path.join(scratch, "cache")
        pool = Pool(max(1, args.workers), package, old_root, args.triton, args.gpu, cache)
        try:
            jobs = sweep_jobs(args.sweeps)
            if args.causal_sweep:
                for key in list(jobs):
                    add(jobs, (key[0], True, *key[2:]), "sweep tile, causal")
            tiles = Pool.ask(pool.processes[0], {"defaults": list(DEFAULT_HEAD_DIMS)})["defaults"]
            for name, tile in tiles.items():
                direction, head_dim = name.split("/")
                for causal in (False, True):
                    add(jobs, (direction, causal, int(head_dim), tuple(tile)), f"{args.commit} default")
            for key in CHECK:
                add(jobs, key, "sanity check")
            items = [dict(job, kernel=name) for job in jobs.values() for name in KERNELS_OF[job["key"][0]]]
            items.sort(key=lambda item: item["key"][0] != "bwd")  # the longer compiles first
            print(f"{len(jobs)} tiles, {len(items)} kernels, {len(pool.processes)} workers", file=sys.stderr)

            def progress(row):
                tile = f"{row['direction']} {row['kernel']} d{row['head_dim']} causal={row['causal']}"
                tile += f" {row['config']}"
                print(f"  {tile}: {row.get('registers')} regs, {row.get('error') or 'ok'}", file=sys.stderr)

            rows = pool.map([{k: v for k, v in item.items() if k != "measured"} for item in items], progress)
        finally:
            pool.close()
    for row, item in zip(rows, items, strict=True):
        row["sources"] = item["sources"]
        row["measured_ms"] = item["measured"]
    rows.sort(key=sort_key)
    heads = {str(d): problem_of(d)["heads"] for d in DEFAULT_HEAD_DIMS}
    result = {
        "commit": args.commit,
        "commit_full": full,
        "gpu": args.gpu,
        "target": rows[0]["target"] if rows else None,
        "triton": rows[0]["triton"] if rows else None,
        "problem": {
            "layout": "dense [batch, heads, seq, head_dim], contiguous",
            "dtype": "fp16",
            "seq": SEQ,
            "batch": max(1, TOKENS // SEQ),
            "heads_by_head_dim": heads,
            "scale": "head_dim ** -0.5",
            "window": None,
            "softcap": None,
        },  # fmt: skip
        "sweeps": args.sweeps,
        "generated_by": "benchmarks/compile_measured_tiles.py",
        "wall_seconds": round(time.perf_counter() - began, 1),
        "kernels": [{k: v for k, v in row.items() if k not in ("target", "triton")} for row in rows],
    }
    text = json.dumps(result, indent=1) + "\n"
    if args.output:
        pathlib.Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    print(f"{len(rows)} kernels in {result['wall_seconds']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
