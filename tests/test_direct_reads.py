"""Reads straight from the disk. The hook's reads into slabs: bytes adjacent in a source are read
together, each run placed in the slab at its offset's place within a page. The daemon's reads of
chunks. Either way ranges the page cache holds are copied or mapped from it, the rest read direct
(O_DIRECT), which leaves nothing in the page cache."""

from __future__ import annotations

import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rankfs.common.contract import Source
from rankfs.loader.jobs import Copy, cached_jobs, read_run
from rankfs.loader.landing import HostLanding
from rankfs.loader.packing import Run, lay_out
from rankfs.plan.spec import Rows
from rankfs.plan.extents import Extent
from rankfs.common import disk
from rankfs.reader.chunks import Chunk
from rankfs.common.disk import PAGE, OpenFile, align_down, align_up, page_cache_holds
from rankfs.reader.source_reader import SourceReader
from rankfs.common.trace import Trace

SIZE = 8 << 20


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "source.bin"
    data = np.random.default_rng(7).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean and out of the page cache
    os.close(fd)
    opened = OpenFile(str(path))
    yield opened, data
    opened.close()


def test_runs_keep_their_place_within_a_page_and_do_not_overlap(source):
    opened, _ = source
    blocks = [("a", opened, 100, 5000), ("b", opened, 5100, 3), ("c", opened, 9000, 70000),  # a+b adjacent
              ("d", opened, 1 << 20, 1 << 20)]
    runs, offsets, size = lay_out(blocks, [("rows", opened, 80000, 12345)])  # rows between c and d
    assert [(r.offset, r.length, r.names[0]) for r in runs] == [(100, 5003, "a"), (9000, 70000, "c"), (1 << 20, 1 << 20, "d")]
    windows = sorted([(align_down(r.at), align_up(r.at + r.length), r.offset) for r in runs]
                     + [(offsets["rows"], offsets["rows"] + 12345, 80000)])
    assert all(r.at % PAGE == r.offset % PAGE for r in runs)
    assert all(end <= begin for (_, end, _), (begin, _, _) in zip(windows, windows[1:])) and windows[-1][1] <= size
    assert [offset for *_, offset in windows] == [100, 9000, 80000, 1 << 20]  # the slab in file order
    assert offsets["b"] == offsets["a"] + 5000 and offsets["rows"] % PAGE == 0
    assert size <= sum(n for *_, n in blocks) + 12345 + 2 * PAGE * 5


def test_a_run_larger_than_a_read_is_read_in_pieces_cut_at_pages_by_several_threads(source):
    opened, data = source
    if opened.direct_fd is None:
        pytest.skip("this filesystem has no direct I/O")
    (run,), _, size = lay_out([("big", opened, 12345, (3 << 20) + 777)], [])
    pieces = run.pieces(1 << 20)
    assert [p.length for p in pieces] == [(1 << 20) - 12345 % PAGE, 1 << 20, 1 << 20, 12345 % PAGE + 777]
    assert all(p.offset % PAGE == 0 for p in pieces[1:]) and all(p.at % PAGE == p.offset % PAGE for p in pieces)
    buffer = memoryview(mmap.mmap(-1, size))
    with ThreadPoolExecutor(len(pieces)) as pool:  # at once: a direct read of one fills no page of the next
        done = list(pool.map(lambda p: opened.read_into(buffer, p.at, p.offset, p.length, "source"), pieces))
    assert done == [p.length for p in pieces]
    assert bytes(buffer[run.at:run.at + run.length]) == data[run.offset:run.offset + run.length]


def test_the_daemon_reads_what_is_not_cached_direct_and_maps_what_is(source):
    opened, data = source
    if opened.direct_fd is None or page_cache_holds(opened.fd, 0, PAGE) is None:
        pytest.skip("this filesystem has no direct I/O, or this kernel no cachestat")
    reader = SourceReader((Source.stat(opened.path),), direct_io=False)
    chunk = Chunk(Extent(0, SIZE, "data", source=0, source_offset=12345, tensor="t"), 0, (3 << 20) + 777)
    try:
        assert not reader.maps_chunk(chunk)
        begin, end = chunk.read_span()
        got = reader.read_into(chunk, mmap.mmap(-1, end - begin))
        assert bytes(got) == data[12345:12345 + chunk.length]
        assert cached_pages(opened) == 0  # read direct: nothing came into the page cache
        with open(opened.path, "rb") as f:
            f.read()
        assert reader.maps_chunk(chunk)  # cached: served from a map of the source, one copy
    finally:
        reader.close()


