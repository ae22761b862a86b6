"""Pushing into the kernel's page cache of the virtual files: prefetched chunks, and as a file is
first opened, the pages a listing of it reads.

Every FUSE reply is copied on the one event-loop thread. `notify_store` copies from threads of its
own, so the loader then finds the bytes in page cache and reads them at the kernel's speed with no
request at all. Only chunks the read engine offers are pushed: whole pages of a chunk well ahead of
the loader (of one chunk in eight, all but the first, so that the loader's read of it tells the
engine how far the file is consumed), with the pages it shares with the fill outside the rank's
slices completed with fill (a loader reads the first and last page of each slice).

A safetensors reader lists a file before it copies: it reads the header, then the first byte of
every tensor as it makes it, holding the GIL. Through a mount each of those reads, where the page
is not cached, is a request with the kernel's readahead behind it, one at a time for all
the files a loader opened, and the loader's first copy waits for all of them. So a file's first
open is answered once those pages are pushed: copied from the source's page cache where it holds
them, else read direct, a few pages each (left to requests, their readahead would read the files
whole before the first copy); and, safetensors holding the GIL through the open too, the next
files' listings are pushed behind it (`Listings`).

A push waits for the locks of pages a pending read holds; those reads are answered from the chunk's
memory (or the fill's), which the push never waits for, so the two cannot deadlock. The push owns
that memory until `notify_store` returns.
"""

from __future__ import annotations

import collections
import errno
import logging
import math
import os
import struct
import threading
import time
from typing import NamedTuple

import pyfuse3
import trio

from rankfs.plan.extents import Extent
from rankfs.reader.buffers import Backing
from rankfs.reader.chunks import Chunk
from rankfs.reader.engine import ReadEngine
from rankfs.common.disk import PAGE
from rankfs.common.threads import start_thread
from rankfs.common.trace import timed
from rankfs.vfs.tree import Content

log = logging.getLogger("rankfs.push")


async def push_prefetched(engine: ReadEngine, threads: int):
    """Push what the engine offers until cancelled, from `threads` threads of their own."""
    engine.enable_push()
    pushers = PushThreads(engine, threads, trio.lowlevel.current_trio_token())
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pushers.hand_offers)
            nursery.start_soon(pushers.account_stored)
    finally:
        pushers.stop()


class Offer(NamedTuple):
    """A chunk queued to push: its pages [start, end) as (offset, bytes) pieces, the backing they
    lie in (owned until its thread is done with it), the engine's drop count and the time it was
    queued."""

    chunk: Chunk
    start: int
    end: int
    pieces: list[tuple[int, memoryview]]
    backing: Backing
    drops: int
    asked: float


class PushThreads:
    """Threads that store the offered chunks into the views' page cache, each taking the next offer
    as soon as it has stored one. A push never waits for the event loop to hand it to a thread or
    take its result: the loop answers the requests, and a push waiting behind them lets the loader
    overtake it. The loop only queues offers and hears of stored ones in batches.

    Where offers back up (few cores), the newest goes first: it lies furthest ahead of the loader,
    where the oldest would wait on the page locks of the loader's reads, and those wait on the loop.
    Offers the loader has reached meanwhile (`ReadEngine.still_pushable`, read without the loop: a
    stale answer only pushes in vain or leaves pages to a request) leave the queue unstored, so that
    their memory goes back."""

    def __init__(self, engine: ReadEngine, threads: int, token: trio.lowlevel.TrioToken):
        self._engine = engine
        self._token = token
        self._offers: collections.deque[Offer] = collections.deque()  # oldest on the left
        self._done: list[tuple[Offer, bool, float, float]] = []  # (offer, stored, began, ended)
        self._lock = threading.Condition()  # over both lists and `_stopped`; re-entrant
        self._stopped = False
        self._stored_send, self._stored = trio.open_memory_channel(math.inf)
        self._threads = [start_thread(self._push_offers, f"rankfs-push-{i}") for i in range(threads)]

    async def hand_offers(self):
        """Queue each offered chunk still worth pushing, with the pages to push and their backing."""
        async for chunk in self._engine.pushable:
            span = self._engine.push_range(chunk)
            if span is not None:
                pieces, backing = self._engine.push_memory(chunk, *span)
                with self._lock:
                    self._offers.append(Offer(chunk, *span, pieces, backing, self._engine.drops, time.monotonic()))
                    self._lock.notify()

    async def account_stored(self):
        """What the threads stored is in the kernel's page cache: the engine keeps only its edges."""
        async for batch in self._stored:
            dropped = set()
            for offer, stored, began, ended in batch:
                offer.backing.done()
                if offer.drops != self._engine.drops:  # `rankfs drop` ran meanwhile: what was stored must go too
                    dropped.add(offer.chunk.file_id)
                elif stored:
                    self._engine.pushed(offer.chunk, offer.backing, offer.start, offer.end, (offer.asked, began, ended))
            for inode in dropped:
                await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inode, False)

    def stop(self):
        """No more stores: the threads end once their store returns (a store blocked on a page lock
        ends when the unmount aborts the reads holding it)."""
        with self._lock:
            self._stopped = True
            self._lock.notify_all()

    def _push_offers(self):
        while (offer := self._take()) is not None:
            stored, began, ended = timed(_store_pieces, offer.chunk.file_id, offer.pieces)
            self._report([(offer, stored, began, ended)])

    def _take(self) -> Offer | None:
        """The newest offer still worth pushing (those the loader has reached are reported unstored
        on the way); None once stopped."""
        with self._lock:
            while not self._stopped:
                passed = []
                while self._offers and not self._engine.still_pushable(self._offers[0].chunk):
                    passed.append(self._offers.popleft())
                while self._offers and not self._engine.still_pushable(self._offers[-1].chunk):
                    passed.append(self._offers.pop())
                if passed:
                    self._report([(o, False, 0.0, 0.0) for o in passed])
                if self._offers:
                    return self._offers.pop()
                self._lock.wait()
            return None

    def _report(self, done: list[tuple]):
        """Stores done or given up: the loop is told once for whatever comes until it takes them."""
        with self._lock:
            self._done += done
            first = len(self._done) == len(done)
        if first:
            try:
                self._token.run_sync_soon(self._hand_stored)
            except trio.RunFinishedError:
                pass

    def _hand_stored(self):
        """On the event loop: the stores done so far go to `account_stored`."""
        with self._lock:
            batch, self._done = self._done, []
        self._stored_send.send_nowait(batch)


