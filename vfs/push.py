"""Pushing prefetched chunks into the kernel's page cache of their virtual files.

Every FUSE reply is copied on the one event-loop thread. `notify_store` copies from threads of its
own, so the loader then finds the bytes in page cache and reads them at the kernel's speed with no
request at all. Only chunks the read engine offers are pushed: whole pages of a chunk well ahead of
the loader, whose first page stays unpushed so that the loader's read of it tells the engine the chunk
is being consumed; and the fill outside the rank's slices, which the kernel's read-around would
otherwise ask for (it costs no read).

A push waits for the locks of pages a pending read holds; those reads are answered from the chunk's
memory (or the fill's), which the push never waits for, so the two cannot deadlock. The push owns
that memory until `notify_store` returns.
"""

from __future__ import annotations

import errno
import logging
import time

import pyfuse3
import trio

from rankfs.reader.engine import ReadEngine
from rankfs.reader.trace import timed

log = logging.getLogger("rankfs.push")


async def push_prefetched(engine: ReadEngine, threads: int):
    """Push what the engine offers until cancelled, `threads` chunks at a time."""
    engine.enable_push()
    async with trio.open_nursery() as nursery:
        for _ in range(threads):
            nursery.start_soon(_push_offered, engine, engine.pushable.clone())


async def _push_offered(engine: ReadEngine, offers: trio.MemoryReceiveChannel):
    async for chunk in offers:
        span = engine.push_range(chunk)
        if span is None:
            continue
        start, end = span
        data, backing = engine.push_memory(chunk, start, end)
        drops, asked = engine.drops, time.monotonic()
        try:
            # The thread may be left behind on cancellation: a push blocked on a page lock ends when
            # the unmount aborts the reads holding it.
            stored, began, ended = await trio.to_thread.run_sync(timed, _store, chunk.file_id, start, data,
                                                                 abandon_on_cancel=True)
        finally:
            if backing is not None:
                backing.done()
        if drops != engine.drops:  # `rankfs drop` ran meanwhile: what this push stored must go too
            await trio.to_thread.run_sync(pyfuse3.invalidate_inode, chunk.file_id, False)
        elif stored:
            engine.pushed(chunk, backing, start, end, (asked, began, ended))


def _store(inode: int, offset: int, data: memoryview) -> bool:
    try:
        pyfuse3.notify_store(inode, offset, data)
        return True
    except OSError as exc:
        # ENOENT: the kernel has not looked the file up yet; the chunk is then served by reads.
        if exc.errno != errno.ENOENT:
            log.warning("push of %d bytes at %d into inode %d failed: %s", len(data), offset, inode, exc)
        return False
