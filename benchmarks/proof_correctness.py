#!/usr/bin/env python3
"""The correctness part of ``run_gpu_suite.sh proof``: every kernel family's GPU tests against float64, each
family split into parts (``Family.shards``: contiguous slices of its tests, about 20-45 each), each part its
own pytest process with its own timeout, one per core at once, then each candidate launch choice
(``llm_speed.core.policy.CANDIDATES``) through the families it changes, with ``LLM_SPEED_POLICY=<name>``.

A hang or a fault costs its own part only: every process has a deadline (its family's cap, and never past
the part's end, counted from this process's start), gets SIGINT at it (pytest still writes its junit XML)
and SIGKILL a grace period later. Stopped itself (SIGINT, SIGTERM, or an error here), the correctness part
stops every process the same way, with one grace period for all. Each job (a family, or a candidate's rerun
of one) appends a ``running`` row to RAW/summary.tsv when its first process starts and its result row when
its last ends (as ``run_gpu_suite.sh``'s sub-steps do: 0 only where every part passed, a failure's code
before a cut's 124); its parts' logs are appended to RAW/<job>.log as each ends, their junit files
(RAW/parts) merged into RAW/pytest_<job>.xml. RAW/correctness_pgids.txt lists the running processes' groups
(each its own: the suite kills any left over); RAW/candidates.json says which candidates ran where, or why
none did. The exit code counts the shipped families only: a candidate that fails is its verdict in the
summary. Split across processes, a large family is no longer cut at its cap with two workers while the
small ones' cores sit idle; and a candidate's rerun (in half as many parts) started after the shipped parts
of the same tests finds every kernel it leaves unchanged in Triton's cache.

    python benchmarks/proof_correctness.py RAW_DIR --budget-s 150 [--parallel 16] [--workers 1]
    python benchmarks/proof_correctness.py RAW_DIR --check      collect every selection on the CPU (one
                                                                process, each selection in turn)

Standard library only in this process (the families import torch in their own).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

STARTED = time.monotonic()  # the part's budget counts from here (reading the candidates takes seconds)
REPO = Path(__file__).resolve().parents[1]
SITE = REPO / "benchmarks" / "proof_site"  # the proof_shard plugin (and the compile log's sitecustomize)
PARTS = "parts"  # RAW/parts: each process's own junit and log, until its job's files take them in

# Tests that check the host side, the CPU interpreter, or compile for a GPU that is not there: they prove
# nothing more on the GPU and cost the part its time.
HOST_ONLY = (
    "opcheck or torch_compile or compile_fullgraph or compile_with or compile_for or builds_for or "
    "cpu_without_interpreter or interpreter_runs or bad_ or refused or registration or checks_name or "
    "_errors or skips_the_checks or skip_a_check or nothing_is_read or plans_depend or plan_per_problem"
)


@dataclass(frozen=True)
class Family:
    """One kernel family: the pytest selection that proves it, and what it covers (for the summary)."""

    name: str
    covers: str
    paths: tuple[str, ...]
    keyword: str = ""  # -k, joined to "not (HOST_ONLY)"
    cap_s: int = 120  # each of its processes'
    # processes its tests are split across (contiguous slices: benchmarks/proof_site/proof_shard.py), about
    # 20-45 tests each: a family is not cut at its cap for want of workers while small ones have finished
    shards: int = 1


_A = "tests/attention/"
FAMILIES = (
    Family(
        "flash",
        "flash forward + default backward: d 64/128/256, causal, window + softcap, GQA, ALiBi, dropout, "
        "sequence-major layout, K/V by TMA and by pointers, the overlapped d=128 loop, 32-bit rows",
        (
            f"{_A}test_attention_accuracy.py",
            f"{_A}test_attention_semantics.py",
            f"{_A}test_attention_window_softcap.py",
            f"{_A}test_attention_overlap.py",
            f"{_A}test_attention_tma_kv.py",
            f"{_A}test_attention_row_offsets.py",
            f"{_A}test_attention_gpu.py",
            f"{_A}test_flash_attn_interface.py",
        ),
        "(not test_attention_gpu.py or sampled_rows or rectangular_causal) and not varlen and not kvcache "
        "and not deterministic_backward",
        shards=8,
    ),
    Family(
        "flash_bwd",
        "both backward paths (dQ by atomics, the dQ kernel, dQ by TMA reductions), TMA and pointer loads, "
        "determinism",
        (
            f"{_A}test_attention_backward_paths.py",
            f"{_A}test_attention_tma_backward.py",
            f"{_A}test_attention_tma_dq.py",
            f"{_A}test_attention_gpu.py",
            f"{_A}test_flash_attn_interface.py",
        ),
        "(not test_attention_gpu.py or backward) and (not test_flash_attn_interface.py or deterministic)",
        shards=3,
    ),
    Family(
        "varlen",
        "packed sequences (bounds in uniform registers) and paged varlen, forward and backward",
        (
            f"{_A}test_attention_varlen.py",
            f"{_A}test_attention_varlen_paged.py",
            f"{_A}test_attention_varlen_unchecked.py",
            "tests/core/test_warp_uniform.py",
            f"{_A}test_flash_attn_interface.py",
        ),
        "not test_flash_attn_interface.py or varlen",
        shards=2,
    ),
    Family(
        "decode",
        "decode over dense and paged caches, with append in the attention kernel, fp8 caches, rotary, splits",
        (
            f"{_A}test_attention_kvcache.py",
            f"{_A}test_attention_kvcache_features.py",
            f"{_A}test_attention_kvcache_fp8.py",
            f"{_A}test_attention_kvcache_gpu.py",
        ),
        "not cuda_graph",
        shards=4,
    ),
    Family(
        "fp8_attention",
        "fp8 attention (dense, packed, paged) and its weight cast",
        (f"{_A}test_attention_fp8.py",),
    ),
    Family(
        "gemm",
        "GEMM fp16/bf16/fp32/int8, the TMA kernel's edges, epilogues, layouts, gradients",
        (
            "tests/matmul/test_gemm_forward.py",
            "tests/matmul/test_gemm_int8.py",
            "tests/matmul/test_gemm_gpu.py",
            "tests/matmul/test_gemm_bf16_rounding.py",
            "tests/matmul/test_gemm_autograd.py",
        ),
        "not 8192 and not 4096",
        shards=4,
    ),
    Family(
        "gemm_fp8",
        "fp8 GEMM per tensor, per row and blockwise, fp8 linear layers",
        ("tests/matmul/test_fp8.py",),
        shards=2,
    ),
    Family("fused", "rms_norm, SwiGLU, rotary, linear cross-entropy: forward and backward", ("tests/fused",),
           shards=5),
    Family("moe", "routing, grouped GEMM, the fused MoE layer forward and backward", ("tests/moe",),
           "not bench", shards=2),
    Family(
        "gluon_attention",
        "the warp-specialized Gluon attention, forward (16-bit d 64/128/256, fp8) and backward (selected "
        "only by the candidates gluon-forward / gluon-forward-fp8 / gluon-backward): a broken barrier "
        "hangs, so they run apart from the shipped families",
        ("tests/gluon/test_gluon_attention_gpu.py", "tests/gluon/test_gluon_attention_bwd_gpu.py"),
        shards=6,
    ),
    Family(
        "gluon_gemm",
        "the warp-specialized Gluon GEMMs, 16-bit, int8 and block-scaled fp8 (the last two selected only by "
        "the candidates gluon-gemm-int8 and gluon-gemm-fp8): apart from the shipped families for the same "
        "reason",
        ("tests/gluon/test_gluon_gemm_gpu.py", "tests/gluon/test_gluon_gemm_int8_gpu.py",
         "tests/gluon/test_gluon_gemm_fp8_gpu.py"),
        shards=2,
    ),
    Family(
        "cuda_graph",
        "one decode step captured in a CUDA graph and replayed (new lengths and pages too); a training step "
        "under reduce-overhead",
        ("tests/core/test_cuda_graphs_gpu.py", f"{_A}test_attention_kvcache_gpu.py"),
        "not test_attention_kvcache_gpu.py or cuda_graph",
    ),
)
BY_NAME = {f.name: f for f in FAMILIES}

# A candidate's family, from the words of its name and target (Candidate.target: the op and shape it is
# A/B'd at): the first rule whose word appears wins; no word at all reruns the attention families.
_CANDIDATE_WORDS = (
    (("decode", "kvcache", "append"), ("decode", "cuda_graph")),
    (("varlen", "packed", "uniform"), ("varlen",)),
    (("fp8_attention", "fp8 attention", "attention_fp8", "weight_cast", "fp8_weight", "weights-gpu-cast"),
     ("fp8_attention",)),
    (("gemm", "matmul", "linear"), ("gemm", "gemm_fp8")),
    (("backward", "bwd", "dq"), ("flash_bwd",)),
    (("forward", "fwd", "overlap"), ("flash",)),
)


# A candidate whose target's op is one of these changes only that op's launches: its rerun of the family
# keeps the tests that call it (the int8 GEMM's candidate left the gemm family's ~110 16-bit and fp32 tests
# running the shipped kernels unchanged, in the part's short budget).
_OP_KEYWORDS = {"tensor_core_gemm_int8": "int8"}


def candidate_families(name: str, target: object) -> tuple[str, ...]:
    """The families a candidate launch choice is proven through (see ``_CANDIDATE_WORDS``)."""
    named = target.get("family") if isinstance(target, dict) else None
    named = (named,) if isinstance(named, str) else tuple(named) if isinstance(named, (list, tuple)) else ()
    if named and all(name in BY_NAME for name in named):  # the target names them (a name or a list)
        return named
    words = f"{name} {target}".lower()
    for keys, families in _CANDIDATE_WORDS:
        if any(key in words for key in keys):
            return families
    return ("flash", "flash_bwd")


def load_candidates(python: str) -> tuple[dict[str, object], str | None]:
    """{candidate name: target} from ``llm_speed.core.policy`` in a child process (the families' Python and
    PYTHONPATH), or ({}, why there are none)."""
    code = (
        "import json\nfrom llm_speed.core.policy import CANDIDATES\n"
        "print(json.dumps({n: getattr(c, 'target', None) for n, c in CANDIDATES.items()}, default=repr))"
    )
    try:
        done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return {}, f"reading llm_speed.core.policy.CANDIDATES failed: {error}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {}, f"llm_speed.core.policy.CANDIDATES could not be read ({last})"
    return json.loads(done.stdout.strip().splitlines()[-1]), None


@dataclass
class Job:
    """One family's run (shipped, or a candidate's rerun): one row in summary.tsv, one log and one junit file,
    whatever number of processes (:class:`Part`) its tests were split across."""

    name: str  # correct_<family> or cand_<candidate>_<family>
    family: Family
    env: dict[str, str] = field(default_factory=dict)
    keyword: str = ""  # a candidate's narrowing of its family's selection (-k ... and (keyword))
    shards: int | None = None  # processes; None: the family's
    parts: list[Part] = field(default_factory=list)
    began: float | None = None  # its first part's start
    recorded: bool = False  # its final row is written

    @property
    def count(self) -> int:
        return self.family.shards if self.shards is None else self.shards


@dataclass
class Part:
    """One pytest process of a job: the i-th of its n slices of tests (benchmarks/proof_site/proof_shard.py),
    with a deadline of its own."""

    job: Job
    index: int  # 1-based
    # a candidate's part starts after the shipped parts of the same tests where it can (their kernels cached)
    after: list[Part] = field(default_factory=list)
    process: subprocess.Popen | None = None
    log: object = None
    began: float = 0.0
    deadline: float = 0.0
    interrupted: bool = False
    code: str | None = None  # its exit code once it has ended; "skipped" when it never started

    @property
    def label(self) -> str:
        return f"{self.job.name}.{self.index}of{self.job.count}"

    @property
    def ended(self) -> bool:
        return self.code is not None


def xdist_available(python: str) -> bool:
    """Whether pytest-xdist imports in the families' Python: without it ``-n`` is an unknown option and
    every family fails in a second."""
    try:
        done = subprocess.run([python, "-c", "import xdist"], capture_output=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def pytest_command(python: str, raw: Path, job: Job, workers: int, check: bool, part: Part | None = None
                   ) -> list[str]:  # fmt: skip
    """The job's pytest command: its collection (``check``), or a run of ``part`` (its junit in RAW/parts;
    the whole selection where ``part`` is None). The slice itself comes from LLM_SPEED_PROOF_SHARD."""
    family = job.family
    keyword = f"not ({HOST_ONLY})" + (f" and ({family.keyword})" if family.keyword else "")
    keyword += f" and ({job.keyword})" if job.keyword else ""
    command = [python, "-m", "pytest", *family.paths, "-k", keyword, "-p", "no:cacheprovider", "-rfE",
               "-p", "proof_shard"]  # fmt: skip
    if check:
        return [*command, "--collect-only", "-q", "-p", "no:xdist"]
    junit = raw / PARTS / f"pytest_{part.label}.xml" if part else raw / f"pytest_{job.name}.xml"
    command += ["-q", "--durations=5", f"--junitxml={junit}"]
    if workers > 1 and os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        command += ["-p", "xdist.plugin"]  # not loaded by itself then: -n would be unknown
    command += ["-n", str(workers)] if workers > 1 else ["-p", "no:xdist"]
    return command


# The CPU check's one collecting process: each job's pytest command (its own arguments) run by pytest.main in
# turn, its output to the job's log, a JSON line (name, exit code, seconds) each. One interpreter imports
# torch, llm_speed and the test modules once instead of once a family (make test: 53 s -> about 15).
_COLLECT_EACH = r"""
import contextlib, json, sys, time
import pytest
for name, args, log in json.loads(sys.argv[1]):
    began = time.monotonic()
    with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args)
    print(json.dumps([name, int(code), time.monotonic() - began]), flush=True)
