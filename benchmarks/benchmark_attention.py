#!/usr/bin/env python3
"""The old project's attention benchmark script (docs/compat.md): ``llm-speed bench attention``, same flags.

    python benchmarks/benchmark_attention.py --seq-lengths 512 1024 2048 --batch-size 4 --num-heads 16 \
        --head-dim 64 --dtype fp16 --warmup 50 --iterations 200 --output results.json
"""

import sys
from pathlib import Path

try:
    from llm_speed.cli import main
except ImportError:  # run from a checkout without installing: use its src/ directory
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from llm_speed.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "attention", *sys.argv[1:]]))
