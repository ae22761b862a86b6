"""docs/reference.md, rendered from the sources of truth: each command's `--help` as the parser
prints it, and the hook's settings as rankfs.loader.settings declares them. `python3 -m dev
reference` rewrites the file; tests/test_reference.py holds it equal to what this renders."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

from dev.mounting import ROOT

PATH = ROOT / "docs" / "reference.md"
COMMANDS = ("mount", "umount", "status", "drop", "plan", "profiles", "run")

INTRODUCTION = """# Reference

Every option of the `rankfs` command line, as `rankfs COMMAND --help` prints it, and the settings
the hook reads from the environment. This file is rendered from the parser and from
`loader/settings.py` (`python3 -m dev reference`); a test holds it equal to them.
"""


def command_help(args: list[str]) -> str:
    """What `rankfs ARGS --help` prints, at 100 columns."""
    from rankfs.mount.cli import parser
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        parser().parse_args([*args, "--help"])
    return out.getvalue()


def settings_table() -> str:
    from rankfs.loader.settings import SETTINGS
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    rows += [f"| `{s.variable}` | {s.default} | {s.meaning} |" for s in SETTINGS]
    return "\n".join(rows)


def render() -> str:
    with _columns(100):  # argparse wraps help at the terminal's width
        return _render()


@contextlib.contextmanager
def _columns(width: int):
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def api_section() -> str:
    """rankfs.mount.api as its signatures and docstrings say."""
    import dataclasses
    import inspect

    from rankfs.mount import api

    def doc(thing) -> str:
        return " ".join(inspect.getdoc(thing).split("\n\n")[0].split())

    lines = [inspect.getdoc(api).split("\n\n")[0], "", "```python",
             f"rankfs.mount(checkpoint, mountpoint, **options) -> Mount   # options: "
             f"{', '.join(p for p in inspect.signature(api.mount_config).parameters if p not in ('checkpoint', 'mountpoint'))}",
             "rankfs.attach(path) -> Mount", "```", "",
             "Each option is the `rankfs mount` flag of the same name (`local_ranks`: 'all' or a list of ranks; "
             "`fuse_options`: a list of libfuse options).", "", f"- `mount`: {doc(api.mount)}",
             f"- `attach`: {doc(api.attach)}", f"- `Mount`: {doc(api.Mount)}"]
    for name in ("status", "drop", "unmount"):
        lines.append(f"  - `Mount.{name}{inspect.signature(getattr(api.Mount, name))}`"
                     + (f": {doc(getattr(api.Mount, name))}" if inspect.getdoc(getattr(api.Mount, name)) else ""))
    for cls in (api.MountStatus, api.ViewStatus):
        fields = ", ".join(f.name for f in dataclasses.fields(cls))
        lines.append(f"- `{cls.__name__}`: {doc(cls) + ' ' if cls.__doc__ else ''}fields {fields}")
    lines.append(f"- `MountError`: {doc(api.MountError)}")
    return "\n".join(lines)


def _render() -> str:
    parts = [INTRODUCTION, "## rankfs\n", "```", command_help([]).rstrip(), "```\n"]
    for command in COMMANDS:
        parts += [f"## rankfs {command}\n", "```", command_help([command]).rstrip(), "```\n"]
    parts += ["## Python API\n", api_section(), ""]
    parts += ["## The hook's settings (environment)\n",
              "Read by `rankfs run` and by `rankfs.loader.activate()` in the engine's processes; a value "
              "it cannot use stops the hook with a message naming the variable.\n", settings_table(), ""]
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    Path(PATH).write_text(render())
    print(f"wrote {PATH}")
    return 0
