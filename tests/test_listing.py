"""A safetensors listing of a view's file (its header, then the first byte of each tensor, before
any copy) finds those pages in the page cache: they are pushed as the file is first opened, where
the sources' page cache holds them. A cold source keeps the requests, whose readahead reads it in
large pieces."""

from __future__ import annotations

import os

import pytest
from safetensors import safe_open

from conftest import mounted
from dev.bench import trace as dev_trace
from rankfs import contract

pytestmark = pytest.mark.mount


def cache_sources(checkpoint, cached: bool):
    for path in checkpoint.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if cached:
                while os.read(fd, 16 << 20):
                    pass
            else:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def list_view(checkpoint, mount_dir, trace) -> tuple[int, dict]:
    """List every shard of a sliced rank's view as safetensors does; the requests that reached the
    daemon for them, and its status."""
    with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1, "--trace", trace):
        for path in sorted((mount_dir / "target").glob("*.safetensors")):
            with safe_open(path, framework="pt") as f:  # no tensor kept: it would keep the mount busy
                assert all(f.get_tensor(name).numel() for name in f.keys())
        status = contract.read_status(str(mount_dir))
    events = dev_trace.read_events(trace)  # complete once unmounted
    return sum(e["event"] == "request" and e["path"].endswith(".safetensors") for e in events), status


def test_a_listing_asks_the_daemon_for_nothing_where_the_sources_are_cached(large_checkpoint, mount_dir, tmp_path):
    cache_sources(large_checkpoint, True)
    requests, status = list_view(large_checkpoint, mount_dir, tmp_path / "trace.jsonl")
    assert requests == 0 and status["listing_pages"] > 0


def test_a_listing_of_cold_sources_is_left_to_requests(large_checkpoint, mount_dir, tmp_path):
    cache_sources(large_checkpoint, True)
    _, warm = list_view(large_checkpoint, mount_dir, tmp_path / "warm.jsonl")
    cache_sources(large_checkpoint, False)
    requests, cold = list_view(large_checkpoint, mount_dir, tmp_path / "cold.jsonl")
    assert requests > 0 and 0 < cold["listing_pages"] < warm["listing_pages"]  # the header's and fill's pages