def cached_pages(opened: OpenFile) -> int:
    return sum(opened.cached(page, page + PAGE) for page in range(0, SIZE, PAGE))


def test_uncached_bytes_are_read_direct_and_leave_no_page_cache(source):
    opened, data = source
    if opened.direct_fd is None:
        pytest.skip("this filesystem has no direct I/O")
    buffer = memoryview(mmap.mmap(-1, 2 << 20))
    offset, length = 12345, (1 << 20) + 777
    at = PAGE + offset % PAGE
    assert opened.read_into(buffer, at, offset, length, "source") == length
    assert bytes(buffer[at:at + length]) == data[offset:offset + length]
    assert cached_pages(opened) == 0


def test_cached_bytes_are_copied_from_the_page_cache(source):
    opened, data = source
    os.pread(opened.fd, 64 << 10, 4 * PAGE)  # these pages are now cached
    assert opened.cached(4 * PAGE, 4 * PAGE + (64 << 10))
    buffer = memoryview(mmap.mmap(-1, 1 << 20))
    assert opened.read_into(buffer, 7, 4 * PAGE + 7, 5000, "source") == 5000
    assert bytes(buffer[7:5007]) == data[4 * PAGE + 7:4 * PAGE + 5007]


def test_a_read_told_its_bytes_are_cached_reads_through_the_page_cache_without_asking(source):
    """A group's reads whose sources were found cached at once (the hook's warm sliced experts)
    skip a cachestat each: a page evicted since is read back through the page cache."""
    opened, data = source
    buffer = memoryview(mmap.mmap(-1, 1 << 20))
    assert opened.read_into(buffer, 0, 3 * PAGE, 2 * PAGE, "source", cached=True) == 2 * PAGE
    assert bytes(buffer[:2 * PAGE]) == data[3 * PAGE:5 * PAGE] and opened.cached(3 * PAGE, 5 * PAGE)


def test_without_direct_reads_only_what_was_added_to_the_cache_is_dropped(source):
    opened, data = source
    buffered = OpenFile(opened.path, direct=False)
    os.pread(opened.fd, PAGE, 100 * PAGE)  # cached before: not ours to drop
    buffer = memoryview(mmap.mmap(-1, 1 << 20))
    assert buffered.read_into(buffer, 0, 0, 3 * PAGE, "source") == 3 * PAGE
    assert bytes(buffer[:3 * PAGE]) == data[:3 * PAGE] and cached_pages(opened) == 4
    buffered.drop_added()
    assert cached_pages(opened) == 1 and opened.cached(100 * PAGE, 101 * PAGE)
    buffered.close()


def test_a_read_past_the_end_of_the_file_is_short(source):
    opened, _ = source
    buffer = memoryview(mmap.mmap(-1, 1 << 20))
    offset = SIZE - 1000
    assert opened.read_into(buffer, offset % PAGE, offset, 5000, "source") == 1000


def test_both_ways_of_asking_the_page_cache_agree_on_a_partly_cached_file(source, monkeypatch):
    """cachestat (Linux 6.5) and, on older kernels, mincore: every page of a range cached, or not."""
    opened, _ = source
    os.pread(opened.fd, 3 * PAGE, 10 * PAGE)  # pages 10-12 (readahead is off for exact reads)
    os.pread(opened.fd, 1, 20 * PAGE + 5)  # page 20
    ranges = [(10 * PAGE, 13 * PAGE), (10 * PAGE + 1, 13 * PAGE - 1), (9 * PAGE, 13 * PAGE), (10 * PAGE, 14 * PAGE),
              (20 * PAGE, 20 * PAGE + 1), (12 * PAGE, 21 * PAGE), (SIZE - PAGE, SIZE + PAGE), (5 * PAGE, 5 * PAGE)]
    expected = [True, True, False, False, True, False, False, False]
    assert [opened.resident(b, e) for b, e in ranges] == expected
    monkeypatch.setattr(disk, "_cachestat_works", False)
    assert [opened.resident(b, e) for b, e in ranges] == expected


