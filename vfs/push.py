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

from rankfs.reader.chunks import Chunk
from rankfs.reader.engine import ReadEngine
from rankfs.reader.trace import timed

log = logging.getLogger("rankfs.push")

# Offers already waiting go to a thread several at a time, up to this many bytes: on the 2-core VM
# handing a push to a thread and its result back to the loop took 15 ms against 2 ms of storing
# (a sliced view, whose pushes average 2 MB). Only a backlog is batched: more offers waiting than
# push threads.
BATCH_BYTES = 32 << 20


async def push_prefetched(engine: ReadEngine, threads: int):
    """Push what the engine offers until cancelled, from `threads` threads."""
    engine.enable_push()
    async with trio.open_nursery() as nursery:
        for _ in range(threads):
            nursery.start_soon(_push_offered, engine, engine.pushable.clone(), threads)


async def _push_offered(engine: ReadEngine, offers: trio.MemoryReceiveChannel, threads: int):
    async for chunk in offers:
        batch = _batch(engine, chunk, offers, threads)
        if not batch:
            continue
        drops, asked = engine.drops, time.monotonic()
        try:
            # The thread may be left behind on cancellation: a push blocked on a page lock ends when
            # the unmount aborts the reads holding it.
            pushes = [(c.file_id, start, data) for c, start, _, data, _ in batch]
            stores = await trio.to_thread.run_sync(_store_all, pushes, abandon_on_cancel=True)
        finally:
            for *_, backing in batch:
                if backing is not None:
                    backing.done()
        if drops != engine.drops:  # `rankfs drop` ran meanwhile: what these pushes stored must go too
            for inode in {c.file_id for c, *_ in batch}:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, False)
            continue
        for (c, start, end, _, backing), (stored, began, ended) in zip(batch, stores):
            if stored:
                engine.pushed(c, backing, start, end, (asked, began, ended))


def _batch(engine: ReadEngine, first: Chunk, offers: trio.MemoryReceiveChannel, threads: int) -> list[tuple]:
    """The first offer and those waiting beyond one for each push thread, up to BATCH_BYTES (so that
    no thread idles while another pushes in turn): (chunk, start, end, bytes, backing) of each
    still worth pushing, its bytes owned until the push returns."""
    batch, size, chunk = [], 0, first
    while True:
        span = engine.push_range(chunk)
        if span is not None:
            start, end = span
            data, backing = engine.push_memory(chunk, start, end)
            batch.append((chunk, start, end, data, backing))
            size += end - start
        if size >= BATCH_BYTES or offers.statistics().current_buffer_used <= threads:
            return batch
        try:
            chunk = offers.receive_nowait()
        except trio.WouldBlock:
            return batch


def _store_all(pushes: list[tuple[int, int, memoryview]]) -> list[tuple[bool, float, float]]:
    """Runs in a worker thread: each (inode, offset, bytes) stored in turn; whether it was, and
    when its store began and ended."""
    return [timed(_store, inode, offset, data) for inode, offset, data in pushes]


def _store(inode: int, offset: int, data: memoryview) -> bool:
    try:
        pyfuse3.notify_store(inode, offset, data)
        return True
    except OSError as exc:
        # ENOENT: the kernel has not looked the file up yet; the chunk is then served by reads.
        if exc.errno != errno.ENOENT:
            log.warning("push of %d bytes at %d into inode %d failed: %s", len(data), offset, inode, exc)
        return False
