"""TP-sliced experts and the draft view: an engine-style MoE loader lands the same bytes from the
view as from the original checkpoint, the daemon reads what the plan says, and a loader that
narrows elsewhere fails loudly through the hook."""

from __future__ import annotations

import collections
import gc
import os
import threading

import pytest
import safetensors
import torch

import rankfs.loader as loader
from rankfs.loader import routing
from conftest import mounted
from dev.bench import trace_summary
from dev.host_staging import host_staging
from rankfs.loader import staging
from dev.bench.engine_like import MoELayout, expert_counts, load, shard_files
from dev.fixtures import deepseek_v4
from dev.memstate import MIB, cached_bytes, rss_bytes, uncache
from rankfs.common import contract
from rankfs.loader.guard import SliceMismatch
from rankfs.loader.landing import DeviceLanding
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank
from rankfs.plan.profiles import BY_NAME
from rankfs.plan.safetensors import read_header
from rankfs.plan.spec import RankSpec
from rankfs.common.disk import PAGE

PROFILE = BY_NAME["deepseek-v4"]
SPEC = deepseek_v4.FixtureSpec.tiny()


def load_like_engine(directory, layout: MoELayout, checkpoint, counts=None):
    # The engine knows every group's expert count from its config, whatever the directory holds.
    return load(directory, PROFILE, layout, counts=counts or expert_counts(shard_files(checkpoint), PROFILE))


def engine_layout(tp_size, ep_size, rank, **extra) -> MoELayout:
    moe_tp = tp_size // ep_size
    return MoELayout(moe_tp, rank % moe_tp, ep_size, rank // moe_tp, n_experts=SPEC.experts, **extra)


def assert_same(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name].reshape(-1).view(torch.uint8), want[name].reshape(-1).view(torch.uint8)), name


@pytest.mark.mount
@pytest.mark.parametrize("ep_size", [1, 2, 4])
@pytest.mark.parametrize("tp_slice", ["auto", "on", "off"])
def test_moe_loader_lands_the_same_bytes(tiny_checkpoint, mount_dir, ep_size, tp_slice):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", ep_size, "--tp-slice", tp_slice,
                 "--local-ranks", "all"):
        for rank in range(4):
            layout = engine_layout(4, ep_size, rank)
            for view in ("target", "draft"):
                from_view = load_like_engine(mount_dir / f"rank-{rank}" / view, layout, tiny_checkpoint)
                original = {n: t for n, t in load_like_engine(tiny_checkpoint, layout, tiny_checkpoint).items()
                            if n.startswith("mtp.") == (view == "draft")}
                assert_same(from_view, original)


@pytest.mark.mount
def test_daemon_reads_what_the_plan_says(tiny_checkpoint, mount_dir):
    plan = plan_rank(Checkpoint.open(tiny_checkpoint), RankSpec(4, 2, 1))
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 2, "--inflight-gb", 1):
        for view in ("target", "draft"):
            load_like_engine(mount_dir / view, engine_layout(4, 1, 2), tiny_checkpoint)
        status = contract.read_status(str(mount_dir))
    planned = sum(row["read_bytes"] for row in plan.summary())
    # What the kernel asked for again after the daemon let it go is read again, and counted.
    assert status["read_bytes"] - status["reread_bytes"] - status["remnant_bytes"] == planned
    # Sliced: w1/w3 read a quarter, w2 whole rows; so EP1 reads what EP2 reads, and keeps half of it.
    assert planned < sum(p.stat().st_size for p in tiny_checkpoint.glob("*.safetensors"))


def test_seed_table_shape_at_full_scale(tmp_path_factory):
    checkpoint = Checkpoint.open(deepseek_v4.write(tmp_path_factory.mktemp("full") / "dsv4",
                                                   deepseek_v4.FixtureSpec.full_scale(), header_only=True))

    def target(ep, tp_slice):
        return plan_rank(checkpoint, RankSpec(4, 0, ep, tp_slice)).view("target").summary()
    ep1_sliced, ep2, ep2_on, ep1_whole = target(1, "auto"), target(2, "auto"), target(2, "on"), target(1, "off")
    assert ep1_sliced["read_bytes"] == ep2["read_bytes"]
    assert 0.45 < ep1_sliced["kept_bytes"] / ep2["kept_bytes"] < 0.6
    assert ep1_whole["read_bytes"] > 1.8 * ep2["read_bytes"]
    assert ep2_on["read_bytes"] < ep2["read_bytes"] and ep2_on["kept_bytes"] == ep1_sliced["kept_bytes"]


