#!/usr/bin/env python3
"""A Triton cache for the GPU machine, compiled on a CPU before the lease and carried with the proof (issue
70, item 2).

    python benchmarks/triton_cache.py build OUT.tar.gz [--gpu h100-sxm] [--op OP ...] [--workers N]
                                          [--proof-filter TEXT ...]
    python benchmarks/triton_cache.py install ARCHIVE CACHE_DIR [--manifest-out FILE]
    python benchmarks/triton_cache.py verify ARCHIVE [--op OP ...]

``build`` compiles the kernels ``llm-speed kernels`` compiles for the GPU (every op's problems at model sizes,
each shipped attention configuration of the GPU's tier, the candidate launch choices', and on sm_90 the Gluon
kernels), each replayed through Triton's own launch path for its specialisation and cache key, into a Triton
file cache (cubins and metadata only: ``TRITON_STORE_BINARY_ONLY``), and packs it with a manifest (Triton's
version, the sha256 of its ``triton_key()``, ptxas's version, each kernel's name and hash). A kernel hits
on the GPU only where the cache key matches, which hashes ``triton_key()`` (Triton's own files, its
``libtriton.so`` included: the wheel of the GPU machine's Python, cp312 there), the kernel's source and
specialisation, ptxas's version and the options: so ``build`` must run under the GPU machine's Python and
Triton (``make triton-cache``: Python 3.12, torch 2.11, Triton 3.6 in ``.venv-cp312``). The proof's summary
counts what the carried cache served (the compile log's cache hits of its hashes) and what was compiled
there.

The proof's own headline and A/B calls (``proof_problems.py``: its llm-speed rows as the GPU runs them, bf16,
GQA, odd head dims, transposed weights, the decode's batches and pages, the fused ops at 65536 tokens, each
candidate's target) are compiled after the report's, in a second round of workers, each capturing its share
of them, and the two heavy ones (the fused ops at 65536 tokens, ~13 GB of CPU tensors; the train step's
model, ~9 GB) each in a process of its own after it; their kernels the report already compiled are
served from the cache being built; ``--proof-filter TEXT`` takes only those whose
label holds TEXT (default: all of them in a build of every op, none with ``--op``). ``verify`` compiles
the archive's proof problems again too (none with ``--op``), the heavy ones each in a process of its own.

``install`` unpacks an archive into a Triton cache directory and points each kernel's group file at its new
place (Triton records absolute paths there). ``verify`` installs into a fresh directory and compiles every
kernel of ``--op`` again through ``triton.compile``: each must be a hit (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))  # this checkout's llm_speed, also where it is not installed
MANIFEST = "llm-speed-manifest.json"


def _environment(cache_dir: str) -> dict[str, str]:
    """A compile worker's: the kernel report's (this llm_speed, no interpreter, ``cache_dir`` as Triton's
    cache), keeping cubins and metadata only."""
    from llm_speed.kernel_report.report import worker_environment

    return dict(worker_environment(None, cache_dir), TRITON_STORE_BINARY_ONLY="1")


DTYPES = ("fp16", "bf16")  # the proof's headline GEMMs, decode and fused ops are bf16, its attention fp16

# The proof's headline sizes (run_gpu_suite.sh, PROOF_BUDGETS), where a launcher's choice (tiles, splits, a
# tier) follows the size: the attention grid at d = 64 from 512 to 8192 tokens and d = 128 at 16k, the bf16
# GEMM squares, the decode step at 4k tokens of cache.
_ATTENTION = ("flash_attention", "flash_attention_backward")
HEADLINE = (
    *((_ATTENTION, {"seq": seq, "head_dims": [64], "heads": 8, "dtypes": ["fp16"]})
      for seq in (512, 1024, 2048, 8192)),
    (_ATTENTION, {"seq": 16384, "head_dims": [128], "heads": 16, "dtypes": ["fp16"]}),
    *((("gemm",), {"size": size, "dtypes": ["bf16"]}) for size in (512, 1024, 2048, 8192)),
)
# The correctness families' sizes are small and odd (tests/): a length or size not divisible by 16 is
# another specialisation of the same kernel, and a float32 one another kernel. Every op at such sizes.
ODD = (
    (None, {"seq": 1000 + 7, "size": 1000 + 7, "dtypes": ["fp16", "bf16", "fp32"]}),
)
# The Gluon kernels the report leaves out of its defaults (long compiles), each a candidate the proof's
# gluon families test: every head dim, both masks, at an even and an odd length.
_GLUON_CANDIDATES = ("gluon_attention_fwd", "gluon_attention_fwd_fp8", "gluon_attention_bwd",
                     "gluon_gemm_fp8", "gluon_gemm_int8")  # fmt: skip
GLUON = tuple((_GLUON_CANDIDATES, {"seq": seq, "head_dims": [64, 128, 256], "dtypes": ["fp16", "bf16"]})
              for seq in (4096, 1000 + 7))  # fmt: skip


def _builds(gpu: str, ops: list[str] | None, dtypes: list[str] | None = None) -> list[dict]:
    """The distinct kernels of the report's problems, in capture order: (key, launches) groups of
    ``kernel_report.worker``. Every op: its "shipped" set and the Gluon kernels; ``ops``: their problems;
    the ops' problems in each of ``dtypes`` (default :data:`DTYPES`)."""

    options = {"dtypes": list(dtypes or DTYPES)}
    requests = [{"gpu": gpu, "set": "default", "ops": ops, "options": options}]
    if not ops:
        requests.insert(0, {"gpu": gpu, "set": "shipped", "ops": None})
        requests += [{"gpu": gpu, "set": "default", "ops": o and list(o), "options": x}
                     for o, x in (*HEADLINE, *ODD, *GLUON)]  # fmt: skip
    groups: dict[str, dict] = {}
    for request in requests:
        for found in _kernels_of(request):
            groups.setdefault(found["build"].key, found)
    return list(groups.values())