async def drop_consumed(engine: ReadEngine):
    """Drop from the views' page cache the ranges the engine offers, until cancelled."""
    engine.enable_dropping()
    device = _fuse_device()
    if device is None:
        log.warning("no /dev/fuse descriptor in this process: the views' pages stay cached after a load")
        return
    async for inode, start, end in engine.droppable:
        await trio.to_thread.run_sync(_invalidate_range, device, inode, start, end)


def _fuse_device() -> int | None:
    """This process's descriptor of its FUSE connection (libfuse's session, opened at the mount)."""
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "/dev/fuse":
                return int(name)
        except OSError:
            continue
    return None


# FUSE_NOTIFY_INVAL_INODE (include/uapi/linux/fuse.h): a fuse_out_header whose error field holds the
# notify code and whose unique is 0, then fuse_notify_inval_inode_out {ino, off, len}. pyfuse3's
# invalidate_inode drops a whole file; a range needs the message itself.
_NOTIFY_INVAL_INODE = 2
_INVAL_RANGE = struct.Struct("<IiQQqq")


def _invalidate_range(device: int, inode: int, start: int, end: int):
    """The kernel drops the pages of [start, end) of the file from its page cache, unmapping them
    from whoever maps them (a later read asks for them again)."""
    try:
        os.write(device, _INVAL_RANGE.pack(_INVAL_RANGE.size, _NOTIFY_INVAL_INODE, 0, inode, start, end - start))
    except OSError as exc:
        if exc.errno != errno.ENOENT:  # the kernel forgot the file meanwhile: nothing cached
            log.warning("dropping %d bytes at %d of inode %d failed: %s", end - start, start, inode, exc)


def _store_pieces(inode: int, pieces: list[tuple[int, memoryview]]) -> bool:
    return all([_store(inode, offset, data) for offset, data in pieces])


def _store(inode: int, offset: int, data: memoryview) -> bool:
    try:
        pyfuse3.notify_store(inode, offset, data)
        return True
    except OSError as exc:
        # ENOENT: the kernel has not looked the file up yet; the chunk is then served by reads.
        if exc.errno != errno.ENOENT:
            log.warning("push of %d bytes at %d into inode %d failed: %s", len(data), offset, inode, exc)
        return False


# Files of a view whose listing pages are pushed ahead of their first open, behind the one opened:
# SGLang's iterator opens eight ahead of the one it reads.
LISTED_AHEAD_FILES = 8


class Listings:
    """Each view file's listing pages pushed once, before an open of it is answered: at its first
    open, and ahead of it once a file before it in its view is first opened (the next few, one
    after the other in the background), so that a loader opening a view's files in turn finds them
    listed. safetensors holds the GIL through an open: the loader's every thread waits for it.

    An open that finds its file's listing queued ahead pushes it at once; one that finds it under
    way waits for it."""

    def __init__(self, engine: ReadEngine):
        self._engine = engine
        self._done: dict[int, trio.Event] = {}  # inode -> set once its listing is pushed
        self._queued: dict[int, tuple[Content, int]] = {}  # listed ahead, not begun: the engine's drops then
        self._ahead_send, self._ahead = trio.open_memory_channel(math.inf)

    async def opened(self, inode: int, content: Content, shard, push: bool):
        """A file opened (`shard`: its view and position, or None); `push`: the engine's word that
        its listing is to be pushed now (`ReadEngine.opened`)."""
        if push:
            self._queued.pop(inode, None)  # a new reader's first open since it was queued
            await self._push(inode, content)
            if shard is not None:
                self._queue_next(*shard)
        elif inode in self._queued:
            await self._push(inode, self._queued.pop(inode)[0])
        elif inode in self._done:
            await self._done[inode].wait()

    def _queue_next(self, view, position: int):
        for later in range(position + 1, min(position + 1 + LISTED_AHEAD_FILES, len(view.inodes))):
            content, inode = view.content(later), view.inodes[later]
            if content.stream.take_listing(self._engine.pushing):
                self._done[inode] = trio.Event()
                self._queued[inode] = (content, self._engine.drops)
                self._ahead_send.send_nowait(inode)

    async def push_ahead(self):
        """Push the listings queued ahead, in turn, until cancelled; not after a drop (which leaves
        listings out) or once a new reader took the view (its first opens list the files again)."""
        async for inode in self._ahead:
            content, drops = self._queued.pop(inode, (None, None))
            if content is None:
                continue
            if drops == self._engine.drops and content.stream.listed:
                await self._push(inode, content)
            else:
                self._done.pop(inode).set()

    async def _push(self, inode: int, content: Content):
        done = self._done.setdefault(inode, trio.Event())
        try:
            await push_listing_pages(self._engine, inode, content)
        finally:
            done.set()
            del self._done[inode]