@pytest.fixture(params=["map", "stage"])
def hook(request, monkeypatch):
    """The hook both ways: tensors viewing the sources' maps (no CUDA) and staged in slabs."""
    monkeypatch.setenv("RANKFS_HOOK_MAP", "on" if request.param == "map" else "off")
    loader.activate("on")
    yield request.param
    loader.deactivate()


@pytest.mark.mount
def test_hook_guard_names_the_tensor_a_misnarrowing_loader_touches(tiny_checkpoint, mount_dir, hook):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        good = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint)
        assert_same(good, {n: t for n, t in load_like_engine(tiny_checkpoint, engine_layout(4, 1, 1),
                                                              tiny_checkpoint).items() if not n.startswith("mtp.")})
        with pytest.raises(SliceMismatch, match=r"tensor 'layers\.\d+\.ffn\.experts\.\d+\.w[123]\.(weight|scale)'"):
            load_like_engine(mount_dir / "target", engine_layout(4, 1, 1, narrow_offset_shift=1), tiny_checkpoint)
        del good
        figures = loader.release("target")
    assert figures["slabs_alive"] == 0


@pytest.mark.mount
def test_one_shared_view_serves_every_local_rank_through_the_hook(tiny_checkpoint, mount_dir, hook, monkeypatch):
    """Every rank is started with MOUNTPOINT/target; the hook sends each to its own rank-R view.
    Read without the hook, the shared view's shards refuse (EIO) rather than give another rank's bytes."""
    import errno
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 2, "--local-ranks", "all"):
        shared = mount_dir / "target"
        with pytest.raises(OSError) as info:
            next(shared.glob("*.safetensors")).read_bytes()
        assert info.value.errno == errno.EIO
        for rank in (0, 3):
            monkeypatch.setenv("RANKFS_RANK", str(rank))
            layout = engine_layout(4, 2, rank)
            got = load_like_engine(shared, layout, tiny_checkpoint)
            want = {n: t for n, t in load_like_engine(tiny_checkpoint, layout, tiny_checkpoint).items()
                    if not n.startswith("mtp.")}
            assert_same(got, want)
            del got
        loader.release("target")


@pytest.mark.mount
def test_the_next_load_sees_a_mount_remade_with_another_layout(tiny_checkpoint, mount_dir, hook, monkeypatch):
    """The hook asks a mount where its root lies and whether it serves rank-R views once per load,
    not once per file; a load after a remount at the same place, with one view instead of one per
    local rank, reads the new mount."""
    monkeypatch.setenv("RANKFS_RANK", "1")
    layout = engine_layout(4, 2, 1)
    want = {n: t for n, t in load_like_engine(tiny_checkpoint, layout, tiny_checkpoint).items()
            if not n.startswith("mtp.")}
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 2, "--local-ranks", "all"):
        assert_same(load_like_engine(mount_dir / "target", layout, tiny_checkpoint), want)
        loader.release("target")
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 2, "--tp-rank", 1):
        assert_same(load_like_engine(mount_dir / "target", layout, tiny_checkpoint), want)
        loader.release("target")


