"""Read events, a JSON line each, for diagnosis (read by `python3 -m dev.bench.trace_summary`).

The daemon's (`rankfs mount --trace FILE`): when each chunk was queued for read-ahead, read,
pushed and first asked for, each request the kernel made, with the seconds its answer took, and
each file's listing pages pushed at its first open (which that open waits for). A read, a push or
a listing also says when the event loop asked a worker thread for it, and when the thread began
and ended it: what waits on threads, on the disk or the kernel, and on the loop.

The hook's (RANKFS_HOOK_TRACE=FILE): when each file was opened, each group staged (asked, began,
ended, by which read thread), each bounce buffer made and taken, and how long the loader waited for
a group it asked for.

Times are the monotonic clock's, which every process on the host shares. Standard library only;
off, each call returns at once."""

from __future__ import annotations

import json
import threading
import time


def timed(work, *args) -> tuple:
    """Run work(*args) (in a worker thread): its result, and the times it began and ended."""
    began = time.monotonic()
    result = work(*args)
    return result, began, time.monotonic()


class Trace:
    def __init__(self, path: str | None = None):
        self._out = open(path, "w", buffering=1 << 20) if path else None
        self._lock = threading.Lock()  # the hook's threads write events side by side

    @property
    def on(self) -> bool:
        return self._out is not None

    def file(self, inode: int, path: str):
        """A virtual file laid out: the inode the other events name it by."""
        if self._out is not None:
            self.event("file", inode=inode, path=path)

    def chunk(self, event: str, chunk, times: tuple[float, float, float] | None = None, **fields):
        """queued, read (demand: a loader waited for it), pushed, first (a loader's first request);
        a read's and a push's `times`: when the loop asked a worker for it, when the worker began
        and when it ended."""
        if self._out is not None:
            if times is not None:
                fields.update(zip(("asked", "began", "ended"), times))
            self.event(event, inode=chunk.file_id, offset=chunk.start, bytes=chunk.length, **fields)

    def request(self, path: str, offset: int, nbytes: int, seconds: float):
        if self._out is not None:
            self.event("request", path=path, offset=offset, bytes=nbytes, seconds=round(seconds, 6))

    def event(self, event: str, **fields):
        """One event, stamped now; fields named like times (`asked`, `began`, `ended`) are rounded."""
        out = self._out
        if out is None:
            return
        for key in ("asked", "began", "ended"):
            if key in fields:
                fields[key] = round(fields[key], 6)
        line = json.dumps({"t": round(time.monotonic(), 6), "event": event, **fields}) + "\n"
        with self._lock:
            out.write(line)

    def flush(self):
        with self._lock:
            if self._out is not None:
                self._out.flush()

    def close(self):
        with self._lock:
            if self._out is not None:
                self._out.close()
                self._out = None
