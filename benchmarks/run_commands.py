"""Run `llm-speed` command lines read from stdin in one process (one torch import and CUDA start for all).

Used by the GPU tuning calls (docs/guides/gpu-plan.md, "Tuning calls"): each line is one CLI call, as
`benchmarks/predict_targets.py commands` prints them; a failing line is reported and the next one runs.
"""

import shlex
import sys
import time
import traceback

from llm_speed.cli import main

for line in sys.stdin:
    if not line.strip():
        continue
    began = time.perf_counter()
    try:
        code = main(shlex.split(line))
    except Exception:
        traceback.print_exc()
        code = "exception"
    print(f"exit {code} after {time.perf_counter() - began:.1f}s: {line.strip()[-80:]}", flush=True)
