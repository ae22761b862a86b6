"""What `safe_open` returns, through the hook, for a file on a rankfs view.

The file's tensors (in the loaders' order: sorted names) are packed into slabs and read ahead by the
hook's threads with large preads, the groups the loader needs first before those it needs later;
`get_tensor` returns views into the slabs. The bytes are read where the mount says they lie in the
source shards (`.rankfs/sources/`), so they do not pass through FUSE at all; where it cannot say,
or the sources cannot be read here, from the virtual file.
For loads into host memory (by default when there is no CUDA) a slab would only add a copy: the
tensors are views of the sources' maps instead (column slices strided over whole rows), returned at
once and read ahead into page cache a piece at a time in the loaders' order; each counts against the
hook's budget from its read-ahead until the loader lets it go.
Sliced experts hold only their slice (read as one block, or as whole rows with the rank's columns
copied out) behind a guarded full-shape stand-in. Row-store tables stay stock mmap tensors.
"""

from __future__ import annotations

import functools
import json
import math
import mmap
import os
import threading
import weakref
from concurrent.futures import Future

import numpy as np
import torch

from loader.guard import SlicedTensor
from loader.slabs import Slab, pack
from plan.layout import ON_DEMAND_METADATA_KEY, SLICES_METADATA_KEY
from plan.safetensors import DTYPE_SIZES, read_header
from reader.device import willneed_pieces
from reader.pages import inner_pages, madvise

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}
BOUNCE_BYTES = 8 << 20


def _pread_into(fd: int, view: memoryview, offset: int, path: str, name: str):
    done = 0
    while done < len(view):
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            raise OSError(exc.errno, f"{path}: tensor {name!r}: read at offset {offset + done} failed: "
                                     f"{exc.strerror}") from None
        if n == 0:
            raise OSError(f"{path}: tensor {name!r}: short read at offset {offset + done}; "
                          "the file was truncated")
        done += n


UNMAP_BATCH_BYTES = 64 << 20
IOV_MAX = 1024
RUN_BYTES = 16 << 20


def _runs(blocks: list, limit: bool = True):
    """Blocks (sorted by fd and offset) in runs adjacent in the file: at most IOV_MAX blocks and
    about RUN_BYTES each when `limit`, for one preadv."""
    run: list = []
    for block in blocks:
        fd, offset = block[0], block[1]
        if run and (run[-1][0] != fd or run[-1][1] + len(run[-1][2]) != offset
                    or limit and (len(run) == IOV_MAX or offset - run[0][1] >= RUN_BYTES)):
            yield run
            run = []
        run.append(block)
    if run:
        yield run


def _read_run(run: list):
    fd, offset = run[0][0], run[0][1]
    try:
        done = os.preadv(fd, [block[2] for block in run], offset)
    except OSError as exc:
        raise OSError(exc.errno, f"{run[0][3]}: tensor {run[0][4]!r}: read at offset {offset} failed: "
                                 f"{exc.strerror}") from None
    for _, begin, target, where, name in run:  # what a short read left, piece by piece
        if done >= len(target):
            done -= len(target)
            continue
        _pread_into(fd, target[done:], begin + done, where, name)
        done = 0


def _merge_adjacent(spans) -> list[list]:
    """(key, begin, end) spans in order, those that touch (same key, one's end the next's begin)
    joined: one call for adjacent tensors."""
    merged: list[list] = []
    for key, begin, end in sorted(spans):
        if merged and merged[-1][0] == key and merged[-1][2] == begin:
            merged[-1][2] = end
        else:
            merged.append([key, begin, end])
    return merged


_thread = threading.local()


