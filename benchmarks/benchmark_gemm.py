#!/usr/bin/env python3
"""The old CUDA project's GEMM benchmark script (docs/compat.md): ``llm-speed bench gemm``, same flags.

    python benchmarks/benchmark_gemm.py --sizes 512x512x512 1024x1024x1024 2048x2048x2048 --dtype fp16 \
        --output gemm_results.json
"""

import sys
from pathlib import Path

try:
    from llm_speed.cli import main
except ImportError:  # run from a checkout without installing: use its src/ directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from llm_speed.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "gemm", *sys.argv[1:]]))
