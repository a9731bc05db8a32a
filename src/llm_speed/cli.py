"""The ``llm-speed`` command: a switchboard. Each command module registers its own sub-commands with
``register(subparsers)`` (``set_defaults(func=...)``; ``func(args)`` returns the exit code); this file only
imports them and assembles the parser. Shared pieces (``--device``, argument types, the console) live in
:mod:`llm_speed._cli`, below every command module.

Command modules import torch only inside the commands that run kernels, so the model commands (``gpus``,
``models``, ``analyze``, ...) start without it.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys

from llm_speed import __version__, doctor
from llm_speed.bench import cli as bench_cli
from llm_speed.demo import register as register_demo
from llm_speed.distributed import cli as distributed_cli
from llm_speed.kernel_report import command as kernels_cli
from llm_speed.perf import cli_hardware, cli_models, cli_predict

# In the order they appear in ``llm-speed --help``.
REGISTRARS = (
    bench_cli.register,
    doctor.register,
    kernels_cli.register,
    register_demo,
    cli_models.register,
    cli_hardware.register,
    cli_predict.register,
    distributed_cli.register,
)

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_INVALID_CHOICE = re.compile(r"invalid choice: '([^']*)' \(choose from (.*)\)")


class SuggestingParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors suggest the closest option or sub-command for a typo
    (``--casual`` -> "did you mean --causal?")."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "did you mean" not in message and "maybe you meant" not in message:
            message += _suggestion(self, message)
        super().error(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        # argparse reports a sub-command's unknown words from the top parser ("llm-speed: error"), where a
        # suggestion drawn from every command's options proposed --op to `predict`, which has none.
        words = sys.argv[1:] if args is None else list(args)
        parsed, extras = self.parse_known_args(words, namespace)
        if extras:
            _command_parser(self, words).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


def _command_parser(parser: argparse.ArgumentParser, words: list[str]) -> argparse.ArgumentParser:
    """The (sub-)command parser ``words`` reach: the one whose options they are meant for."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for i, word in enumerate(words):
                if word in action.choices:
                    return _command_parser(action.choices[word], words[i + 1:])
    return parser


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every option string of ``parser`` and of all its sub-commands, recursively."""
    found: list[str] = []
    for action in parser._actions:
        found.extend(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_option_strings(sub))
    return found


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """`` (did you mean X?)`` for the first unknown word close to a known one, else ''."""
    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        options = sorted(set(_option_strings(parser)))
        for word in unknown.group(1).split():
            if word.startswith("-"):
                # 0.75: a typo (--casual, --epilouge), not an option sharing two letters (--op, --gpu)
                close = difflib.get_close_matches(word.split("=", 1)[0], options, n=1, cutoff=0.75)
                if close:
                    return f" (did you mean {close[0]}?)"
        return ""
    invalid = _INVALID_CHOICE.search(message)
    if invalid:
        choices = [choice.strip().strip("'") for choice in invalid.group(2).split(",")]
        # 0.75 as for options: "bogus" is not a typo of "gpus"
        close = difflib.get_close_matches(invalid.group(1), choices, n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]}?)"
    return ""


def build_parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="llm-speed",
        description="Fast LLM kernels in Triton, the performance model that explains them, and benchmarks.",
    )
    parser.add_argument("--version", action="version", version=f"llm-speed {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for register in REGISTRARS:
        register(subparsers)
    return parser


# The options every command writes to (tests/test_output_paths.py holds each command's to this list).
OUTPUT_OPTIONS = ("output", "csv", "plot", "output_dir", "sass")


# Settings fields whose command-line option has another name.
_FIELD_OPTIONS = {"min_time_s": "min_time", "impls": "impl"}
_LEADING_NAME = re.compile(r"([a-z][a-z0-9_]*): ")


# A parameter inside a model's message: given a value (schedule='1f1b') or quoted with one (tp (3),
# seq_len (8), virtual_stages > 1); not a term of a product (dp*cp (8)).
_ASSIGNED = re.compile(r"(?<![\w.*-])([a-z][a-z0-9_]*)='?([\w.-]+)'?")
_QUOTED = re.compile(r"(?<![\w.*-])([a-z][a-z0-9_]*)(?= \(-?\d| > )")


def in_option_terms(message: str, parser: argparse.ArgumentParser) -> str:
    """A library check names its parameters (``num_kv_heads: must divide ...``, ``tp (3) must divide ...``,
    ``needs schedule='interleaved'``: for Python callers); at the command line the error names the options
    instead (``--num-kv-heads: ...``, ``--tp (3) ...``, ``--schedule interleaved``) where ``parser`` has
    them."""
    options = {string for action in parser._actions for string in action.option_strings}

    def option(name: str) -> str | None:
        flag = "--" + _FIELD_OPTIONS.get(name, name).replace("_", "-")
        return flag if flag in options else None

    match = _LEADING_NAME.match(message)
    if match is not None and option(match[1]):
        message = option(match[1]) + message[len(match[1]) :]
    message = _ASSIGNED.sub(lambda m: f"{option(m[1])} {m[2]}" if option(m[1]) else m[0], message)
    return _QUOTED.sub(lambda m: option(m[1]) or m[0], message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    words = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(words)
    try:
        # An empty path would be skipped by the commands' "if args.output" (nothing written, no word said).
        for name in OUTPUT_OPTIONS:
            if getattr(args, name, None) == "":
                raise ValueError(f"--{name.replace('_', '-')}: an empty path; give a file or folder name")
        return int(args.func(args) or 0)
    except ValueError as error:
        # Bad input, rejected where it is validated (always a ValueError naming the argument), reaches the
        # user as one readable line; any other exception is a bug and keeps its traceback.
        command = _command_parser(parser, words)  # `llm-speed bench attention`, not `llm-speed bench`
        print(f"{command.prog}: error: {in_option_terms(str(error), command)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
