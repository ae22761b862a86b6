"""`rankfs run -- COMMAND`: run an engine with the hook in every Python process it starts.

Only the hook's boot directory goes on PYTHONPATH (its sitecustomize installs the hook, which stays
dormant until a rankfs file is opened); the command is exec'd, so its exit status is rankfs's."""

from __future__ import annotations

import os

from rankfs.mount.exits import EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, UsageError, fail

BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "loader", "boot")


def environment(observe: bool) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["RANKFS_HOOK"] = "observe" if observe else env.get("RANKFS_HOOK", "on")
    return env


def run(argv: list[str], observe: bool) -> int:
    argv = argv[1:] if argv[:1] == ["--"] else argv
    if not argv:
        raise UsageError("run: give the command after --, e.g. rankfs run -- python -m sglang.launch_server ...")
    try:
        os.execvpe(argv[0], argv, environment(observe))
    except FileNotFoundError:
        return fail(f"run: {argv[0]}: command not found", EXIT_NOT_FOUND)
    except PermissionError:
        return fail(f"run: {argv[0]}: permission denied", EXIT_NOT_EXECUTABLE)