"""


def check_jobs(python: str, raw: Path, jobs: list[Job], budget_s: float) -> int:
    """The CPU check: every job's selection collected in one process (:data:`_COLLECT_EACH`); each job's
    row and log as a run writes them. The number of jobs that did not collect cleanly."""
    listed = [[job.name, pytest_command(python, raw, job, 1, True)[3:], str(raw / f"{job.name}.log")]
              for job in jobs]  # fmt: skip
    print(f"[proof] collecting {len(jobs)} selections in one process (cap {budget_s:.0f} s)", flush=True)
    began = time.monotonic()
    try:
        done = subprocess.run([python, "-c", _COLLECT_EACH, json.dumps(listed)], capture_output=True,
                              text=True, cwd=REPO, timeout=budget_s, check=False,
                              env=child_env())  # fmt: skip
        lines = done.stdout
    except subprocess.TimeoutExpired as error:
        lines = error.stdout.decode() if isinstance(error.stdout, bytes) else (error.stdout or "")
        done = None
    finished = {}
    for line in lines.splitlines():
        if line.startswith("["):
            name, code, seconds = json.loads(line)
            finished[name] = (str(code), seconds)
    bad = 0
    for job in jobs:
        code, seconds = finished.get(job.name, ("124", time.monotonic() - began))
        _record(raw, job.name, code, seconds, budget_s)
        print(f"[proof/{job.name}] collect exit {code} after {seconds:.0f} s", flush=True)
        bad += code != "0"
    if done is not None and done.returncode != 0 and done.stderr:
        print(done.stderr[-2000:], flush=True)
    return bad


def _record(raw: Path, name: str, code: str, seconds: float, cap: float) -> None:
    with open(raw / "summary.tsv", "a") as table:
        table.write(f"{name}\t{code}\t{int(seconds)}\t{int(cap)}\n")


def _shipped(job: Job) -> bool:
    """A shipped family's job (the part's exit code counts these only), not a candidate's rerun."""
    return not job.name.startswith("cand_")