@pytest.mark.mount
def test_release_gives_back_everything_but_the_weights(tiny_checkpoint, mount_dir, hook):
    """After release this process holds only the weights it kept (its resident memory grew by them
    and 64 MiB at most), the garbage collector paused during the load runs again, nothing of the view files or the sources is left in page cache, the daemon
    has dropped its buffers, and its status counts what the hook loaded straight from the sources."""
    sources = sorted(tiny_checkpoint.glob("*.safetensors"))
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1, "--inflight-gb", 0.0625):
        views = sorted((mount_dir / "target").glob("*.safetensors"))
        counts = expert_counts(sources, PROFILE)  # reads the sources' headers: before they leave the cache
        uncache(sources)
        baseline = rss_bytes()
        params = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint, counts)
        kept = sum(p.numel() * p.element_size() for p in params.values())
        assert not gc.isenabled()  # no full collection stops the loader's threads during a load
        figures = loader.release("target")
        assert gc.isenabled()
        grown = rss_bytes() - baseline
        status = contract.read_status(str(mount_dir))
        assert status["drops"] == 1 and status["held_bytes"] == 0 and status["memory"]["idle"] == 0
        assert cached_bytes(views) == 0 and cached_bytes(sources) == 0
        target = next(v for v in status["views"] if v["view"] == "target")
        assert target["hook_loaded_bytes"] == target["planned_bytes"] > 0
        assert status["read_bytes"] == 0  # every byte came from the sources, none through the mount
        assert figures["phase"] == "target" and figures["slabs_alive"] == 0 and figures["pinned_bytes"] == 0
        assert (figures["slabs"] >= 1) == (hook == "stage")
        assert grown < kept + 64 * MIB, f"grew by {grown / MIB:.0f} MiB with {kept / MIB:.0f} MiB of weights kept"
        del params


@pytest.mark.mount
def test_release_of_a_warm_load_drops_only_the_pages_it_mapped(tiny_checkpoint, mount_dir, hook):
    """Sources the page cache held before the load: the release drops the pages of the rank's
    tensors that it viewed through maps (all of them mapped, only the row stores staged), and
    leaves the other ranks' pages cached."""
    sources = sorted(tiny_checkpoint.glob("*.safetensors"))
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        counts = expert_counts(sources, PROFILE)
        os.sync()  # pages written and not yet on the disk stay in the page cache whatever drops them
        for source in sources:
            source.read_bytes()
        before = cached_bytes(sources)
        params = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint, counts)
        loader.release("target")
        dropped = before - cached_bytes(sources)
        target = next(v for v in contract.read_status(str(mount_dir))["views"] if v["view"] == "target")
        tensors = sum(len(read_header(view).tensors) for view in (mount_dir / "target").glob("*.safetensors"))
        del params
    assert before >= sum(source.stat().st_size for source in sources) - len(sources) * PAGE
    # a tensor's first and last page may hold its neighbours' bytes too
    assert 0 < dropped <= target["planned_bytes"] + 2 * PAGE * tensors < before
    if hook == "map":
        assert dropped >= target["planned_bytes"]


@pytest.mark.mount
def test_tensors_left_in_cycles_during_a_load_die_at_its_release_without_a_full_collection(tiny_checkpoint,
                                                                                          mount_dir, hook):
    """The collector is paused during a load, so what the loader dropped in reference cycles is
    young at the release: a young collection frees it, and no full one walks the engine's heap."""
    generations = []

    def note(phase, info):
        if phase == "start":
            generations.append(info["generation"])
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint)
        with safetensors.safe_open(sorted((mount_dir / "target").glob("*.safetensors"))[0], framework="pt") as f:
            cycle = [f.get_tensor(name) for name in f.keys()]
        cycle.append(cycle)
        del cycle
        gc.callbacks.append(note)
        try:
            figures = loader.release("target")
        finally:
            gc.callbacks.remove(note)
        assert figures["slabs_alive"] == 0 and loader.current().budget.used == 0
        assert 0 in generations and 2 not in generations


@pytest.mark.mount
def test_an_open_outside_an_engines_load_leaves_the_collector_running(tiny_checkpoint, mount_dir, hook, monkeypatch):
    """Where an engine's entry points delimit the loads, a rankfs file opened outside them (a look at a
    header) pauses nothing that only a release would undo; inside one the collector is paused until
    the load returns."""
    monkeypatch.setattr(routing, "_engine_delimited", True)
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        with safetensors.safe_open(sorted((mount_dir / "target").glob("*.safetensors"))[0], framework="pt") as f:
            assert f.keys()
        assert gc.isenabled()
        routing.begin_load()
        try:
            load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint)
            assert not gc.isenabled()
        finally:
            routing.end_load(failed=False)
        assert gc.isenabled() and not routing.current().load_views


