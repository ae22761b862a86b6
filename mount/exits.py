"""Exit codes (those of mount(8)) and the one way the command line speaks: a line prefixed
`rankfs:`, results on stdout, refusals on stderr."""

from __future__ import annotations

import sys

EXIT_OK = 0
EXIT_USAGE = 1  # invalid invocation or input
EXIT_SYSTEM = 2  # a system error
EXIT_FAILURE = 32  # mount or unmount failure; a path that is not a live rankfs mount
EXIT_NOT_EXECUTABLE = 126  # rankfs run: the command cannot be run
EXIT_NOT_FOUND = 127  # rankfs run: no such command


class UsageError(Exception):
    """Invalid invocation: printed as one line, exit 1."""


def say(message: str):
    print(f"rankfs: {message}", flush=True)


def warn(message: str):
    print(f"rankfs: warning: {message}", file=sys.stderr, flush=True)


def fail(message: str, code: int) -> int:
    print(f"rankfs: {message}", file=sys.stderr, flush=True)
    return code