def _proof_problems(proof_filter: list[str] | None) -> list:
    """The proof's headline and A/B problems whose label holds one of ``proof_filter`` (all: [""])."""
    if not proof_filter:
        return []
    import proof_problems

    return [p for p in proof_problems.proof_problems() if any(text in p.label for text in proof_filter)]


def _problem_builds(problem, target) -> list[dict]:
    """The distinct kernels one problem launches: {"build", "kernel", "op"} each (the names of its first
    launch)."""
    from llm_speed.kernel_report import worker

    return [{"build": found["build"], "kernel": found["launches"][0].plan.kernel.name,
             "op": found["launches"][0].op} for found in worker.launch_groups([problem], target)]  # fmt: skip


def _proof_builds(gpu: str, problem) -> list[dict]:
    """The distinct kernels one proof problem launches."""
    from llm_speed.kernel_report import build

    return _problem_builds(problem, build.target_of(gpu))


def _kernels_of(request: dict) -> Iterator[dict]:
    """``worker.kernels(request)`` as {"build", "kernel", "op"}, problem by problem, where a problem whose op
    refuses it (a Gluon GEMM's TMA an odd size, a Gluon kernel off sm_90) is left out, and said on stderr,
    and the rest still built."""
    from llm_speed.kernel_report import build, worker

    target = build.target_of(request["gpu"])
    for problem in worker.problems_of(request, target.capability):
        try:
            yield from _problem_builds(problem, target)
        except worker.ProblemError as error:
            print(f"triton_cache.py: left out {problem.op} {problem.label}: {error}", file=sys.stderr)


def triton_identity() -> dict[str, str]:
    """What a cache key starts with, for the Triton imported here."""
    import triton
    from triton.backends.nvidia.compiler import get_ptxas_version
    from triton.runtime.cache import triton_key

    return {
        "triton": triton.__version__,
        "triton_key_sha256": hashlib.sha256(triton_key().encode()).hexdigest(),
        "ptxas": get_ptxas_version(90).strip().splitlines()[-1],
        "python": sys.version.split()[0],
    }


def _compile(build, row: dict) -> dict:
    import triton

    start = time.perf_counter()
    try:
        compiled = triton.compile(build.source, target=build.target, options=build.options)
        row.update(hash=compiled.hash, seconds=round(time.perf_counter() - start, 2))
    except Exception as error:  # a kernel that does not compile is left out, and said so
        row["error"] = f"{type(error).__name__}: {error}"[:500]
    return row


def _compile_shard(gpu: str, ops: list[str] | None, dtypes: list[str] | None, shard: int, shards: int,
                   out) -> None:  # fmt: skip
    """Compile kernels ``shard``, ``shard + shards``, ... into $TRITON_CACHE_DIR; one JSON line each."""
    groups = _builds(gpu, ops, dtypes)
    for index in range(shard, len(groups), shards):
        row = _compile(groups[index]["build"], {"index": [0, index], "kernel": groups[index]["kernel"]})
        out.write(json.dumps(row) + "\n")
        out.flush()