@pytest.mark.mount
def test_mapped_tensors_count_against_the_hook_budget_until_the_loader_lets_go(tiny_checkpoint, mount_dir,
                                                                              monkeypatch):
    """Tensors viewing the sources count against the hook's budget from their read-ahead until the
    loader drops them. With a budget of two 1 MiB slabs the load completes bitwise, the count never
    passes the budget (or one group, alone), and it is back to zero once the loader is done."""
    monkeypatch.setenv("RANKFS_HOOK_MAP", "on")
    monkeypatch.setenv("RANKFS_HOOK_SLAB_MB", "1")
    monkeypatch.setenv("RANKFS_HOOK_INFLIGHT_GB", str(2 / 1024))
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            layout = engine_layout(4, 1, 1)
            got = load_like_engine(mount_dir / "target", layout, tiny_checkpoint)
            gc.collect()
            budget = loader.current().budget
            largest = max(t.nbytes for s in Checkpoint.open(tiny_checkpoint).shards for t in s.tensors.values())
            assert 0 < budget.peak <= max(budget.limit, 1 << 20, largest)
            assert budget.used == 0
            assert_same(got, {n: t for n, t in load_like_engine(tiny_checkpoint, layout, tiny_checkpoint).items()
                              if not n.startswith("mtp.")})
            del got
            loader.release("target")
    finally:
        loader.deactivate()


@pytest.mark.mount
@pytest.mark.parametrize("sources", ["cached", "uncached"])
@pytest.mark.parametrize("budget_mib", [2, 64])
def test_staged_slabs_stay_within_the_budget_or_one_file_larger_than_it(tiny_checkpoint, mount_dir, monkeypatch,
                                                                       budget_mib, sources):
    """Reads ahead into slabs are admitted in the loaders' order within the budget; only the file the
    loader consumes goes beyond, once what files before it hold is one slab (the loader holds a
    whole file before it copies any). With a budget smaller than the files the load completes,
    bitwise; with one larger than every file the slabs pass it by one slab at most. Sources the page
    cache holds are staged as windows of it, the others read into host buffers."""
    monkeypatch.setenv("RANKFS_HOOK_MAP", "off")
    monkeypatch.setenv("RANKFS_HOOK_SLAB_MB", "1")
    monkeypatch.setenv("RANKFS_HOOK_INFLIGHT_GB", str(budget_mib / 1024))
    want = {n: t.clone() for n, t in load_like_engine(tiny_checkpoint, engine_layout(4, 1, 1), tiny_checkpoint).items()
            if not n.startswith("mtp.")}
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            counts = expert_counts(shard_files(tiny_checkpoint), PROFILE)  # it reads the sources' headers
            if sources == "uncached":
                uncache(shard_files(tiny_checkpoint))
            got = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint, counts)
            hook = loader.current()
            largest_file, limit = max(hook.slabs.stats.file_bytes.values()), hook.budget.limit
            assert (largest_file > limit) == (budget_mib == 2)
            # Beyond the budget: the file consumed now, and one slab (a tensor larger than a slab has
            # a buffer of its own, two pages more); reads ahead admitted before it was opened (the
            # loader opens several at once) may still hold the budget.
            largest_tensor = max(entry.nbytes for path in shard_files(mount_dir / "target")
                                 for entry in read_header(path).tensors.values())
            one_slab = max(1 << 20, largest_tensor + 2 * PAGE)
            assert 0 < hook.budget.peak <= limit + (largest_file if largest_file > limit else 0) + one_slab
            assert_same(got, want)
            del got
            figures = loader.release("target")
            assert figures["slabs_alive"] == 0 and hook.budget.used == 0
    finally:
        loader.deactivate()


def keep_every_tensor(files: list) -> dict:
    """A state dict of the whole view, as a loop of `load_file` builds one."""
    kept = {}
    for path in files:
        with safetensors.safe_open(path, framework="pt") as f:
            kept.update((name, f.get_tensor(name)) for name in f.keys())
    return kept