def _kill(part: Part, signum: int) -> None:
    """``signum`` to the part's whole process group (its own: pytest and its xdist workers)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):  # the group has ended
        os.killpg(part.process.pid, signum)


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """os.environ with ``env`` over it and benchmarks/proof_site first on PYTHONPATH (``-p proof_shard``)."""
    merged = {**os.environ, **(env or {})}
    paths = [p for p in merged.get("PYTHONPATH", "").split(os.pathsep) if p]
    merged["PYTHONPATH"] = os.pathsep.join([str(SITE), *(p for p in paths if p != str(SITE))])
    return merged


def merge_junit(parts: list[Path], into: Path) -> list[str]:
    """One junit file (one testsuite: the parts' counts summed, their test cases in order) from the parts'
    files that exist, written atomically; the names of those that could not be read (a part killed while
    pytest wrote it)."""
    keys = ("tests", "failures", "errors", "skipped")
    totals, seconds, cases, unreadable = dict.fromkeys(keys, 0), 0.0, [], []
    for path in parts:
        if not path.exists():
            continue
        try:
            root = ElementTree.parse(path).getroot()
        except (ElementTree.ParseError, OSError):
            unreadable.append(path.name)
            continue
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is None:
            unreadable.append(path.name)
            continue
        for key in keys:
            with contextlib.suppress(ValueError):
                totals[key] += int(suite.get(key, "0"))
        with contextlib.suppress(ValueError):
            seconds += float(suite.get("time", "0"))
        cases += suite.findall("testcase")
    suite = ElementTree.Element("testsuite", {"name": "pytest", **{k: str(v) for k, v in totals.items()},
                                              "time": f"{seconds:.3f}"})  # fmt: skip
    suite.extend(cases)
    tree = ElementTree.ElementTree(ElementTree.Element("testsuites"))
    tree.getroot().append(suite)
    temporary = into.with_name(f".{into.name}.tmp")
    tree.write(temporary, encoding="utf-8", xml_declaration=True)
    os.replace(temporary, into)
    return unreadable


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM ignored while the families are being stopped: a second one must not cut that
    short (the families left would run on)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)


class Terminated(BaseException):
    """SIGTERM (the suite stopped, the lease's end): raised by :func:`raise_terminated`, stops the part as
    KeyboardInterrupt does."""


def raise_terminated(signum, frame) -> None:
    """main's SIGTERM handler."""
    raise Terminated


@dataclass
class Runner:
    """Runs the jobs' parts in order, ``parallel`` at a time, each until its family's cap or the part's end.
    A candidate's part waits for the shipped part of the same tests to end (their kernels are then in
    Triton's cache) while another part can start; with nothing else to start, it starts at once."""

    raw: Path
    python: str
    budget_s: float
    parallel: int
    workers: int
    grace_s: float = 8.0
    min_start_s: float = 10.0
    started: float | None = None  # the budget counts from here (main: the process's start); None: run()'s
    xdist: bool | None = None  # pytest-xdist importable by ``python``; None: checked when run() starts

    @property
    def threads(self) -> int:
        """CPU threads per pytest worker: the cores shared by every worker of every part at once."""
        return max(1, (os.cpu_count() or 1) // (self.parallel * self.workers))

    def run(self, jobs: list[Job]) -> int:
        """The number of shipped families' jobs that did not pass (failed, cut or never started)."""
        self.end = (time.monotonic() if self.started is None else self.started) + self.budget_s
        if self.workers > 1 and self.xdist is None:
            self.xdist = xdist_available(self.python)
            if not self.xdist:
                print(f"[proof] pytest-xdist does not import in {self.python}: each part runs in one "
                      f"process (-p no:xdist), not -n {self.workers}", flush=True)  # fmt: skip
        (self.raw / PARTS).mkdir(exist_ok=True)
        waiting, running, bad = self._parts(jobs), [], 0
        try:
            while waiting or running:
                bad += self._start(waiting, running)
                time.sleep(0.2)
                bad += self._poll(running)
        except BaseException:  # the suite's cap (SIGINT), SIGTERM, an error here: no part may outlive this
            self._stop(running, waiting)
            raise
        return bad

    @staticmethod
    def _parts(jobs: list[Job]) -> list[Part]:
        """Every job's parts, in the jobs' order; a candidate's part after its family's shipped one."""
        shipped = {job.family.name: job for job in jobs if _shipped(job)}
        parts = []
        for job in jobs:
            job.parts = [Part(job, index) for index in range(1, job.count + 1)]
            twin = shipped.get(job.family.name)
            if not _shipped(job) and twin is not None:
                n, m = job.count, twin.count
                for part in job.parts:  # the shipped slices overlapping this one, [(i-1)/n, i/n) of the tests
                    part.after = [p for p in twin.parts if (p.index - 1) * n < part.index * m
                                  and (part.index - 1) * m < p.index * n]  # fmt: skip
            parts += job.parts
        return parts

    def _stop(self, running: list[Part], waiting: list[Part]) -> None:
        """Every running part stopped as its cap would (SIGINT: pytest writes its junit), one grace period
        for all of them, then SIGKILL to every group; each job not finished recorded as cut. (A grace period
        per job, in turn, outlasted the suite's own kill, and the families left ran on.)"""
        with _signals_held():
            for part in running:
                _kill(part, signal.SIGINT)
            deadline = time.monotonic() + self.grace_s
            for part in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    part.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            for part in running:
                _kill(part, signal.SIGKILL)  # the whole group, its workers too, even where pytest has exited
                with contextlib.suppress(subprocess.TimeoutExpired):
                    part.process.wait(timeout=5)
                part.interrupted = True
                self._ended(part, "124")
            for part in waiting:
                if part.job.began is not None:  # a job some of whose parts ran: cut
                    self._ended(part, "skipped")
            running.clear()
            waiting.clear()
            self._write_pgids(running)

    def _write_pgids(self, running: list[Part]) -> None:
        """RAW/correctness_pgids.txt: the running parts' process groups, for the suite to kill should this
        process be killed before it could stop them."""
        path = self.raw / "correctness_pgids.txt"
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text("".join(f"{part.process.pid}\n" for part in running))
        os.replace(temporary, path)

    def _start(self, waiting: list[Part], running: list[Part]) -> int:
        bad = 0
        while waiting and len(running) < self.parallel:
            part = next((p for p in waiting if all(twin.ended for twin in p.after)), waiting[0])
            waiting.remove(part)
            job = part.job
            left = self.end - time.monotonic()
            if left < self.min_start_s:
                print(f"[proof/{part.label}] skipped: {left:.0f} s of the part's {self.budget_s:.0f} s left",
                      flush=True)  # fmt: skip
                part.began = part.deadline = time.monotonic()
                bad += self._ended(part, "skipped")
                continue
            part.began = time.monotonic()
            part.deadline = part.began + min(job.family.cap_s, left)
            workers = self.workers if self.xdist else 1
            command = pytest_command(self.python, self.raw, job, workers, False, part)
            print(f"[proof/{part.label}] (cap {part.deadline - part.began:.0f} s) {' '.join(command)}",
                  flush=True)  # fmt: skip
            part.log = open(self.raw / PARTS / f"{part.label}.log", "w")  # noqa: SIM115 - closed at its end
            if job.began is None:
                job.began = part.began
                # replaced by its result row; left as the last row, the summary says the job was cut
                _record(self.raw, job.name, "running", 0, part.deadline - part.began)
            env = {"OMP_NUM_THREADS": str(self.threads), **job.env}
            if job.count > 1:
                env["LLM_SPEED_PROOF_SHARD"] = f"{part.index}/{job.count}"
            part.process = subprocess.Popen(
                command,
                stdout=part.log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                env=child_env(env),
                # a process group of its own (signalled whole), not a session: the device kills what a command
                # leaves running in its session when the command returns, not what started a session
                preexec_fn=os.setpgrp,
            )
            running.append(part)
            self._write_pgids(running)
        return bad

    def _poll(self, running: list[Part]) -> int:
        bad = 0
        for part in list(running):
            code = part.process.poll()
            now = time.monotonic()
            if code is None:
                if now >= part.deadline and not part.interrupted:
                    _kill(part, signal.SIGINT)  # pytest writes its junit on SIGINT
                    part.interrupted = True
                elif now >= part.deadline + self.grace_s:
                    _kill(part, signal.SIGKILL)
                continue
            running.remove(part)
            _kill(part, signal.SIGKILL)  # a worker its pytest left behind (a kernel that never returns)
            self._write_pgids(running)
            status = "124" if part.interrupted else str(code)
            print(f"[proof/{part.label}] exit {status} after {now - part.began:.0f} s", flush=True)
            bad += self._ended(part, status)
        return bad

    def _ended(self, part: Part, code: str) -> int:
        """``part`` ended with ``code``: its log appended to its job's, the job's junit merged again, and the
        job's row once its last part has ended. 1 when that row is a shipped job's that did not pass."""
        part.code = code
        job = part.job
        if part.log is not None:
            part.log.close()
            log = Path(part.log.name)
            with open(self.raw / f"{job.name}.log", "a") as whole:
                whole.write(f"=== part {part.index} of {job.count}: exit {code} after "
                            f"{time.monotonic() - part.began:.0f} s ===\n")  # fmt: skip
                whole.write(log.read_text(errors="replace"))
            log.unlink()
        elif job.began is not None:
            with open(self.raw / f"{job.name}.log", "a") as whole:
                whole.write(f"=== part {part.index} of {job.count}: not started (budget spent) ===\n")
        if part.process is not None:
            unreadable = merge_junit([self.raw / PARTS / f"pytest_{p.label}.xml" for p in job.parts],
                                     self.raw / f"pytest_{job.name}.xml")  # fmt: skip
            if unreadable:
                with open(self.raw / f"{job.name}.log", "a") as whole:
                    whole.write(f"=== unreadable junit, not counted: {', '.join(unreadable)} ===\n")
        if job.recorded or not all(p.ended for p in job.parts):
            return 0
        job.recorded = True
        codes = [p.code for p in job.parts]
        if job.began is None:  # not one part started
            _record(self.raw, job.name, "skipped", 0, max(self.end - time.monotonic(), 0))
            return int(_shipped(job))
        failed = [c for c in codes if c not in ("0", "124", "skipped")]
        status = failed[0] if failed else "124" if any(c != "0" for c in codes) else "0"
        cap = max(p.deadline for p in job.parts) - job.began  # from its first part's start to the last's cap
        _record(self.raw, job.name, status, time.monotonic() - job.began, cap)
        return int(status != "0" and _shipped(job))


def plan(python: str, check: bool, only: list[str] | None) -> tuple[list[Job], dict]:
    """The jobs (every family, then each candidate through its families) and the candidates' record."""
    families = [BY_NAME[name] for name in only] if only else list(FAMILIES)
    jobs = [Job(f"correct_{f.name}", f) for f in families]
    candidates, reason = load_candidates(python)
    record: dict = {"candidates": {}, "skipped_reason": reason}
    for name, target in candidates.items():
        chosen = [f for f in candidate_families(name, target) if f in {x.name for x in families}]
        narrowed = _OP_KEYWORDS.get(target.get("op")) if isinstance(target, dict) else None
        record["candidates"][name] = {"target": target, "families": chosen, "keyword": narrowed}
        # half the family's processes (most of its kernels come from the cache the shipped run filled: each
        # process costs its start, a few seconds), one for a narrowed rerun (a few tests)
        jobs += [Job(f"cand_{name}_{f}", BY_NAME[f], {"LLM_SPEED_POLICY": name}, narrowed or "",
                     1 if narrowed else -(-BY_NAME[f].shards // 2)) for f in chosen]  # fmt: skip
    if check:  # a CPU check collects each selection once: a candidate's run is its family's with one variable
        jobs = [job for job in jobs if not job.env]
    return jobs, record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("raw", type=Path, help="the suite's raw folder (summary.tsv, logs, junit XML)")
    parser.add_argument("--budget-s", type=float, default=150.0, help="the whole part ends within this")
    parser.add_argument("--parallel", type=int, default=os.cpu_count() or 1, help="processes at once "
                        "(default: the cores)")
    parser.add_argument("--workers", type=int, default=1, help="pytest-xdist workers per process")
    parser.add_argument("--families", nargs="+", choices=sorted(BY_NAME), help="default: all of them")
    parser.add_argument("--check", action="store_true", help="collect every selection (CPU), run no test")
    args = parser.parse_args(argv)
    for name in ("budget_s", "parallel", "workers"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not args.raw.is_dir():
        parser.error(f"RAW_DIR {args.raw} is not a folder")
    if not (args.raw / "summary.tsv").exists():
        (args.raw / "summary.tsv").write_text("step\texit_code\tseconds\tcap_s\n")
    python = sys.executable
    jobs, record = plan(python, args.check, args.families)
    (args.raw / "candidates.json").write_text(json.dumps(record, indent=1, default=repr) + "\n")
    if record["skipped_reason"]:
        print(f"[proof] candidate launch choices not run: {record['skipped_reason']}", flush=True)
    if args.check:
        return 1 if check_jobs(python, args.raw, jobs, args.budget_s) else 0
    runner = Runner(args.raw, python, args.budget_s, args.parallel, args.workers, started=STARTED)
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        bad = runner.run(jobs)
    except KeyboardInterrupt:  # the suite's cap: each running family was already stopped (Runner._stop)
        return 124
    except Terminated:
        return 128 + signal.SIGTERM
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