def _compile_proof_shard(gpu: str, proof_filter: list[str], shard: int, shards: int, heavy: bool,
                         out) -> None:  # fmt: skip
    """Capture the light (or, ``heavy``, the heavy) proof problems ``shard``, ``shard + shards``, ... one at a
    time and compile their kernels (those compiled before are the cache's hits); one JSON line each, or one
    per problem that could not be captured."""
    import proof_problems

    problems = _proof_problems(proof_filter)
    mine = [i for i, p in enumerate(problems) if proof_problems.heavy(p) == heavy][shard::shards]
    for index in mine:
        problem = problems[index]
        try:
            groups = _proof_builds(gpu, problem)
        except Exception as error:  # proof_problems.NotCaptured, or an op's own refusal
            row = {"index": [1, index, 0], "kernel": "-", "problem": problem.label,
                   "error": f"not captured: {type(error).__name__}: {error}"[:1000]}  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()
            continue
        for k, group in enumerate(groups):
            row = _compile(group["build"], {"index": [1, index, k], "kernel": group["kernel"],
                                            "problem": problem.label})  # fmt: skip
            out.write(json.dumps(row) + "\n")
            out.flush()


def _group_files(cache: Path) -> list[Path]:
    return sorted(cache.glob("*/__grp__*.json"))


def _run_workers(commands: list[list[str]], env: dict[str, str]) -> list[dict] | None:
    """Run the compile workers side by side; their JSON rows, or None where one failed."""
    workers = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) for command in commands]
    rows, failed = [], False
    for process in workers:
        out, _ = process.communicate()
        rows += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        if process.returncode != 0:
            print(f"triton_cache.py build: a compile worker exited {process.returncode}", file=sys.stderr)
            failed = True
    return None if failed else rows


def proof_filter_of(args: argparse.Namespace) -> list[str]:
    """The proof problems a build takes: ``--proof-filter``'s, else all of them in a build of every op."""
    return args.proof_filter if args.proof_filter is not None else ([] if args.op else [""])