def last_file_first(files: list) -> dict:
    """Every file opened, then their tensors taken last file first, each copied and let go."""
    handles = [safetensors.safe_open(path, framework="pt") for path in files]
    return {name: f.get_tensor(name).clone() for f in reversed(handles) for name in f.keys()}


@pytest.mark.mount
@pytest.mark.parametrize("take", [keep_every_tensor, last_file_first], ids=["keeps-all", "out-of-order"])
def test_a_loader_that_waits_on_slabs_only_it_could_free_is_served_past_the_budget(tiny_checkpoint, mount_dir,
                                                                                   monkeypatch, caplog, take):
    """An engine's loader takes files in order and lets each tensor go once copied. One that keeps
    what it was handed, or reads files out of order (the budget then holds groups read ahead of
    files it has not reached), would wait for good: once it has waited with no slab freed and no
    group staged, each group it asks for is read past the budget, said once, and the load
    completes bitwise."""
    monkeypatch.setenv("RANKFS_HOOK_MAP", "off")
    monkeypatch.setenv("RANKFS_HOOK_SLAB_MB", "1")
    monkeypatch.setenv("RANKFS_HOOK_INFLIGHT_GB", str(2 / 1024))
    sources = {}
    for path in shard_files(tiny_checkpoint):
        with safetensors.safe_open(path, framework="pt") as f:
            sources.update((name, f.get_tensor(name).clone()) for name in f.keys())
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--ep-size", 2):
            files = shard_files(mount_dir / "target")
            names = {name for path in files for name in read_header(path).tensors}
            got = {}
            loading = threading.Thread(target=lambda: got.update(take(files)), daemon=True)
            loading.start()
            loading.join(120)  # a guard, not a measure: without the rule the loader waits forever
            assert not loading.is_alive(), "the loader still waits for a group held back by the budget"
            hook = loader.current()
            assert hook.order.stalled and hook.budget.peak > hook.budget.limit
            assert_same(got, {name: sources[name] for name in names})
            said = [r.getMessage() for r in caplog.records if "nothing frees room" in r.getMessage()]
            assert len(said) == 1 and "RANKFS_HOOK_INFLIGHT_GB" in said[0]
            del got
            figures = loader.release("target")
            assert figures["slabs_alive"] == 0 and hook.budget.used == 0 and not hook.order.stalled
    finally:
        loader.deactivate()


@pytest.mark.mount
def test_the_hook_traces_each_file_it_opens_and_each_group_it_stages(tiny_checkpoint, mount_dir, monkeypatch,
                                                                    tmp_path):
    """RANKFS_HOOK_TRACE: an event per file opened, per group staged (asked, began, ended, by a read
    thread), per job of its reads (with its thread's CPU time) and per wait of the loader for a
    group; the benchmark's summary lists every file."""
    monkeypatch.setenv("RANKFS_HOOK_MAP", "off")
    monkeypatch.setenv("RANKFS_HOOK_SLAB_MB", "1")
    monkeypatch.setenv("RANKFS_HOOK_TRACE", str(tmp_path / "hook-{pid}.jsonl"))
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint,
                             expert_counts(shard_files(tiny_checkpoint), PROFILE))
            loader.release("target")
    finally:
        loader.deactivate()
    events = trace_summary.read_events(tmp_path / f"hook-{os.getpid()}.jsonl")
    opened = {e["path"]: e["groups"] for e in events if e["event"] == "open"}
    staged = [e for e in events if e["event"] == "group"]
    assert opened and collections.Counter(e["path"] for e in staged) == opened
    assert all(e["asked"] <= e["began"] <= e["ended"] <= e["t"] and e["thread"].startswith("rankfs-read")
               for e in staged)
    assert all((e["path"], e["group"]) in {(s["path"], s["group"]) for s in staged}
               for e in events if e["event"] == "wait")
    assert [e["phase"] for e in events if e["event"] == "release"] == ["target"]
    jobs = [e for e in events if e["event"] == "job"]
    assert sum(e["bytes"] for e in jobs) >= sum(e["bytes"] for e in staged)  # whole rows read for slices
    assert all(e["began"] <= e["ended"] and 0 <= e["cpu"] <= e["ended"] - e["began"] + 0.01 and e["reads"] >= 1
               for e in jobs)
    summary = trace_summary.summarize_hook(events)
    assert summary.startswith(f"groups: {len(staged)}, ")
    assert all(os.path.basename(path) in summary for path in opened)


