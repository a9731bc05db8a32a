"""The ``llm-speed`` command. Each area registers its own sub-commands; this file only assembles them."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines ``register(subparsers)`` which adds its commands with ``set_defaults(func=...)``;
# ``func(args)`` returns the process exit code.
COMMAND_MODULES: tuple[str, ...] = (
    "llm_speed.bench.cli",
    "llm_speed.perf.cli_models",
    "llm_speed.perf.cli_hardware",
    "llm_speed.distributed.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-speed",
        description="Fast LLM kernels in Triton, the performance model that explains them, and benchmarks.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, KeyError) as error:
        # Bad input reaches the user as one readable line, not a traceback.
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        print(f"llm-speed {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