def build(args: argparse.Namespace) -> int:
    from llm_speed.bench.report import git_commit

    proof_filter = proof_filter_of(args)
    with tempfile.TemporaryDirectory(prefix="llm-speed-triton-cache-") as scratch:
        cache = Path(scratch) / "cache"
        cache.mkdir()
        env = _environment(str(cache))
        script = str(Path(__file__).resolve())
        command = [sys.executable, script, "_shard", "--gpu", args.gpu]
        for op in args.op or ():
            command += ["--op", op]
        for dtype in args.dtype or ():
            command += ["--dtype", dtype]
        for text in proof_filter:
            command += ["--proof-filter", text]
        start = time.monotonic()
        shards = [str(i) for i in range(args.workers)]
        # the report's kernels, then the proof's (a second round: their kernels the first compiled are hits)
        rows = _run_workers([[*command, "--shard", i, "--shards", str(args.workers)] for i in shards], env)
        if rows is not None and proof_filter:
            import proof_problems

            proof = [*command, "--part", "proof"]
            more = _run_workers([[*proof, "--shards", str(args.workers), "--shard", i] for i in shards], env)
            rows = None if more is None else rows + more
            # the heavy ones (~13 GB of CPU tensors for the fused ops) each in a process of its own, one after
            # the other: a worker holding both beside another worker was killed for memory once (23 GB)
            heavy = sum(proof_problems.heavy(p) for p in _proof_problems(proof_filter))
            for i in range(heavy if rows is not None else 0):
                more = _run_workers([[*proof, "--heavy", "--shards", str(heavy), "--shard", str(i)]], env)
                rows = None if more is None else rows + more
        if rows is None:
            return 1
        rows.sort(key=lambda row: row["index"])
        failed = [row for row in rows if "error" in row]
        for row in failed:
            where = f" ({row['problem']})" if "problem" in row else ""
            print(f"not compiled: {row['kernel']}{where}: {row['error']}", file=sys.stderr)
        kernels: dict[str, str] = {}  # hash -> name: a kernel two problems launch, once
        for row in rows:
            if "hash" in row:
                kernels.setdefault(row["hash"], row["kernel"])
        manifest = {
            "gpu": args.gpu,
            "ops": args.op,
            "dtypes": args.dtype or list(DTYPES),
            "proof_filter": proof_filter,
            "commit": git_commit(ROOT / "src" / "llm_speed")[0],  # "+uncommitted-changes" where the tree was
            "sources_sha256": sources_sha256(),
            **json.loads(subprocess.run([sys.executable, script, "_identity"], env=env,
                                        capture_output=True, text=True, check=True).stdout),  # fmt: skip
            "kernels": [{"kernel": name, "hash": digest} for digest, name in kernels.items()],
            "proof_problems": sorted({row["problem"] for row in rows if "problem" in row}),
            "compile_seconds": round(time.monotonic() - start, 1),
        }
        (cache / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(out, "w:gz") as archive:
            archive.add(cache, arcname=".")
    print(f"{out}: {len(manifest['kernels'])} kernels ({len(failed)} not compiled), "
          f"{len(manifest['proof_problems'])} of the proof's problems, "
          f"{out.stat().st_size / 2**20:.1f} MiB, {manifest['compile_seconds']} s; Triton "
          f"{manifest['triton']}, Python {manifest['python']}, "
          f"triton_key {manifest['triton_key_sha256'][:12]}")
    return 1 if failed else 0


def sources_sha256(root: Path = ROOT) -> str:
    """The sha256 of llm-speed's Python sources under ``root`` (src/llm_speed): a kernel's key hashes its
    source, so an archive built from other sources misses where they differ."""
    digest = hashlib.sha256()
    for path in sorted((root / "src" / "llm_speed").rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def install(archive: Path, cache_dir: Path) -> dict:
    """Unpack ``archive`` into ``cache_dir`` and point its group files there; the manifest, with the local
    Triton's identity beside the builder's where one imports."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]  # no links, no devices
        for member in members:
            if member.name.startswith("/") or ".." in Path(member.name).parts:
                raise ValueError(f"{archive}: member {member.name!r} leaves the cache directory")
        tar.extractall(cache_dir, members=members)  # noqa: S202 - names checked above
    for group in _group_files(cache_dir):
        data = json.loads(group.read_text())
        data["child_paths"] = {name: str(group.parent / name) for name in data["child_paths"]
                               if Path(name).name == name and (group.parent / name).is_file()}  # fmt: skip
        group.write_text(json.dumps(data))
    manifest = json.loads((cache_dir / MANIFEST).read_text())
    manifest["installed_into"] = str(cache_dir)
    if manifest.get("sources_sha256"):  # this tree's kernels are the ones the archive was built from
        manifest["sources_match"] = manifest["sources_sha256"] == sources_sha256()
    try:
        here = triton_identity()
    except Exception as error:  # no Triton, or one without these names: the compile log will say
        manifest["here"] = {"error": f"{type(error).__name__}: {error}"}
    else:
        manifest["here"] = here
        fields = ("triton", "triton_key_sha256", "ptxas")
        manifest["key_matches"] = all(here[k] == manifest[k] for k in fields)
    return manifest


def verify(args: argparse.Namespace) -> int:
    """Install into a fresh directory and compile every kernel again, in processes as ``build`` captures
    them (the report's; the proof's light problems; each heavy one alone): each must be a hit."""
    import proof_problems

    with tempfile.TemporaryDirectory(prefix="llm-speed-triton-cache-verify-") as scratch:
        manifest = install(Path(args.archive), Path(scratch))
        command = [sys.executable, str(Path(__file__).resolve()), "_hits", "--gpu", manifest["gpu"]]
        for op in args.op or manifest.get("ops") or ():
            command += ["--op", op]
        for dtype in manifest.get("dtypes") or ():
            command += ["--dtype", dtype]
        proof_filter = manifest.get("proof_filter") or [] if not args.op else []
        for text in proof_filter:
            command += ["--proof-filter", text]
        parts = [command]
        if proof_filter:
            heavy = sum(proof_problems.heavy(p) for p in _proof_problems(proof_filter))
            parts.append([*command, "--part", "proof"])
            parts += [[*command, "--part", "proof", "--heavy", "--shards", str(heavy), "--shard", str(i)]
                      for i in range(heavy)]  # fmt: skip
        hits = {"hit": 0, "missed": 0, "missed_kernels": []}
        for part in parts:
            env = _environment(scratch)
            done = subprocess.run(part, env=env, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(done.stderr, file=sys.stderr)
                return 1
            for key, value in json.loads(done.stdout).items():
                hits[key] += value
    print(json.dumps({"key_matches": manifest.get("key_matches"), **hits}))
    return 0 if hits["missed"] == 0 and hits["hit"] > 0 else 1


def _hits(gpu: str, ops: list[str] | None, dtypes: list[str] | None, proof_filter: list[str], part: str,
          heavy: bool, shard: int, shards: int) -> dict:  # fmt: skip
    """Compile again every kernel of ``ops`` (``part`` "report") or of the light (``heavy``: heavy) proof
    problems ``proof_filter`` takes, ``shard``, ``shard + shards``, ... (``part`` "proof"): how many
    Triton's file cache served."""
    import proof_problems
    import triton
    from triton import knobs

    seen: list[bool] = []
    knobs.compilation.listener = lambda *, cache_hit, **_: seen.append(bool(cache_hit))
    missed = []

    def again(group: dict) -> None:
        build = group["build"]
        with contextlib.redirect_stdout(io.StringIO()):
            triton.compile(build.source, target=build.target, options=build.options)
        if not seen[-1]:
            missed.append(f"{group['op']}: {group['kernel']}")

    if part == "report":
        for group in _builds(gpu, ops, dtypes):
            again(group)
    else:
        problems = [p for p in _proof_problems(proof_filter) if proof_problems.heavy(p) == heavy]
        for problem in problems[shard::shards]:
            for group in _proof_builds(gpu, problem):
                again(group)
    return {"hit": sum(seen), "missed": len(missed), "missed_kernels": missed}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build", help="compile the report's kernels into a packed Triton cache")
    p.add_argument("output", metavar="OUT.tar.gz")
    p.add_argument("--gpu", default="h100-sxm")
    p.add_argument("--op", action="append", help="only these ops (repeat); default every op")
    p.add_argument("--dtype", action="append", choices=("fp16", "bf16", "fp32"),
                   help=f"the ops' problems in these dtypes (repeat); default {' and '.join(DTYPES)}")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="compile processes (default 2: each captures every problem with real CPU tensors)")
    p.add_argument("--proof-filter", action="append", metavar="TEXT",
                   help="the proof's headline and A/B problems whose label holds TEXT (repeat; '' for all); "
                        "default all of them without --op, none with it")  # fmt: skip
    p = sub.add_parser("install", help="unpack an archive into a Triton cache directory")
    p.add_argument("archive")
    p.add_argument("cache_dir")
    p.add_argument("--manifest-out", metavar="FILE", help="write the manifest (with this Triton's) here")
    p = sub.add_parser("verify", help="install into a fresh directory; every kernel must be a cache hit")
    p.add_argument("archive")
    p.add_argument("--op", action="append", help="only these ops' kernels (none of the proof's)")
    for name in ("_shard", "_hits"):
        p = sub.add_parser(name)
        p.add_argument("--gpu", required=True)
        p.add_argument("--op", action="append")
        p.add_argument("--dtype", action="append")
        p.add_argument("--proof-filter", action="append", default=[])
        p.add_argument("--part", choices=("report", "proof"), default="report")
        p.add_argument("--heavy", action="store_true", help="the proof problems proof_problems.heavy() names")
        p.add_argument("--shard", type=int, default=0)
        p.add_argument("--shards", type=int, default=1)
    sub.add_parser("_identity")
    args = parser.parse_args(argv)
    if args.command == "build":
        if args.workers < 1:
            parser.error(f"--workers: {args.workers}: at least 1")
        return build(args)
    if args.command == "install":
        try:
            manifest = install(Path(args.archive), Path(args.cache_dir))
        except Exception as error:  # a truncated or foreign archive: said, in the manifest the summary reads
            why = f"{type(error).__name__}: {error}"[:500]
            print(f"triton_cache.py install: {why}", file=sys.stderr)
            if args.manifest_out:
                Path(args.manifest_out).write_text(json.dumps({"error": why, "kernels": []}) + "\n")
            return 2
        text = json.dumps(manifest, indent=1) + "\n"
        if args.manifest_out:
            Path(args.manifest_out).write_text(text)
        print(f"{args.archive}: {len(manifest['kernels'])} kernels into {args.cache_dir}; built by Triton "
              f"{manifest['triton']} (triton_key {manifest['triton_key_sha256'][:12]}), here "
              f"{manifest['here'].get('triton', '?')} (triton_key "
              f"{manifest['here'].get('triton_key_sha256', '?')[:12]}): "
              f"{'keys can match' if manifest.get('key_matches') else 'KEYS DIFFER: every kernel will miss'}"
              f"{'' if manifest.get('sources_match', True) else '; OTHER SOURCES: changed kernels miss'}")
        return 0
    if args.command == "verify":
        return verify(args)
    if args.command == "_shard":
        if args.part == "proof":
            _compile_proof_shard(args.gpu, args.proof_filter, args.shard, args.shards, args.heavy, sys.stdout)
        else:
            _compile_shard(args.gpu, args.op, args.dtype, args.shard, args.shards, sys.stdout)
        return 0
    if args.command == "_hits":
        hits = _hits(args.gpu, args.op, args.dtype, args.proof_filter, args.part, args.heavy, args.shard,
                     args.shards)
        print(json.dumps(hits))
        return 0
    print(json.dumps(triton_identity()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