@pytest.mark.mount
@pytest.mark.parametrize("sources", ["cached", "uncached"])
def test_runs_the_page_cache_holds_are_staged_in_place(tmp_path_factory, mount_dir, monkeypatch, sources):
    """Whole experts (an EP rank's: runs of 19 MB) that the page cache holds are windows of it, not
    read: the same bytes, nothing alive after the release, the sources' page cache as it was.
    Uncached, they are read into slabs."""
    checkpoint = deepseek_v4.write(tmp_path_factory.mktemp("windows") / "dsv4", deepseek_v4.FixtureSpec.sized(1, experts=4))
    files = shard_files(checkpoint)
    layout = MoELayout(moe_tp_size=2, moe_tp_rank=0, ep_size=2, ep_rank=0, n_experts=4)  # TP4/EP2 rank 0
    counts = expert_counts(files, PROFILE)
    want = {n: t.clone() for n, t in load_like_engine(checkpoint, layout, checkpoint, counts).items()
            if not n.startswith("mtp.")}
    monkeypatch.setenv("RANKFS_HOOK_MAP", "off")
    loader.activate("on")
    try:
        with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--ep-size", 2):
            if sources == "uncached":
                uncache(files)
            cached = cached_bytes(files)
            got = load_like_engine(mount_dir / "target", layout, checkpoint, counts)
            assert_same(got, want)
            del got
            figures = loader.release("target")
            assert figures["slabs_alive"] == 0 and loader.current().budget.used == 0
            assert (figures["windows"] > 0) == (sources == "cached")
            assert cached_bytes(files) == cached
    finally:
        loader.deactivate()


@pytest.mark.mount
def test_mapped_tensors_leave_the_loader_once_it_lets_them_go(tmp_path_factory, mount_dir, monkeypatch):
    """Pages of the sources' maps stay in the engine's RSS only while the loader holds their tensors
    (they stay in page cache): after the load, what is still mapped in is the row-store tables the
    stock reader serves, and the pages tensors share at their edges."""
    checkpoint = deepseek_v4.write(tmp_path_factory.mktemp("rss") / "dsv4", deepseek_v4.FixtureSpec.sized(1, experts=4))
    monkeypatch.setenv("RANKFS_HOOK_MAP", "on")
    loader.activate("on")
    try:
        with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            got = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), checkpoint)
            gc.collect()
            status = contract.read_status(str(mount_dir))
            planned = next(v for v in status["views"] if v["view"] == "target")["planned_bytes"]
            on_demand = sum(t.end - t.begin for s in Checkpoint.open(checkpoint).shards
                            for n, t in s.tensors.items() if PROFILE.is_on_demand(n))
            assert planned > 30_000_000 and _mapped_rss(checkpoint) < on_demand + planned // 10
            del got
            loader.release("target")
    finally:
        loader.deactivate()


def _mapped_rss(directory) -> int:
    """Bytes of this process's maps of files under `directory` that are resident in it."""
    total, counting = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                counting = len(fields) >= 6 and fields[5].startswith(str(directory))
            elif counting and fields[0] == "Rss:":
                total += int(fields[1]) << 10
    return total