def test_cached_bytes_are_mapped_as_they_lie_and_a_file_cut_short_is_refused_not_faulted(tmp_path):
    """What the hook copies slices of rows out of: the page cache's own pages, mapped in first, so
    that pages gone past a shortened file's end are refused here instead of killing the process
    (SIGBUS) at the copy."""
    path = tmp_path / "rows.bin"
    data = np.random.default_rng(3).integers(0, 256, 8 * PAGE + 100, dtype=np.uint8).tobytes()
    path.write_bytes(data)  # just written: cached
    opened = OpenFile(str(path))
    try:
        assert bytes(opened.mapped(PAGE + 10, 3 * PAGE)) == data[PAGE + 10:4 * PAGE + 10]
        opened.unmap(PAGE + 10, 3 * PAGE)
        os.truncate(path, PAGE)
        assert opened.mapped(PAGE + 10, 3 * PAGE) is None
    finally:
        opened.close()


def test_copies_out_of_the_page_cache_land_each_tensor_as_its_own_read_would(source):
    """A warm sliced group's copies, made out of maps of the cached source: experts' rows (eight-
    and two-byte units) and blocks (eight- and one-byte units) at one step in the source and the
    slab, one expert out of step, land the rank's bytes of each, and nothing between them."""
    opened, data = source
    os.pread(opened.fd, SIZE, 0)  # all of it cached
    step, kinds = 73 * PAGE, [(Rows(64, 1152, 288, 576), 0), (Rows(64, 72, 18, 36), 80_000),
                            (None, 100_000, 10_000), (None, 200_001, 333)]
    copies, at = [], 0
    for expert in range(6):
        base = PAGE + expert * step + (4096 if expert == 4 else 0)
        for rows, offset, *length in kinds:
            nbytes = length[0] if rows is None else rows.count * rows.row_bytes
            at = align_up(at) + (0 if rows else (base + offset) % PAGE)
            copies.append(Copy(opened, base + offset, nbytes, at, rows, None))
            at += copies[-1].landed
    landing = HostLanding(SimpleNamespace(tensor=torch.zeros(align_up(at) + PAGE, dtype=torch.uint8)), pool=None)
    jobs = cached_jobs(copies, landing, Trace())
    for job in jobs:
        job()
    expected = np.zeros(len(landing.buffer), np.uint8)
    source_bytes = np.frombuffer(data, np.uint8)
    for copy in copies:
        whole = source_bytes[copy.offset:copy.offset + copy.length]
        if copy.rows is not None:
            whole = whole.reshape(copy.rows.count, copy.rows.row_bytes)[:, copy.rows.keep_start:copy.rows.keep_stop]
        expected[copy.at:copy.at + copy.landed] = whole.reshape(-1)
    assert len(jobs) == 1 and bytes(landing.buffer) == expected.tobytes()


def test_a_source_cut_short_under_cached_copies_is_read_and_named_not_faulted(source):
    """Pages gone past a shortened source's end are refused when mapped in, not met by the copy
    (SIGBUS): the job reads its copies one by one, and the read that comes short names its tensor."""
    opened, _ = source
    os.pread(opened.fd, SIZE, 0)  # all of it cached
    landing = HostLanding(SimpleNamespace(tensor=torch.zeros(1 << 20, dtype=torch.uint8)), pool=None)
    copies, at = [], 0
    for i in range(3):
        offset = SIZE - 300_000 + i * 100_000
        at = align_up(at) + offset % PAGE
        run = Run(opened, offset, 50_000, at, (f"t{i}",), (offset,))
        copies.append(Copy(opened, offset, 50_000, at, None, functools.partial(read_run, run, landing)))
        at += 50_000
    os.truncate(opened.path, SIZE - 175_000)
    with pytest.raises(OSError, match=r"tensor 't1': short read"):
        for job in cached_jobs(copies, landing, Trace()):
            job()
