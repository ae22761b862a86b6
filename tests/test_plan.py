"""Planning on its own (no FUSE), and the plan command at the production checkpoint's full scale."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from conftest import mounted, rankfs
from dev.fixtures import deepseek_v4
from rankfs.common import contract
from rankfs.loader.daemon_link import DaemonLink
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank, plan_ranks
from rankfs.plan.spec import RankSpec
from rankfs.plan.safetensors import DTYPE_SIZES, parse_header


@pytest.fixture(scope="module")
def full_scale(tmp_path_factory):
    return deepseek_v4.write(tmp_path_factory.mktemp("full") / "dsv4", deepseek_v4.FixtureSpec.full_scale(),
                             header_only=True)


def test_virtual_files_are_valid_safetensors_layouts(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    for spec in (RankSpec(4, 1, 1), RankSpec(4, 3, 2), RankSpec(8, 5, 8, tp_slice="on")):
        for view in plan_rank(checkpoint, spec).views:
            for vfile in view.files:
                header = vfile.header
                assert len(header) % 8 == 0
                parsed = parse_header(vfile.name, header[8:], vfile.size)  # no holes, exact size
                for entry in parsed.tensors.values():
                    assert (parsed.data_start + entry.begin) % DTYPE_SIZES[entry.dtype] == 0
                assert sorted(parsed.tensors) == sorted(vfile.tensor_names)


def test_runs_know_when_the_loaders_need_each_tensor(tiny_checkpoint):
    """Runs merge tensors adjacent in the file, which the loaders read far apart (they go by sorted
    name, the file by dtype first): a run's every tensor keeps its own consumption position, which
    orders prefetch."""
    checkpoint = Checkpoint.open(tiny_checkpoint)
    for view in plan_rank(checkpoint, RankSpec(4, 1, 1)).views:
        for vfile in view.files:
            position = {name: vfile.first_order + i for i, name in enumerate(sorted(vfile.tensor_names))}
            runs = [e for e in vfile.extents() if e.kind == "data"]
            assert any(len(e.marks) > 1 for e in runs)
            for t in vfile.tensors:
                rows = t.slice.rows(t.dtype, t.shape) if t.slice else None
                start = t.offset + (rows.keep_start if rows and rows.is_block else 0)
                run = next(e for e in runs if e.offset <= start < e.end)
                assert run.order_of(start, start + 1) == position[t.name]


def test_layouts_are_data_that_compare(tiny_checkpoint):
    checkpoint = Checkpoint.open(tiny_checkpoint)
    a, b = plan_rank(checkpoint, RankSpec(4, 1, 2)), plan_rank(Checkpoint.open(tiny_checkpoint), RankSpec(4, 1, 2))
    assert a == b
    assert a != plan_rank(checkpoint, RankSpec(4, 2, 2))
    assert plan_ranks(checkpoint, [RankSpec(4, r, 2) for r in range(4)])[1] == a


def test_plan_prints_the_per_rank_table_at_full_scale(full_scale):
    result = rankfs("plan", full_scale, "--tp-size", 4, "--ep-size", 1)
    lines = result.stdout.splitlines()
    assert "profile deepseek-v4" in lines[0] and "experts sliced" in lines[0]
    assert sum(1 for line in lines if " target " in line) == 4 and sum(1 for line in lines if " draft " in line) == 4
    rows = json.loads(rankfs("plan", full_scale, "--tp-size", 4, "--ep-size", 2, "--json").stdout)
    assert len(rows) == 8
    assert {"rank", "view", "files", "tensors", "read_bytes", "kept_bytes", "largest_file_bytes"} <= set(rows[0])
    target = [r for r in rows if r["view"] == "target"]
    assert all(r["files"] == 45 for r in target) and all(140e9 < r["read_bytes"] < 170e9 for r in target)


def test_sources_map_decodes_each_view_file_on_its_own():
    sources = [contract.Source("/ckpt/a.safetensors", 10, 1, 7), contract.Source("/ckpt/b.safetensors", 20, 2, 8)]
    files = {"x.safetensors": {"t1": (0, 8), "t2": (1, 16)}, "y.safetensors": {"t3": (1, 24)}, "z.safetensors": {}}
    sources_map = contract.SourcesMap(contract.encode_sources(sources, files))
    assert sources_map.sources == sources
    assert {f: {t: tuple(place) for t, place in sources_map.places(f).items()} for f in files} == files
    with pytest.raises(KeyError):
        sources_map.places("w.safetensors")


def test_a_sources_map_of_another_version_sends_the_hook_through_the_mount(tmp_path, caplog):
    old = json.dumps({"sources": [], "files": {"x.safetensors": {"t1": [0, 8]}}}).encode() + b"\n"  # format 1
    with pytest.raises(contract.SourcesMapError, match="format 1, not 2"):
        contract.SourcesMap(old)
    map_file = tmp_path / "target.json"
    map_file.write_bytes(old)
    link = DaemonLink()
    assert link._sources_map(str(map_file)) is None
    map_file.unlink()  # read once per load: asked again, it is not read again
    assert link._sources_map(str(map_file)) is None
    assert [r.levelname for r in caplog.records if "another rankfs version" in r.message] == ["WARNING"]


@pytest.mark.mount
def test_full_scale_checkpoint_mounts(full_scale, mount_dir):
    with mounted(full_scale, mount_dir, "--tp-size", 4, "--tp-rank", 0):
        shards = sorted((mount_dir / "target").glob("*.safetensors"))
        assert len(shards) == 45 and len(list((mount_dir / "draft").glob("*.safetensors"))) == 3
        with open(shards[0], "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        assert any(".experts." in name for name in header)
        index = json.loads((mount_dir / "target" / "model.safetensors.index.json").read_text())
        assert sorted(set(index["weight_map"].values())) == [p.name for p in shards]

        # The hook's placement of one view file: every tensor of it, with only the source shards
        # they lie in opened (the map holds all 45 files' tensors).
        link = DaemonLink()
        try:
            placement = link.placement(str(shards[0]))
            assert set(placement) == set(header) - {"__metadata__"}
            lie_in = {source.path for source, _ in placement.values()}
            assert _open_files_under(full_scale) == lie_in and len(lie_in) < len(shards)
            assert all(0 < offset < os.path.getsize(source.path) for source, offset in placement.values())
        finally:
            link.close(set(), {})
        assert not _open_files_under(full_scale)


def _open_files_under(directory) -> set[str]:
    """The files under `directory` this process has open."""
    fds = Path("/proc/self/fd")
    paths = set()
    for fd in fds.iterdir():
        try:
            paths.add(os.readlink(fd))
        except OSError:  # closed meanwhile (the listing's own)
            pass
    return {p for p in paths if p.startswith(str(directory) + os.sep)}