@pytest.mark.mount
def test_loads_into_host_memory_map_the_files_the_page_cache_holds_and_read_the_others(tiny_checkpoint, mount_dir,
                                                                                       monkeypatch):
    """RANKFS_HOOK_MAP=auto without CUDA: a file whose tensors are cached is mapped (no read, no copy),
    one that is not is staged (read from the disk into slabs); the load's bytes are the same."""
    monkeypatch.delenv("RANKFS_HOOK_MAP", raising=False)
    shards = shard_files(tiny_checkpoint)
    uncache(shards)
    for shard in shards[::2]:  # every other shard cached
        with open(shard, "rb") as f:
            while f.read(1 << 20):
                pass
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            views = shard_files(mount_dir / "target")
            kinds = {}
            for view in views:
                with safetensors.safe_open(view, framework="pt") as opened:
                    kinds[os.path.basename(view)] = type(opened).__name__
            sources = {os.path.basename(s) for s in shards[::2]}
            assert {"MappedFile", "StagedFile"} <= set(kinds.values())
            assert {k for k, kind in kinds.items() if kind == "MappedFile"} == sources & set(kinds)
            assert {k for k, kind in kinds.items() if kind == "StagedFile"} == set(kinds) - sources
            got = load_like_engine(mount_dir / "target", engine_layout(4, 1, 1), tiny_checkpoint)
            loader.release("target")
        assert_same(got, {n: t for n, t in load_like_engine(tiny_checkpoint, engine_layout(4, 1, 1),
                                                             tiny_checkpoint).items() if not n.startswith("mtp.")})
    finally:
        loader.deactivate()


@pytest.mark.mount
@pytest.mark.parametrize("sources", ["cached", "uncached"])
def test_groups_staged_on_a_device_arrive_through_bounce_buffers_piece_by_piece(tiny_checkpoint, mount_dir,
                                                                                monkeypatch, tmp_path, sources):
    """The GPU path's data movement, with host memory standing in for the GPU's (the CUDA copies are
    checked on the GPU host by `python3 -m dev gpu-load`): runs read in pieces (direct reads where the
    page cache does not hold them, each at its place within a page) and rows of slices compacted
    into a thread's two bounce buffers in turn, each piece uploaded to its place in the group's
    slab. The load's bytes are the stock load's; after the release nothing is held. The trace says
    when each bounce buffer was made and taken."""
    monkeypatch.setattr(staging, "stage_on", host_staging)
    monkeypatch.setenv("RANKFS_HOOK_TRACE", str(tmp_path / "hook-{pid}.jsonl"))
    monkeypatch.setattr(DeviceLanding, "piece", 64 << 10)  # many pieces per run, and runs ending mid-piece
    monkeypatch.setenv("RANKFS_HOOK_SLAB_MB", "1")
    layout = engine_layout(4, 1, 1)
    want = {n: t.clone() for n, t in load_like_engine(tiny_checkpoint, layout, tiny_checkpoint).items()
            if not n.startswith("mtp.")}
    loader.activate("on")
    try:
        with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
            counts = expert_counts(shard_files(tiny_checkpoint), PROFILE)
            if sources == "uncached":
                uncache(shard_files(tiny_checkpoint))
            got = load_like_engine(mount_dir / "target", layout, tiny_checkpoint, counts)
            hook = loader.current()
            assert hook.on_device.pool.stats.slabs > 0 and hook.slabs.stats.slabs == 0  # every group on the device
            assert_same(got, want)
            del got
            figures = loader.release("target")
        assert figures["staged_on"] == "cpu" and figures["slabs_alive"] == 0 and figures["windows"] == 0
        assert figures["peak_host_bytes"] > 0 and figures["pinned_bytes"] == 0 and hook.budget.used == 0
        assert hook.on_device.pool.stats.held_bytes == 0
        assert 0 < figures["disk_threads"] <= hook.settings.disk_threads  # cold groups read by them too
    finally:
        loader.deactivate()
    events = trace_summary.read_events(tmp_path / f"hook-{os.getpid()}.jsonl")
    made = [e for e in events if e["event"] == "bounce"]
    taken = [e for e in events if e["event"] == "bounce-taken"]
    assert len(made) == 2 * hook.settings.threads and 0 < len(taken) <= len(made)
    assert all(e["began"] <= e["t"] and not e["pinned"] for e in made + taken if "pinned" in e)
    assert f"bounce buffers: {len(made)} made from " in trace_summary.summarize_hook(events)
