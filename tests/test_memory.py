"""Memory is a budget: the daemon's peak RSS stays under the budget plus 256 MiB while serving a
checkpoint several times larger, what it pushes into the page cache reads as what it serves, and
after `rankfs drop` the views hold no page cache."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from conftest import direct_digests, mapped_digests, mounted, rankfs, settled_status
from dev.mounting import ROOT
from dev.memstate import MIB, cached_bytes, resident_pages, uncache, vm_hwm
from rankfs.common.disk import PAGE
from rankfs.common import contract
from rankfs.reader.engine import DEMAND_SLACK

pytestmark = pytest.mark.mount


@pytest.mark.parametrize("flags", [["--tp-size", 2, "--tp-rank", 0, "--ep-size", 2],
                                   ["--tp-size", 4, "--tp-rank", 1],  # experts sliced
                                   ["--tp-size", 1, "--tp-rank", 0]])
def test_daemon_memory_stays_within_budget(large_checkpoint, mount_dir, flags):
    budget = 128 * MIB
    sources = sorted(large_checkpoint.glob("*.safetensors"))
    data = sum(p.stat().st_size for p in sources)
    uncache(sources)  # none of it cached: what is cached afterwards, rankfs left behind
    with mounted(large_checkpoint, mount_dir, *flags, "--inflight-gb", budget / (1 << 30)):
        status = contract.read_status(str(mount_dir))
        served = 0
        for shard in sorted((mount_dir / "target").glob("*.safetensors")):
            with open(shard, "rb") as f:
                while chunk := f.read(16 * MIB):
                    served += len(chunk)
        peak = vm_hwm(status["pid"])
        status = settled_status(mount_dir)
        sources_cached = cached_bytes(sources)
    assert data > 4 * budget and served > 2 * budget
    # nothing cached twice: the sources' pages left the cache once served (headers and pages shared
    # by neighbouring reads may stay until the drop)
    assert sources_cached < 0.02 * served, f"{sources_cached / MIB:.0f} MiB of the sources left in page cache"
    assert status["pushed_bytes"] > 0  # read-ahead went into the kernel's cache from the push threads
    assert status["peak_held_bytes"] <= budget + DEMAND_SLACK  # reads the loader waits on may overdraw
    planned = _planned(status)
    # each byte once, or nearly: a chunk let go early is read again only for what is still wanted, and
    # this reader, by offset, is out of the loaders' order: pushed chunks it had not reached when the
    # daemon let them pass keep their first page (it read 5-23 % more when they did not). Pushed pages
    # the kernel evicts before this reader comes are read again, as they must be: these VMs' DAMON
    # pages out up to 128 MiB/s of memory it finds idle, pages pushed and not yet read among it (one
    # run in a dozen after the rest of the suite: 68 MiB of chunks read again for that, 84 MiB in
    # all, a chunk read on demand taking the room of one read ahead). None evicted: within 2 %.
    evicted = status["evicted_reread_bytes"]
    assert evicted <= status["reread_bytes"]
    assert planned <= status["read_bytes"] - evicted < 1.02 * planned + evicted
    assert peak < budget + 256 * MIB, f"daemon peak RSS {peak / MIB:.0f} MiB"


@pytest.mark.parametrize("push_threads", [8, 1])
def test_pushed_views_read_as_served(large_checkpoint, mount_dir, push_threads):
    """Pushed into the page cache ahead of the reader (source bytes, and the fill outside the
    slices on the pages they share with it), a sliced view maps to the very bytes a mount that
    pushes nothing answers, with one push thread (the offers queue for it) or several."""
    flags = ("--tp-size", 4, "--tp-rank", 1, "--inflight-gb", 128 * MIB / (1 << 30))
    with mounted(large_checkpoint, mount_dir, *flags, "--push-threads", push_threads):
        pushed = mapped_digests(mount_dir / "target")
        status = contract.read_status(str(mount_dir))
    assert status["pushed_bytes"] > 0 and status["pushed_fill_bytes"] > 0
    with mounted(large_checkpoint, mount_dir, *flags, "--no-push"):
        assert mapped_digests(mount_dir / "target") == pushed


def test_a_view_read_with_o_direct_is_read_ahead_into_memory_not_pushed(large_checkpoint, mount_dir):
    """Readers that bypass the page cache (runai-model-streamer, InstantTensor's direct backends)
    hold the files open with O_DIRECT only: what is read ahead for them answers their requests from
    memory, and nothing, source bytes or fill, is pushed into a page cache they never read (on the
    2-core VM, pushes of a sliced view runai read took more of its two cores than the reading)."""
    flags = ("--tp-size", 4, "--tp-rank", 1)  # experts sliced: fill too
    with mounted(large_checkpoint, mount_dir, *flags):
        direct = direct_digests(mount_dir / "target")
        status = contract.read_status(str(mount_dir))
    assert status["prefetch_loads"] > 0 and status["read_bytes"] > 0
    assert status["pushed_bytes"] == status["pushed_fill_bytes"] == status["listing_pages"] == 0
    with mounted(large_checkpoint, mount_dir, *flags, "--no-push"):
        assert mapped_digests(mount_dir / "target") == direct


def test_source_pages_a_reply_was_made_of_leave_the_page_cache_once_it_is_written(large_checkpoint, mount_dir):
    """A reply from a chunk the page cache held is made of the source's mapped pages: they leave
    the daemon's map and the page cache once the reply is written (`ReadEngine.replying`), as they
    would had the daemon read them. O_DIRECT: every byte of the view a request's reply."""
    with _sources_cached(large_checkpoint) as sources:  # the chunks are served from maps
        cached_before = cached_bytes(sources)
        with mounted(large_checkpoint, mount_dir, "--tp-size", 2, "--tp-rank", 0, "--ep-size", 2):
            assert direct_digests(mount_dir / "target")
            status = settled_status(mount_dir)
            dropped = cached_before - cached_bytes(sources)
    assert status["pushed_bytes"] == 0 and status["request_bytes"] > status["read_bytes"] > 0
    # Most of the pages the rank's chunks lie in (78-82 % measured here and at 8 GB; with the
    # replies' backings never let go, 2 %). Other ranks' bytes stay as they were.
    assert dropped > 0.5 * status["read_bytes"], f"{dropped / MIB:.0f} MiB dropped of {status['read_bytes'] / MIB:.0f}"


def test_a_view_of_cached_sources_reads_each_chunk_once(large_checkpoint, mount_dir):
    """Sources in page cache (a warm restart, another rank's reads): the read-ahead pushes a file's
    chunks before the loader opens it, and the listing pushed at that open hands some of their pages
    again. Counted twice, a chunk was taken for handed whole before its last page (at the file's
    end, left to a request) was: freed, it was read again for that page, 11 % of the plan here."""
    with _sources_cached(large_checkpoint), mounted(large_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        assert mapped_digests(mount_dir / "target")
        status = settled_status(mount_dir)
    assert status["pushed_bytes"] > 0
    # Read again only where the kernel evicted pages it was handed (these VMs' DAMON): chunks, or
    # the remnant pages of one the loader had passed.
    assert status["reread_bytes"] == status["evicted_reread_bytes"]
    assert status["read_bytes"] - status["evicted_reread_bytes"] - status["remnant_bytes"] == _planned(status)


def test_every_chunk_read_again_while_the_kernel_evicts_the_view_is_counted_as_evicted(large_checkpoint, mount_dir):
    """The kernel evicts what it was handed, pushed, listed or read, as the loader goes (here a
    thread drops the view's page cache every 10 ms; these VMs' DAMON does it unasked): each chunk
    read again for that is counted as evicted, the daemon's own rereads stay at none. Counted only
    where a push had stored the pages, a 64 KiB chunk a listing and a reply had handed whole, its
    pages evicted on a CI run, was read again as the daemon's own (208 of 435-536 MB counted here)."""
    stop = threading.Event()

    def evict(views):
        while not stop.wait(0.01):
            for view in views:
                fd = os.open(view, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)

    with _sources_cached(large_checkpoint), mounted(large_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        evictor = threading.Thread(target=evict, args=(sorted((mount_dir / "target").glob("*.safetensors")),))
        evictor.start()
        try:
            assert mapped_digests(mount_dir / "target")
        finally:
            stop.set()
            evictor.join()
        status = settled_status(mount_dir)
    assert status["evicted_reread_bytes"] > 0
    assert status["reread_bytes"] == status["evicted_reread_bytes"]
    assert status["read_bytes"] - status["evicted_reread_bytes"] - status["remnant_bytes"] == _planned(status)


def test_pushed_pages_the_kernel_evicted_are_read_again_and_counted_apart(large_checkpoint, mount_dir):
    """A pushed chunk whose pages the kernel evicted before the reader came is read again when asked
    for, the same bytes, and counted apart from the daemon's own rereads: memory pressure (or these
    VMs' DAMON pageout) took them, not the daemon. Here the view's pages are evicted by hand."""
    # --keep-cache: the pages the first read leaves are the kernel's to evict, not the daemon's to drop.
    flags = ("--tp-size", 2, "--tp-rank", 0, "--ep-size", 2, "--inflight-gb", 128 * MIB / (1 << 30), "--keep-cache")
    with mounted(large_checkpoint, mount_dir, *flags):
        first = mapped_digests(mount_dir / "target")
        before = settled_status(mount_dir)
        uncache((mount_dir / "target").glob("*.safetensors"))
        assert mapped_digests(mount_dir / "target") == first
        after = settled_status(mount_dir)
    assert before["pushed_bytes"] > 0
    evicted = after["evicted_reread_bytes"] - before["evicted_reread_bytes"]
    assert 0 < evicted <= after["reread_bytes"] - before["reread_bytes"]


@pytest.mark.parametrize("read", [direct_digests, mapped_digests])
def test_a_view_read_again_reads_each_chunk_once_more(large_checkpoint, mount_dir, read):
    """A second reader of a view (a peer after the engine; an engine restarted on the same mount,
    the view's pages evicted meanwhile) gets the same bytes, each chunk read once more: not once
    for each of its requests, as when a chunk's hand-outs counted from the first reader's (2.8x and
    3.4x the view's bytes here)."""
    before, after = _read_twice(large_checkpoint, mount_dir, read)
    assert _planned(before) <= before["read_bytes"] - before["evicted_reread_bytes"] < 1.02 * _planned(before)
    assert after["read_bytes"] - before["read_bytes"] < 1.1 * _planned(after)
    assert after["prefetch_loads"] == before["prefetch_loads"]  # the same process: the same reader, read on demand


def test_a_new_reader_process_is_read_ahead_again(large_checkpoint, mount_dir):
    """An engine restarted on the mount (its view's pages evicted meanwhile) is a process that opens
    the view after the one that read it has exited: the view is read ahead and pushed for it again,
    each chunk read once more."""
    before, after = _read_twice(large_checkpoint, mount_dir, _mapped_digests_in_a_process)
    assert after["prefetch_loads"] - before["prefetch_loads"] > 0.9 * before["prefetch_loads"]
    assert after["pushed_bytes"] - before["pushed_bytes"] > 0
    assert after["read_bytes"] - before["read_bytes"] < 1.1 * _planned(after)


def _read_twice(checkpoint, mount_dir, read) -> tuple[dict, dict]:
    """A sliced rank's view read by `read`, then again once its pages are evicted (the same bytes):
    the daemon's status after each."""
    with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        first = read(mount_dir / "target")
        before = settled_status(mount_dir)
        uncache((mount_dir / "target").glob("*.safetensors"))
        assert read(mount_dir / "target") == first
        after = settled_status(mount_dir)
    return before, after


@pytest.mark.parametrize("keep", [False, True])
def test_a_loaders_pages_leave_the_page_cache_once_it_is_done_with_them(large_checkpoint, mount_dir, keep):
    """A loader's copies are its own memory: a file's pages leave the page cache once the loader
    that read it closed it (kept, they would shrink the memory the engine's KV pool is sized from),
    unless the mount keeps them (`--keep-cache`). Read again, the same bytes."""
    flags = ("--tp-size", 4, "--tp-rank", 1, *(["--keep-cache"] if keep else []))
    with mounted(large_checkpoint, mount_dir, *flags):
        files = sorted((mount_dir / "target").glob("*.safetensors"))
        first = mapped_digests(mount_dir / "target")
        size = sum(p.stat().st_size for p in files)
        deadline = time.monotonic() + 30  # the kernel sends a file's release after its close returns
        while (cached := sum(resident_pages(p) for p in files) * PAGE) > 0.02 * size and not keep \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        status = settled_status(mount_dir)
        if keep:
            assert cached > 0.5 * size and status["dropped_bytes"] == 0
        else:  # the headers' pages stay
            assert cached <= 0.02 * size and status["dropped_bytes"] >= 0.9 * _planned(status)
        assert mapped_digests(mount_dir / "target") == first


def test_drop_leaves_no_page_cache(tiny_checkpoint, mount_dir):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        files = sorted((mount_dir / "target").glob("*.safetensors"))
        for path in files:
            path.read_bytes()
        assert sum(resident_pages(p) for p in files) > 0
        result = rankfs("drop", mount_dir)
        assert "dropped" in result.stdout
        assert sum(resident_pages(p) for p in files) == 0


@contextlib.contextmanager
def _sources_cached(checkpoint):
    """The checkpoint's sources in the page cache for the block (written back first: a dirty page
    would stay cached), and out of it after, as the other tests of this checkpoint expect."""
    sources = sorted(checkpoint.glob("*.safetensors"))
    uncache(sources)
    try:
        for source in sources:
            source.read_bytes()
        yield sources
    finally:
        uncache(sources)


def _planned(status: dict) -> int:
    """The source bytes of the views read (their plans)."""
    return sum(v["planned_bytes"] for v in status["views"] if v["active"])


def _mapped_digests_in_a_process(directory) -> dict[str, str]:
    """`mapped_digests` read by a process of its own, which has exited when this returns."""
    code = "import json, pathlib, sys; sys.path[:0] = ['tests', '.']; from conftest import mapped_digests; " \
           "print(json.dumps(mapped_digests(pathlib.Path(sys.argv[1]))))"
    run = subprocess.run([sys.executable, "-c", code, str(directory)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(run.stdout)