def _bounce(nbytes: int) -> bytearray:
    """This thread's buffer for whole rows: a fresh one per tensor cost a zero-filled page fault
    per 4 KiB of it."""
    buffer = getattr(_thread, "bounce", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _thread.bounce = bytearray(nbytes)
    return buffer


class RankfsFile:
    def __init__(self, path: str, hook, stock_open):
        self.path = path
        self._hook, self._stock_open, self._stock = hook, stock_open, {}
        header = read_header(path, direct=True)
        self._data_start = header.data_start
        self._entries = header.tensors
        self._metadata = header.metadata
        meta = header.metadata or {}
        self._slices = json.loads(meta.get(SLICES_METADATA_KEY, "{}"))
        self._on_demand = set(json.loads(meta.get(ON_DEMAND_METADATA_KEY, "[]")))
        self._fd = os.open(path, os.O_RDONLY)
        self._backing = hook.backing(path)
        # Bytes read from the sources bypass the mount: the daemon hears of them from the hook.
        self._progress = hook.progress(path) if self._backing is not None else None
        eager = [n for n in sorted(self._entries) if n not in self._on_demand]
        self._mapped = set(eager) if self._backing is not None and hook.map_sources else set()
        groups = [[name for name, _ in group]
                  for group in pack([(n, self._resident_bytes(n)) for n in eager], hook.pool.slab_bytes)]
        self._group_of = {name: g for g, group in enumerate(groups) for name in group}
        self._groups = groups
        self._mapped_bytes = [sum(self._mapped_span(n)[1] for n in group if n in self._mapped) for group in groups]
        # A mapped tensor's bytes count against the budget from its group's read-ahead on until
        # the loader lets the tensor go (it has copied it), or the file closes.
        self._unfreed = list(self._mapped_bytes)  # per group: bytes of tensors the loader still may read
        self._freed: set[str] = set()
        self._alive: dict[str, int] = {}  # mapped tensor -> its views handed out and not yet let go
        self._maps: dict[str, np.ndarray] = {}  # source path -> its whole map, for mapped tensors
        self._let_go_spans: list[tuple[str, int, int]] = []  # let go, still mapped in: (path, begin, end)
        self._let_go_bytes = 0
        self._held: set[int] = set()  # groups whose read-ahead holds their unfreed bytes
        self._lock = threading.Lock()
        self._remaining = [sum(n not in self._mapped for n in group) for group in groups]  # slab tensors
        self._demanded: set[int] = set()
        self._futures: list[Future | None] = [self._submit(g) for g in range(len(groups))]

    # -- the safe_open interface ----------------------------------------------------------------

    def keys(self):
        return sorted(self._entries)

    def metadata(self):
        return self._metadata

    def get_slice(self, name):
        return self._stock_handle(name).get_slice(name)

    def get_tensor(self, name: str) -> torch.Tensor:
        if name in self._on_demand:
            return self._stock_handle(name).get_tensor(name)
        if name not in self._group_of:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        group = self._group_of[name]
        self._demanded.add(group)
        entry = self._entries[name]
        dtype = TORCH_DTYPES[entry.dtype]
        shape = list(entry.shape)
        if name in self._slices:
            dim, start, stop = self._slices[name]
            shape[dim] = stop - start
        if name in self._mapped:  # no wait: its page faults find the pages read ahead, in flight, or read them
            resident = self._mapped_tensor(name, group).view(dtype)
            if name in self._slices and dim > 0:  # whole rows mapped: the rank's columns, strided
                resident = resident.reshape(entry.shape).narrow(dim, start, stop - start)
        else:
            slab, offsets = (self._futures[group] or self._submit(group)).result()
            self._handed_slab_tensor(group)
            self._count_loaded(name)
            resident = slab.tensor[offsets[name]:offsets[name] + self._resident_bytes(name)].view(dtype)
        if name not in self._slices:
            return resident.reshape(entry.shape)
        return SlicedTensor(name, entry.shape, dtype, dim, start, stop, resident.reshape(shape))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        # An unrequested slab would stay alive with its future: drop them all.
        for future in self._futures:
            if future is not None:
                future.cancel()
        self._futures = [None] * len(self._futures)
        with self._lock:
            held, self._held = self._held, set()
        self._hook.pool.let_go(sum(self._unfreed[group] for group in held))
        if self._progress is not None:
            self._progress.flush()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    # -- reading --------------------------------------------------------------------------------

    def _stock_handle(self, name: str):
        """The stock reader for what the hook leaves to it (row-store tables): on the tensor's
        source shard, where it lies under the same name, when the mount says which."""
        path = self._backing[name][2] if self._backing is not None and name in self._backing else self.path
        if path not in self._stock:
            self._stock[path] = self._stock_open(path, framework="pt")
        return self._stock[path]

    def _resident_bytes(self, name: str) -> int:
        entry = self._entries[name]
        nbytes = entry.end - entry.begin
        if name not in self._slices:
            return nbytes
        dim, start, stop = self._slices[name]
        return nbytes // entry.shape[dim] * (stop - start)

    def _submit(self, group: int) -> Future:
        """Read a group ahead: the loaders take files in sorted order, each file's groups in order."""
        readers = self._hook.map_executor if self._mapped_bytes[group] else self._hook.executor
        return readers.submit((self.path, group), self._load, group)

    def _load(self, group: int) -> tuple[Slab | None, dict[str, int]]:
        """Runs in a hook thread: fill one slab, and read the group's mapped tensors ahead. Tensors
        whose bytes are adjacent in the file are read together, in file order, with one scattering
        preadv each run. Returns the slab and each staged tensor's offset in it."""
        may_wait = lambda: group not in self._demanded  # noqa: E731
        names = self._groups[group]
        if self._mapped_bytes[group] and self._hold(group):
            self._read_ahead(group, [n for n in names if n in self._mapped and n not in self._freed])
        staged = [n for n in names if n not in self._mapped]
        if not staged:
            return None, {}
        offsets = {name: offset for name, offset in pack([(n, self._resident_bytes(n)) for n in staged],
                                                         1 << 62)[0]}
        slab = self._hook.pool.allocate(offsets[staged[-1]] + self._resident_bytes(staged[-1]), staged,
                                        self.path, may_wait)
        view = slab.memoryview()
        blocks = []  # (fd, file offset, slab view, file name, tensor): contiguous pieces to read
        reads = []  # (fd, file offset, read): what fills the slab, each read by one thread
        for name in staged:
            fd, begin, where = self._locate(name)
            target = view[offsets[name]:offsets[name] + self._resident_bytes(name)]
            block = self._block(name, begin)
            if block is None:
                reads.append((fd, begin, functools.partial(self._read_rows, name, fd, begin, where, target)))
            else:
                blocks.append((fd, block, target, where, name))
        blocks.sort(key=lambda b: (b[0], b[1]))
        reads.extend((run[0][0], run[0][1], functools.partial(_read_run, run)) for run in _runs(blocks))
        # Every free read thread helps: the group the loader needs first is filled first.
        self._hook.executor.run_all((self.path, group), [read for _, _, read in sorted(reads, key=lambda r: r[:2])])
        self._hook.pool.filled(slab)
        # The pages are not needed twice: keep them out of MemAvailable's way. Only the ranges read:
        # between them lie other slabs' tensors (which the daemon may have pushed, for a view).
        for run in _runs(blocks, limit=False):
            fd, begin = run[0][0], run[0][1]
            os.posix_fadvise(fd, begin, run[-1][1] + len(run[-1][2]) - begin, os.POSIX_FADV_DONTNEED)
        return slab, offsets

    def _read_ahead(self, group: int, names: list[str]):
        """Start reading mapped tensors into page cache: the loader's own page faults then find
        them there, or in flight. Each piece is one WILLNEED call as large as one reads (a call per
        128 KiB cost a warm load a third of its speed), queued under the group's key: the map
        readers take the piece the loader needs first, across all open files, and each waits
        for its piece before taking another, so the disk's queue holds what the loader needs
        next. Whole groups asked for at once filled it with gigabytes that the elevator served in
        sector order while the loader waited; groups a thread each started files opened early
        before the first file (EP1 sliced: its faults read page by page behind them)."""
        spans = _merge_adjacent(((self._backing[n][0], self._backing[n][2]), offset, offset + nbytes)
                                for n in names for offset, nbytes in [self._mapped_span(n)])
        pieces = [(fd, piece, size) for (fd, path), begin, end in spans
                  for piece, size in willneed_pieces(begin, end - begin, self._hook.willneed_reach[path])]
        for i, piece in enumerate(pieces):
            self._hook.map_executor.submit((self.path, group, i), self._read_piece, *piece)

    def _read_piece(self, fd: int, offset: int, length: int):
        if self._fd < 0:  # closed: the loader took what it wanted
            return
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        os.pread(fd, 1, offset + length - 1)  # returns once the piece's last page is read

    def _hold(self, group: int) -> bool:
        """Count the bytes of a group's mapped tensors the loader may still read against the
        budget, once it has room: the loader never waits for a mapped group's read-ahead (it
        faults the pages in itself), so a full budget only holds the read-ahead back. False when
        the loader has let them all go."""
        wanted = self._unfreed[group]
        if wanted == 0:
            return False
        self._hook.pool.hold(wanted)
        with self._lock:
            unfreed = self._unfreed[group]
            if unfreed:
                self._held.add(group)
        self._hook.pool.let_go(wanted - unfreed)
        return unfreed > 0

    def _mapped_tensor(self, name: str, group: int) -> torch.Tensor:
        """Bytes of a source's map, as a tensor whose last view's death lets its budget go."""
        offset, nbytes = self._mapped_span(name)
        path = self._backing[name][2]
        if path not in self._maps:  # kept here: the tensors may outlive the hook's release
            self._maps[path] = np.frombuffer(self._hook.source_map(path), np.uint8)
        base = self._maps[path][offset:offset + nbytes]  # an array of its own: its death is the tensor's
        weakref.finalize(base, self._freed_by_loader, name, group, nbytes).atexit = False
        with self._lock:
            self._alive[name] = self._alive.get(name, 0) + 1
        return torch.from_numpy(base)

    def _freed_by_loader(self, name: str, group: int, nbytes: int):
        with self._lock:
            self._alive[name] -= 1
            if self._alive[name]:  # asked for twice: let go with the last
                return
            first = name not in self._freed
            self._freed.add(name)
            if first:
                self._unfreed[group] -= nbytes
            held = first and group in self._held
        self._unmap(name)
        if held:
            self._hook.pool.let_go(nbytes)
        if first:
            self._count_loaded(name)

    def _unmap(self, name: str):
        """A tensor the loader has let go leaves this process's memory (its pages stay in page cache):
        otherwise every mapped byte would count in its RSS until the release. Batched, adjacent
        tensors merged (a call per tensor cost a warm load a fifth of its speed); only pages wholly
        inside what was let go: a neighbour may still view, or have written, the pages it shares."""
        offset, nbytes = self._mapped_span(name)
        with self._lock:
            self._let_go_spans.append((self._backing[name][2], offset, offset + nbytes))
            self._let_go_bytes += nbytes
            if self._let_go_bytes < UNMAP_BATCH_BYTES:
                return
            spans, self._let_go_spans, self._let_go_bytes = self._let_go_spans, [], 0
        for path, begin, end in _merge_adjacent(spans):
            start, stop = inner_pages(begin, end)
            if stop > start:  # the GIL is let go while the kernel unmaps
                madvise(self._maps[path].ctypes.data + start, stop - start, mmap.MADV_DONTNEED)

    def _count_loaded(self, name: str):
        """Report a tensor loaded (a mapped one once the loader has let it go: copied) by the bytes
        the view serves for it."""
        if self._progress is not None:
            self._progress.add(self._mapped_span(name)[1])

    def _handed_slab_tensor(self, group: int):
        """With the last of a slab's tensors handed out, the slab lives only as long as they do."""
        self._remaining[group] -= 1
        if self._remaining[group] == 0:
            self._futures[group] = None

    def _locate(self, name: str) -> tuple[int, int, str]:
        """(fd, offset of the tensor's first byte, file name for messages): in its source shard
        when the mount says where, else in the view."""
        if self._backing is not None:
            return self._backing[name]
        return self._fd, self._data_start + self._entries[name].begin, self.path

    def _mapped_span(self, name: str) -> tuple[int, int]:
        """(offset, length) in its source of what a mapped tensor views: its block, or its whole
        rows for a column slice."""
        begin = self._backing[name][1]
        block = self._block(name, begin)
        if block is None:
            entry = self._entries[name]
            return begin, entry.end - entry.begin
        return block, self._resident_bytes(name)

    def _block(self, name: str, begin: int) -> int | None:
        """Where the tensor's resident bytes start in the file, when they are one block: whole
        tensors and row slices. None for column slices, read row by row."""
        if name not in self._slices:
            return begin
        entry = self._entries[name]
        dim, start, _ = self._slices[name]
        if dim != 0:
            return None
        return begin + DTYPE_SIZES[entry.dtype] * math.prod(entry.shape[1:]) * start

    def _read_rows(self, name: str, fd: int, begin: int, where: str, target: memoryview):
        entry = self._entries[name]
        dim, start, stop = self._slices[name]
        inner = DTYPE_SIZES[entry.dtype] * math.prod(entry.shape[dim + 1:])
        row_bytes, keep_start, keep_stop = inner * entry.shape[dim], inner * start, inner * stop
        # Every row holds kept bytes: read whole rows through a bounded buffer, copy the columns.
        rows = (entry.end - entry.begin) // row_bytes
        per_read = min(rows, max(1, BOUNCE_BYTES // row_bytes))
        out = np.frombuffer(target, np.uint8).reshape(rows, keep_stop - keep_start)
        bounce = _bounce(per_read * row_bytes)
        for first in range(0, rows, per_read):
            count = min(per_read, rows - first)
            chunk = memoryview(bounce)[:count * row_bytes]
            _pread_into(fd, chunk, begin + first * row_bytes, where, name)
            out[first:first + count] = np.frombuffer(chunk, np.uint8).reshape(count, row_bytes)[
                :, keep_start:keep_stop]
        os.posix_fadvise(fd, begin, rows * row_bytes, os.POSIX_FADV_DONTNEED)
