"""One worker of the kernel report: ``python -m llm_speed.kernel_report.worker`` reads a request (JSON, on
its one argument), captures the launches of its problems, and compiles its share of the distinct kernels,
printing one JSON line per kernel.

It runs in a process of its own: the Triton build checked is the one it imports (the GPU machine's, put first
on ``PYTHONPATH`` by :mod:`llm_speed.kernel_report.report`), its kernels must be compiled, not interpreted
(``TRITON_INTERPRET`` unset), and its Triton cache is a fresh directory, so that every kernel is really
compiled and ``ptxas`` logs its registers and spills. Every worker captures the same launches in the same
order and compiles the kernels ``shard``, ``shard + shards``, ... of them.

Request (the "shipped" set includes the candidate launch choices' problems): ``{"gpu": "h100-sxm", "set":
"default" | "shipped" | "tier", "ops": [...] | null, "options": {...},
"shard": 0, "shards": 2, "sass_dir": null | "DIR"}``; ``"shards": null``: the count is read from stdin
(``{"shards": N}``) once the kernels are counted, and a worker whose shard is past it compiles nothing.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import traceback


class ProblemError(Exception):
    """The request's problems cannot be made: an op refused its arguments (a head dim it does not take, a
    Gluon kernel on a GPU it is not built for) or their tensors do not fit this CPU's memory. Bad input, not
    a fault of the report: the worker prints it as ``{"problem_error": ...}`` and exits with 3."""


def problems_of(request: dict, capability: tuple[int, int]) -> list:
    """The problems of a request (its "set", "ops" and "options") for a GPU of ``capability``."""
    from llm_speed.kernel_report import problems

    options = problems.Options(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in request.get("options", {}).items()})  # fmt: skip
    if request.get("set") == "tier":
        return problems.shipped_problems(options.backward)
    if request.get("set") == "shipped":
        # The op-table rows only: no Gluon kernel ships (each is a candidate; tests/gluon/*_build.py hold
        # their budgets).
        return problems.shipped_problems(options.backward) + problems.default_problems(
            tuple(request["ops"]) if request.get("ops") else None, options, gluon=False
        ) + problems.candidate_problems()
    # Every op by default, the Gluon kernels only for the sm_90 they are built for.
    return problems.default_problems(tuple(request["ops"]) if request.get("ops") else None, options,
                                     gluon=capability == (9, 0))  # fmt: skip


def kernels(request: dict) -> list[dict]:
    """The distinct kernels of the request's problems, in capture order: (key, launches) groups."""
    from llm_speed.kernel_report import build

    target = build.target_of(request["gpu"])
    return launch_groups(problems_of(request, target.capability), target)


def launch_groups(problems: list, target) -> list[dict]:
    """The distinct kernels ``problems`` launch on ``target`` (``build.target_of``), in capture order:
    {"build": its ``build.specialise``, "launches": the launches that share its key} groups. One problem at
    a time: its launches are specialised and their per-call tensors dropped before the next is made (a
    request's problems all at once held up to 14 GB of CPU tensors)."""
    import dataclasses

    from llm_speed.kernel_report import build, capture

    groups: dict[str, dict] = {}
    for problem in problems:
        try:
            launches = capture.capture([problem], target.hardware)
        except (ValueError, TypeError) as error:  # the ops' own argument checks
            raise ProblemError(f"{type(error).__name__}: {error}") from error
        except RuntimeError as error:
            # "allocate": a tensor past this CPU's memory; "overflow": past what PyTorch can count in bytes
            if "allocate" not in str(error) and "overflow" not in str(error):
                raise
            message = (f"the problems' CPU tensors do not fit this machine's memory ({error}); the launches "
                       "are captured with real tensors: smaller --size / --seq / --heads")  # fmt: skip
            raise ProblemError(message) from error
        with build.stand_in_driver(target):
            for launch in launches:
                made = build.specialise(launch)
                group = groups.setdefault(made.key, {"build": made, "launches": []})
                group["launches"].append(dataclasses.replace(launch, per_call={}))
    return list(groups.values())


# Kernels compiled before their SASS is read, in one nvdisasm run (its start-up is paid once a batch: a
# fixed ~0.33 s, a quarter of a kernel's time when paid for each); small enough that rows keep coming.
DISASSEMBLE_BATCH = 16


