"""What the daemon and the engine hook agree on: the names a mount serves, the metadata its virtual
shards carry, the sources map, the control file and its commands, and how a rankfs mount is found.

Standard library only, and light to import (json is imported where it is used): the hook imports
it in every engine process.
"""

from __future__ import annotations

import os
from typing import Iterator, NamedTuple

GIB = 1 << 30
FSTYPE = "fuse.rankfs"

# The mount's own directory: MOUNTPOINT/.rankfs/
CONTROL_DIR = ".rankfs"
STATUS_FILE = "status.json"  # live figures, rendered at open
SOURCES_DIR = "sources"  # sources/VIEW.json: where each view tensor lies in the source shards
SOURCES_FORMAT = 2  # JSON lines, a view file's tensors a line (1: one JSON document, rankfs 0.2 and before)
COMMAND_FILE = "control"  # write-only: one command per write (below)

# Header metadata of a virtual shard.
SLICES_KEY = "rankfs.slices"  # {tensor: [dim, start, stop]}: only this slice holds real bytes
ON_DEMAND_KEY = "rankfs.on_demand"  # [tensor, ...]: row-store tables, read only where asked
VIEW_KEY = "rankfs.view"  # which view, rank and profile the shard belongs to (for people)

# Commands written to the control file. `loaded VIEW BYTES`: a hook loads VIEW straight from the
# sources and has loaded BYTES of it so far (the daemon counts them in its status, and reads nothing
# ahead for that view). `consumed VIEW FILE`: a hook of a mount that serves several local ranks is
# done reading FILE of VIEW from the sources (the daemon drops the source pages no rank needs any
# more). `drop`: release the daemon's buffers and the views' page cache. Each write returns once
# the daemon has carried it out.
DROP = "drop"
LOADED = "loaded"
CONSUMED = "consumed"


def flat_name(view_dir: str) -> str:
    """A view directory (`target`, `rank-1/draft`) as one file name."""
    return view_dir.replace("/", ".")


def sources_path(mountpoint: str, view_dir: str) -> str:
    return os.path.join(mountpoint, CONTROL_DIR, SOURCES_DIR, f"{flat_name(view_dir)}.json")


def phase(view_dir: str) -> str:
    """The load a view directory feeds: `target` or `draft`."""
    return os.path.basename(view_dir)


# -- the sources map ------------------------------------------------------------------------------

class Source(NamedTuple):
    """A source shard as it was planned: a hook reads it only while it is still that file."""

    path: str
    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def stat(cls, path) -> "Source":
        st = os.stat(path)
        return cls(str(path), st.st_size, st.st_mtime_ns, st.st_ino)

    def unchanged(self, st: os.stat_result) -> bool:
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.inode)


def encode_sources(sources: list[Source], files: dict[str, dict[str, tuple[int, int]]],
                   shared: dict[int, list[tuple[int, int]]] | None = None) -> bytes:
    """files: {view file: {tensor: (index into sources, offset of its first byte in that source)}}.
    A tensor's bytes (a slice's included) lie at the same place relative to its start in both.
    shared: {index into sources: [(begin, end), ...]}, on a mount of several local ranks: the
    pages of the view's reads that other ranks read too (read those through the page cache).

    JSON lines: the first holds the sources and where each view file's line lies, the others one
    view file's tensors each, so that an open decodes its own file's (`SourcesMap`)."""
    import json
    lines = [json.dumps({t: list(place) for t, place in tensors.items()}).encode() + b"\n"
             for tensors in files.values()]
    spans, at = {}, 0
    for name, line in zip(files, lines):
        spans[name] = [at, len(line)]
        at += len(line)
    head = json.dumps({"format": SOURCES_FORMAT, "sources": [s._asdict() for s in sources], "files": spans,
                       "shared": {str(i): [list(run) for run in runs] for i, runs in (shared or {}).items()}}
                      ).encode() + b"\n"
    return head + b"".join(lines)


class SourcesMapError(ValueError):
    """A sources map this hook cannot read: written by a daemon of another rankfs version."""


