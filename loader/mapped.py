"""Tensors that view maps of the sources (for loads into host memory, where a slab would only add a
copy). They are returned at once; the loader's own page faults find their pages read ahead, in
flight, or read them. Column slices view whole rows, the rank's columns strided.

The read-ahead goes a WILLNEED piece at a time (each as large as one call reads), queued under the
key (file, group, piece): the map readers take the piece the loader needs first across all open
files, and each waits for its piece before taking another, so that the disk's queue holds what the
loader needs next rather than gigabytes the elevator serves in sector order. A group's bytes count
against the hook's budget from its read-ahead until the loader lets each tensor go.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import weakref
from concurrent.futures import Future

import numpy as np
import torch

from rankfs.loader.context import MappingContext
from rankfs.loader.files import RankfsFile
from rankfs.common.disk import (CACHED_SHORT_BYTES, MADV_POPULATE_READ, covering_pages, inner_pages, madvise,
                                merge_adjacent, page_cache_holds, willneed_pieces)

log = logging.getLogger("rankfs.hook")

UNMAP_BATCH_BYTES = 64 << 20


class MappedFile(RankfsFile):
    def __init__(self, path: str, context: MappingContext, placement: dict):
        super().__init__(path, context.file, placement)
        self._load_context = context
        # Per group: bytes of tensors the loader may still read, which its read-ahead reserves.
        self._unfreed = [sum(self.span(n)[1] for n in group) for group in self.groups]
        self._freed: set[str] = set()
        self._alive: dict[str, int] = {}  # tensor -> its views handed out and not yet let go
        self._maps: dict[str, np.ndarray] = {}  # source path -> its whole map
        self._let_go: list[tuple[str, int, int]] = []  # let go, still mapped in: (path, begin, end)
        self._let_go_bytes = 0
        self._reserved: set[int] = set()  # groups whose read-ahead holds their unfreed bytes
        self._pieces_left: dict[int, int] = {}  # per group read ahead: its pieces not yet read
        self._unverified: set[int] = set()  # groups a piece of which was not read here: cached already, or failed
        self._closed = False
        self._sources = {(source.fd, source.path): source for source, _ in placement.values()}
        self._lock = threading.Lock()
        for (_, source), begin, end in self._source_spans([n for group in self.groups for n in group]):
            self._files.note_mapped(source, begin, end - begin)  # what the release drops, noted once
        self._futures: list[Future] = [context.executor.submit((path, g), self._read_ahead, g, self._unfreed[g],
                                                                cost=self._unfreed[g])
                                       for g in range(len(self.groups))]

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        """No wait: a view of the source's map, whose last view's death lets its budget go."""
        offset, nbytes = self.span(name)
        path = self._placement[name][0].path
        if path not in self._maps:  # kept here: the tensors may outlive the hook's release
            self._maps[path] = np.frombuffer(self._files.source_map(path), np.uint8)
        if self._pieces_left.get(group) != 0 or group in self._unverified:  # else all its pages were read here
            self._readable(name, path, offset, nbytes)
        base = self._maps[path][offset:offset + nbytes]  # an array of its own: its death is the tensor's
        weakref.finalize(base, self._freed_by_loader, name, group, path, offset, nbytes).atexit = False
        with self._lock:
            self._alive[name] = self._alive.get(name, 0) + 1
        tensor = torch.from_numpy(base).view(dtype)
        slc, rows = self._slices.get(name), self.rows(name)
        if rows is not None and not rows.is_block:  # whole rows mapped: the rank's columns, strided
            return tensor.reshape(self._entries[name].shape).narrow(slc.dim, slc.start, slc.stop - slc.start)
        return tensor.reshape(self.resident_shape(name))

    def _readable(self, name: str, path: str, offset: int, nbytes: int):
        """A page of a map that the disk cannot give is a SIGBUS in whichever thread touches it: the
        pages of a tensor whose group was not read ahead whole, and that are not all up to date in
        the page cache, are mapped in here (MADV_POPULATE_READ: the read-ahead's, in flight, waited
        for; those it could not read, read again), so that a failing source is an error naming the
        file and tensor."""
        if self._placement[name][0].readable(offset, offset + nbytes):
            return
        start, stop = covering_pages(offset, offset + nbytes)
        try:
            madvise(self._maps[path].ctypes.data + start, stop - start, MADV_POPULATE_READ,
                    holding_gil=stop - start <= CACHED_SHORT_BYTES)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: tensor {name!r}: reading bytes {offset}-{offset + nbytes} "
                                     f"failed: {exc.strerror}") from None

    def close(self):
        self._closed = True
        for future in self._futures:
            future.cancel()
        with self._lock:
            reserved, self._reserved = self._reserved, set()
            unfreed = sum(self._unfreed[group] for group in reserved)
        self._load_context.budget.release(unfreed)
        super().close()

    # -- read-ahead -----------------------------------------------------------------------------

    def _read_ahead(self, group: int, reserved: int):
        """Runs in a map reader once the budget had room for the group's `reserved` bytes: queue its
        pieces (the loader never waits for a mapped group's read-ahead: it faults the pages in
        itself, so a full budget only holds the read-ahead back)."""
        with self._lock:
            unfreed = self._unfreed[group]  # the loader may have let some go since
            if unfreed:
                self._reserved.add(group)
        self._load_context.budget.release(reserved - unfreed)
        if not unfreed:
            return
        names = [n for n in self.groups[group] if n not in self._freed]
        pieces = [(key, piece, size) for key, begin, end in self._source_spans(names)
                  for piece, size in willneed_pieces(begin, end - begin, self._files.link.willneed_reach[key[1]])]
        with self._lock:
            self._pieces_left[group] = len(pieces)
        for i, piece in enumerate(pieces):
            self._load_context.executor.submit((self.path, group, i), self._read_piece, group, *piece)

    def _source_spans(self, names: list[str]) -> list[list]:
        """((fd, path), begin, end) in the sources of what is read for the tensors, adjacent ones joined."""
        return merge_adjacent(((self._placement[n][0].fd, self._placement[n][0].path), offset, offset + nbytes)
                              for n in names for offset, nbytes in [self.span(n)])

    def _read_piece(self, group: int, key: tuple[int, str], offset: int, length: int):
        """Read a piece of a group's sources ahead, and see that every page of it is up to date: a
        read that failed within the piece leaves its last page to be read alone, and well."""
        source, fd = self._sources[key], key[0]
        try:
            if self._closed:  # the loader took what it wanted
                return
            if page_cache_holds(fd, offset, offset + length):  # nothing to read ahead; not read, not verified
                with self._lock:
                    self._unverified.add(group)
                return
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
            os.pread(fd, 1, offset + length - 1)  # returns once the piece's last page is read
            if not source.readable(offset, offset + length):
                raise OSError(errno.EIO, "a page of it is not up to date once read")
        except OSError as exc:  # the loader's tensors of it are read where they are handed out, and fail by name
            log.error("rankfs hook: %s: reading bytes %d-%d of a source failed: %s", self.path,
                      offset, offset + length, exc)
            with self._lock:
                self._unverified.add(group)
        finally:
            with self._lock:
                self._pieces_left[group] -= 1

    # -- the loader lets go ---------------------------------------------------------------------

    def _freed_by_loader(self, name: str, group: int, path: str, offset: int, nbytes: int):
        with self._lock:
            self._alive[name] -= 1
            if self._alive[name]:  # asked for twice: let go with the last
                return
            first = name not in self._freed
            self._freed.add(name)
            if first:
                self._unfreed[group] -= nbytes
            reserved = first and group in self._reserved
        self._unmap(path, offset, nbytes)
        if reserved:
            self._load_context.budget.release(nbytes)
        if first:
            self.count_loaded(nbytes)

    def _unmap(self, path: str, offset: int, nbytes: int):
        """A tensor the loader has let go leaves this process's memory (its pages stay in page
        cache), or every mapped byte would count in its RSS until the release. Batched, adjacent
        tensors merged, with the GIL let go; only pages wholly inside what was let go, since a
        neighbour may still view the pages it shares."""
        with self._lock:
            self._let_go.append((path, offset, offset + nbytes))
            self._let_go_bytes += nbytes
            if self._let_go_bytes < UNMAP_BATCH_BYTES:
                return
            spans, self._let_go, self._let_go_bytes = self._let_go, [], 0
        for path, begin, end in merge_adjacent(spans):
            start, stop = inner_pages(begin, end)
            if stop > start:
                madvise(self._maps[path].ctypes.data + start, stop - start, mmap.MADV_DONTNEED)