async def push_listing_pages(engine: ReadEngine, inode: int, content: Content):
    """Push the pages a listing of the file reads (`Content.listing`), runs of them in one call."""
    asked = time.monotonic()
    (pages, refused, pieces), began, ended = await trio.to_thread.run_sync(timed, _store_listing, engine, inode,
                                                                           content)
    engine.trace.event("listed", inode=inode, pages=pages, asked=asked, began=began, ended=ended)
    engine.stats.listing_pages += pages
    engine.stats.listing_pages_left += len(content.listing) - pages
    engine.stats.listing_pages_refused += refused
    engine.listed(pieces)


def _store_listing(engine: ReadEngine, inode: int,
                   content: Content) -> tuple[int, int, list[tuple[Chunk, int, int]]]:
    """Runs in a worker thread: the listing's pages the sources' page cache lacks asked of the disk
    at once, then stored (`_store_pages`), and let go of in the sources' page cache."""
    spans = _data_spans(content)
    asked, held = engine.sources.ask_for_pages(spans)
    try:
        return _store_pages(engine, inode, content, {(e.offset, lo) for (e, lo, _), h in zip(spans, held) if h})
    finally:
        engine.sources.drop_pages(asked)


def _data_spans(content: Content) -> list[tuple[Extent, int, int]]:
    """(extent, lo, hi): the data on the pages a listing of the file reads."""
    spans = []
    for page in content.listing:
        end = min(page + PAGE, content.size)
        spans += [(e, max(page, e.offset), min(end, e.end)) for e in content.extents_at(page, end) if e.kind == "data"]
    return spans


def _store_pages(engine: ReadEngine, inode: int, content: Content,
                 cached: set[tuple[int, int]]) -> tuple[int, int, list[tuple[Chunk, int, int]]]:
    """Each listing page whose bytes are at hand, adjacent ones stored together; `cached`: the
    (extent offset, start) of the data spans the sources' page cache held. Returns how many were
    stored, how many the kernel refused, and the stored pages' pieces of chunks (`_page_bytes`)."""
    stored, refused, pieces, run, run_pieces, run_start = 0, 0, [], bytearray(), [], 0
    for page in [*content.listing, None]:
        page_pieces: list[tuple[Chunk, int, int]] = []
        data = None if page is None else _page_bytes(engine, content, page, page_pieces, cached)
        if run and (data is None or page != run_start + len(run)):
            pages = -(-len(run) // PAGE)
            if _store(inode, run_start, memoryview(run)):
                stored += pages
                pieces += run_pieces
            else:
                refused += pages
            run, run_pieces = bytearray(), []
        if data is not None:
            run_start = page if not run else run_start
            run += data
            run_pieces += page_pieces
    return stored, refused, pieces


def _page_bytes(engine: ReadEngine, content: Content, page: int, pieces_of_chunks: list,
                cached: set[tuple[int, int]]) -> bytes | None:
    """The file's bytes on one page (up to its end), or None where a source cannot be read or the
    page is not served (the local ranks' shared view). Its pieces of chunks are added to
    `pieces_of_chunks`: (chunk, lo, hi)."""
    end = min(page + PAGE, content.size)
    pieces = []
    for extent in content.extents_at(page, end):
        lo, hi = max(page, extent.offset), min(end, extent.end)
        if extent.kind == "header":
            pieces.append(content.memory[lo:hi])
        elif extent.kind == "fill":
            pieces.append(engine.fill.take(hi - lo))
        elif extent.kind == "data":
            try:
                pieces.append(engine.sources.read_pages(extent, lo, hi, cached=(extent.offset, lo) in cached))
            except OSError:  # a changed or unreadable source: the read of this page says so
                return None
            for chunk in content.runs[extent.offset].overlapping(lo, hi):
                pieces_of_chunks.append((chunk, max(lo, chunk.start), min(hi, chunk.end)))
        else:
            return None
    return b"".join(pieces)