def run(request: dict, out, stdin=None) -> None:
    import triton

    from llm_speed.kernel_report import build

    target = build.target_of(request["gpu"])
    groups = kernels(request)
    shard, shards = request.get("shard", 0), request.get("shards", 1)
    sass_dir = pathlib.Path(request["sass_dir"]) if request.get("sass_dir") else None
    out.write(json.dumps({"kernels": len(groups)}) + "\n")
    out.flush()
    if shards is None:  # the report chooses the compile processes' count once it knows the kernels'
        line = (stdin if stdin is not None else sys.stdin).readline()
        shards = json.loads(line)["shards"] if line.strip() else 0
        if shard >= shards:  # more workers started than there are kernels: nothing for this one
            return
    pending: list[tuple[dict, object, str, float]] = []  # (row, compiled, ptxas log, seconds)

    def read_pending() -> None:
        try:
            disassembled = build.disassemble_all([compiled.asm["cubin"] for _, compiled, _, _ in pending],
                                                 target.arch)  # fmt: skip
        except Exception as error:
            disassembled = [error] * len(pending)
        for (row, compiled, log, seconds), sass_usage in zip(pending, disassembled, strict=True):
            try:
                if isinstance(sass_usage, Exception):
                    raise sass_usage
                _read(row, compiled, log, seconds, *sass_usage, target, groups[row["index"]], sass_dir)
            except Exception as error:  # a kernel that cannot be read is a finding too
                row["error"] = f"{type(error).__name__}: {error}"[:2000]
            _write(out, row)
        pending.clear()

    for index in range(shard, len(groups), shards):
        group = groups[index]
        first = group["launches"][0]
        plan = first.plan
        row = {
            "index": index,
            "kernel": plan.kernel.name,
            "op": first.op,
            "problems": sorted({f"{launch.op}: {launch.problem}" for launch in group["launches"]}),
            "config": build.config_text(plan),
            "variant": build.variant_text(plan),
            "num_warps": plan.num_warps,
            "num_stages": plan.num_stages,
            "grid": list(plan.grid),
            "constexprs": {
                k: v if isinstance(v, (bool, int, float, str)) else str(v)
                for k, v in plan.fixed.items()
                if k.isupper()
            },  # fmt: skip
            "gpu": target.gpu,
            "target": target.arch,
            "triton": triton.__version__,
            "error": None,
        }
        try:
            compiled, log, seconds = build.compile_build(group["build"])
        except Exception as error:  # a kernel that does not compile is a finding, not a crash of the report
            row["error"] = f"{type(error).__name__}: {error}"[:2000]
            _write(out, row)
            continue
        pending.append((row, compiled, log, seconds))
        if len(pending) == DISASSEMBLE_BATCH:
            read_pending()
    if pending:
        read_pending()


def _read(row: dict, compiled, log: str, seconds: float, sass: str, usage: str, target, group: dict,
          sass_dir: pathlib.Path | None) -> None:  # fmt: skip
    """Add the analysis of a compiled kernel to its row; keep its PTX, TTGIR and SASS in ``sass_dir``."""
    from llm_speed.kernel_report import build

    plan = group["launches"][0].plan
    row.update(build.analyse(compiled, log, sass, usage, target, plan))
    row["compile_seconds"] = round(seconds, 2)
    if sass_dir is not None:
        stem = f"{row['index']:03d}_{plan.kernel.name}"
        (sass_dir / f"{stem}.ptx").write_text(compiled.asm["ptx"])
        (sass_dir / f"{stem}.ttgir").write_text(compiled.asm["ttgir"])
        (sass_dir / f"{stem}.sass").write_text(sass)


def _write(out, row: dict) -> None:
    out.write(json.dumps(row) + "\n")
    out.flush()


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("the kernel report's worker compiles kernels: run it without TRITON_INTERPRET", file=sys.stderr)
        return 2
    request = json.loads(sys.argv[1])
    try:
        run(request, sys.stdout)
    except ProblemError as error:
        print(json.dumps({"problem_error": str(error)}), flush=True)
        return 3
    except Exception:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
