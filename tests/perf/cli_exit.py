"""The exit status of ``llm-speed ARGV`` run in this process: argparse's refusals (a bad number, named by its
option) raise SystemExit(2); the commands' own return 2."""

from llm_speed.cli import main


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def one_error_line(err: str) -> str:
    """The error line of a refusal: the command's one line, or argparse's after its usage."""
    lines = err.splitlines()
    assert len(lines) == 1 or (lines[0].startswith("usage:") and "error:" not in "".join(lines[:-1])), err
    return lines[-1]
