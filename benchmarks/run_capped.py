#!/usr/bin/env python3
"""One sub-step of ``run_gpu_suite.sh``: COMMAND for at most CAP seconds, its output on stdout and in LOG,
both bounded.

    python -E -s benchmarks/run_capped.py --cap 85 --grace 15 --log RAW/name.log -- COMMAND...

At the cap the command's process group gets SIGINT (pytest writes its junit XML, the benchmarks their JSON)
and SIGKILL ``--grace`` seconds later; exit 124 (137 where SIGKILL was needed), as coreutils' ``timeout -s INT
--kill-after``. Unlike a backgrounded ``timeout``, the command starts with SIGINT at its default: bash starts
background commands with SIGINT ignored, and a Python that starts so never raises KeyboardInterrupt, so the
cap would have had to kill it, junit and JSON lost. SIGTERM, SIGINT or SIGHUP to this process (the suite's
trap, at the lease's end) stop the command the same way with ``--stop-grace`` seconds allowed; exit 128 + the
signal. The log keeps the first ``--max-bytes`` and the last ``--tail-lines`` lines (pytest's summary is at
the end): a flood of warnings cannot fill the disk or the archive the device returns. When the command ends,
whatever it left in its process group is killed.

Standard library only (it runs beside every sub-step).
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import threading
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def _own_group_default_signals() -> None:
    """In the command's process, before exec: a process group of its own (signalled whole at the cap; a group,
    not a session: the device kills what a command leaves running in its session when it returns, not what
    started a session of its own), SIGINT and SIGQUIT at their defaults (see the module docstring)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


class BoundedCopy(threading.Thread):
    """Copies the command's output, line by line, to stdout and the log until ``max_bytes``; past that keeps
    the last ``tail_lines`` lines and writes them (after a note of what was left out) at the end."""

    def __init__(self, source, log_path: str, max_bytes: int, tail_lines: int):
        super().__init__(daemon=True)
        self.source, self.log_path, self.max_bytes = source, log_path, max_bytes
        self.tail: collections.deque[bytes] = collections.deque(maxlen=tail_lines)
        self.written = self.dropped = self.dropped_lines = 0

    def run(self) -> None:
        out = sys.stdout.buffer
        with open(self.log_path, "wb") as log:
            for line in iter(self.source.readline, b""):
                if self.written + len(line) <= self.max_bytes:
                    self.written += len(line)
                    for stream in (out, log):
                        stream.write(line)
                        stream.flush()
                    continue
                if len(self.tail) == self.tail.maxlen:
                    self.dropped += len(self.tail[0])
                    self.dropped_lines += 1
                self.tail.append(line)
            if self.dropped:
                note = (f"[... run_capped.py: {self.dropped} bytes ({self.dropped_lines} lines) of output "
                        f"left out: the first {self.written} bytes and the last {len(self.tail)} lines "
                        "kept ...]\n")  # fmt: skip
                for stream in (out, log):
                    stream.write(note.encode())
            for stream in (out, log):
                stream.writelines(self.tail)
                stream.flush()


def _kill_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run(command: list[str], cap: float, grace: float, stop_grace: float, log: str, max_bytes: int,
        tail_lines: int) -> int:  # fmt: skip
    """The exit code (see the module docstring)."""
    stopped: list[int] = []
    for sig in STOP_SIGNALS:  # set explicitly: bash may have started this process with SIGINT ignored
        signal.signal(sig, lambda number, _frame: stopped.append(number))
    try:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 preexec_fn=_own_group_default_signals)  # fmt: skip
    except OSError as error:
        with open(log, "w") as out:
            out.write(f"run_capped.py: cannot start {command[0]!r}: {error}\n")
        print(f"run_capped.py: cannot start {command[0]!r}: {error}", flush=True)
        return 127
    copy = BoundedCopy(child.stdout, log, max_bytes, tail_lines)
    copy.start()
    deadline = time.monotonic() + cap
    interrupted_at = None
    killed = False
    while child.poll() is None:
        now = time.monotonic()
        if interrupted_at is None and (now >= deadline or stopped):
            _kill_group(child.pid, signal.SIGINT)
            interrupted_at = now
        elif interrupted_at is not None and not killed:
            allowed = stop_grace if stopped else grace
            if now >= interrupted_at + allowed:
                _kill_group(child.pid, signal.SIGKILL)
                killed = True
        time.sleep(0.05)
    _kill_group(child.pid, signal.SIGKILL)  # what the command left behind in its group (compile workers)
    copy.join(timeout=5)
    if stopped:
        return 128 + stopped[0]
    if interrupted_at is not None:
        return 137 if killed else 124
    code = child.returncode
    return 128 - code if code < 0 else code  # a signal's death as a shell reports it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cap", type=float, required=True, help="seconds before the command gets SIGINT")
    parser.add_argument("--grace", type=float, default=15.0, help="seconds from that SIGINT to SIGKILL")
    parser.add_argument("--stop-grace", type=float, default=4.0,
                        help="seconds from a SIGINT relayed from this process's own stop to SIGKILL")
    parser.add_argument("--log", required=True, help="the command's output, bounded")
    parser.add_argument("--max-bytes", type=int, default=8 * 2**20, help="kept from the start of the output")
    parser.add_argument("--tail-lines", type=int, default=400, help="kept from its end past --max-bytes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no COMMAND after --")
    for name in ("cap", "grace", "stop_grace", "max_bytes", "tail_lines"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    return run(command, args.cap, args.grace, args.stop_grace, args.log, args.max_bytes, args.tail_lines)


if __name__ == "__main__":
    sys.exit(main())
