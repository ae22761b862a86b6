"""The daemon's read events, a JSON line each, for diagnosis (`rankfs mount --trace FILE`; read by
`python3 -m dev.bench.trace`): when each chunk was queued for read-ahead, read, pushed and first
asked for, and each request the kernel made, with the seconds its answer took. A read or a push
also says when the event loop asked a worker thread for it, and when the thread began and ended
it: what waits on threads, on the disk or the kernel, and on the loop. Times are the monotonic
clock's, which a loader on the same host can share. Every event is recorded on the event-loop
thread; off, each call returns at once."""

from __future__ import annotations

import json
import time


def timed(work, *args) -> tuple:
    """Run work(*args) (in a worker thread): its result, and the times it began and ended."""
    began = time.monotonic()
    result = work(*args)
    return result, began, time.monotonic()


class Trace:
    def __init__(self, path: str | None = None):
        self._out = open(path, "w", buffering=1 << 20) if path else None

    def file(self, inode: int, path: str):
        """A virtual file laid out: the inode the other events name it by."""
        if self._out is not None:
            self._write({"event": "file", "inode": inode, "path": path})

    def chunk(self, event: str, chunk, times: tuple[float, float, float] | None = None, **fields):
        """queued, read (demand: a loader waited for it), pushed, first (a loader's first request);
        a read's and a push's `times`: when the loop asked a worker for it, when the worker began
        and when it ended."""
        if self._out is not None:
            if times is not None:
                fields.update(zip(("asked", "began", "ended"), (round(t, 6) for t in times)))
            self._write({"event": event, "inode": chunk.file_id, "offset": chunk.start, "bytes": chunk.length,
                         "fill": chunk.fill, **fields})

    def request(self, path: str, offset: int, nbytes: int, seconds: float):
        if self._out is not None:
            self._write({"event": "request", "path": path, "offset": offset, "bytes": nbytes,
                         "seconds": round(seconds, 6)})

    def _write(self, event: dict):
        self._out.write(json.dumps({"t": round(time.monotonic(), 6), **event}) + "\n")

    def close(self):
        if self._out is not None:
            self._out.close()
            self._out = None