class SourcesMap:
    """A view's decoded sources map. Each view file's tensors are decoded when it is opened: at
    the production layout a view's map is megabytes, whose decoding the loader's first opens would
    all wait for."""

    def __init__(self, data: bytes):
        import json
        head, _, self._lines = data.partition(b"\n")
        body = json.loads(head)
        if not isinstance(body, dict) or body.get("format") != SOURCES_FORMAT:
            found = body.get("format", 1) if isinstance(body, dict) else "unknown"
            raise SourcesMapError(f"sources map format {found}, not {SOURCES_FORMAT}: the mount's "
                                  f"daemon runs another rankfs version")
        self.sources = [Source(**s) for s in body["sources"]]
        self._spans: dict[str, list[int]] = body["files"]
        # {index into sources: [(begin, end), ...]}: pages other local ranks read too (none: a mount of one rank)
        self.shared: dict[int, list[tuple[int, int]]] = {int(i): [tuple(run) for run in runs]
                                                         for i, runs in body.get("shared", {}).items()}

    def places(self, view_file: str) -> dict[str, list[int]]:
        """{tensor: [index into sources, offset]} of one view file (KeyError if the view has none)."""
        import json
        at, length = self._spans[view_file]
        return json.loads(self._lines[at:at + length])


# -- talking to a running daemon ------------------------------------------------------------------

def read_status(mountpoint: str) -> dict:
    import json
    with open(os.path.join(mountpoint, CONTROL_DIR, STATUS_FILE)) as f:
        return json.load(f)


def send(mountpoint: str, command: str):
    """Write one command to the daemon; returns once it has carried it out. The control file is
    writable only by those the mount lets in (its user, or others with --allow-other)."""
    fd = os.open(os.path.join(mountpoint, CONTROL_DIR, COMMAND_FILE), os.O_WRONLY)
    try:
        os.write(fd, command.encode() + b"\n")
    finally:
        os.close(fd)


def loaded_command(view_dir: str, loaded_bytes: int) -> str:
    return f"{LOADED} {view_dir} {loaded_bytes}"


def consumed_command(view_dir: str, file_name: str) -> str:
    return f"{CONSUMED} {view_dir} {file_name}"


def parse_command(text: str) -> tuple[str, list[str]]:
    """(verb, arguments) of a command; ValueError for anything else."""
    words = text.split()
    if words[:1] == [DROP] and len(words) == 1:
        return DROP, []
    if words[:1] == [LOADED] and len(words) == 3 and words[2].isdigit():
        return LOADED, words[1:]
    if words[:1] == [CONSUMED] and len(words) == 3:
        return CONSUMED, words[1:]
    raise ValueError(f"unknown command {text.strip()[:80]!r}; expected '{DROP}', '{LOADED} VIEW BYTES' or "
                     f"'{CONSUMED} VIEW FILE'")


# -- finding mounts -------------------------------------------------------------------------------

class MountEntry(NamedTuple):
    mountpoint: str
    device: str  # "major:minor"
    fstype: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.encode().decode("unicode_escape")


def mounts() -> Iterator[MountEntry]:
    """The mounts this process sees, from /proc/self/mountinfo (never touches the mounts themselves,
    so it works on dead ones and while a daemon cannot answer yet)."""
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            yield MountEntry(_unescape(fields[4]), fields[2], right.split()[0])


def find_mount(mountpoint: str | os.PathLike) -> MountEntry | None:
    """The mount at exactly this path (the last one, which is on top)."""
    target = os.path.abspath(mountpoint)
    found = None
    for entry in mounts():
        if entry.mountpoint == target:
            found = entry
    return found


def rankfs_devices() -> set[int]:
    """st_dev of every rankfs mount."""
    devices = set()
    for entry in mounts():
        if entry.fstype == FSTYPE:
            major, minor = entry.device.split(":")
            devices.add(os.makedev(int(major), int(minor)))
    return devices


def mount_root(path: str) -> str:
    """The mount point a path lies under."""
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path
