"""SGLang's and vLLM's real DefaultModelLoaders, driven as the engines drive them, each in a process
started with `rankfs run`: every load of a rankfs view (target, then draft) is released exactly once,
when it returns, with the phase of the view it read; the bytes equal what the same loader gets from
the original checkpoint; a load of plain files is left alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, checkout_env, mounted, rankfs
from dev.bench.engine_like import expert_counts, shard_files
from dev.fixtures import deepseek_v4
from rankfs.plan.profiles import BY_NAME

pytestmark = pytest.mark.mount

SPEC = deepseek_v4.FixtureSpec.tiny()
LAYOUTS = {  # name -> (mount flags, the engine's MoE layout for that rank)
    "ep1-sliced": (["--tp-size", 4, "--tp-rank", 1, "--ep-size", 1],
                   dict(moe_tp_size=4, moe_tp_rank=1, ep_size=1, ep_rank=0, n_experts=SPEC.experts)),
    "ep2": (["--tp-size", 4, "--tp-rank", 2, "--ep-size", 2],
            dict(moe_tp_size=2, moe_tp_rank=0, ep_size=2, ep_rank=1, n_experts=SPEC.experts)),
}


def drive(engine: str, jobs: list[dict], hook_env: dict, runner: list[str]) -> tuple[list[dict], str]:
    """Run the driver; returns its per-load reports and its stderr (where the memlog lines go)."""
    env = checkout_env(**hook_env)
    result = subprocess.run([*runner, sys.executable, "-m", "dev.engine_driver", engine, json.dumps(jobs)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], result.stderr


def jobs_for(checkpoint, mounts: dict) -> list[dict]:
    """For each layout: the original checkpoint's target and draft (plain files), then the mount's."""
    counts = expert_counts(shard_files(checkpoint), BY_NAME["deepseek-v4"])  # the engine's, from its config
    jobs = []
    for name, mountpoint in mounts.items():
        for phase in ("target", "draft"):
            for directory in (checkpoint, mountpoint / phase):
                jobs.append(dict(directory=str(directory), model=str(checkpoint), phase=phase, layout=LAYOUTS[name][1],
                                 counts=counts))
    return jobs


def check(reports: list[dict], stderr: str, expect_releases: bool = True, collector_paused: bool = True):
    released = []
    for original, through_rankfs in zip(reports[::2], reports[1::2]):
        phase = through_rankfs["phase"]
        assert original["releases"] == released  # plain files: no load of ours, nothing released
        # The garbage collector: paused inside the hook's loads only, running again once each returns.
        assert original["collector_in_load"] and through_rankfs["collector_in_load"] != collector_paused
        assert original["collector_after"] and through_rankfs["collector_after"]
        assert through_rankfs["digests"] == original["digests"] and original["digests"], phase
        if expect_releases:
            released = released + [phase]  # this load, once, when it returned, named by its view
        assert through_rankfs["releases"] == released
        assert all(alive == 0 for alive in through_rankfs["slabs_alive"])
    for phase in ("target", "draft"):
        assert stderr.count(f"rankfs hook memlog: phase={phase} ") == released.count(phase)


@pytest.fixture(scope="module")
def mounts(tiny_checkpoint, tmp_path_factory):
    base = tmp_path_factory.mktemp("engines")
    with mounted(tiny_checkpoint, base / "ep1-sliced", *LAYOUTS["ep1-sliced"][0]) as sliced, \
            mounted(tiny_checkpoint, base / "ep2", *LAYOUTS["ep2"][0]) as ep2:
        yield {"ep1-sliced": sliced, "ep2": ep2}


@pytest.mark.parametrize("path", ["map", "slab", "auto", "device"])
@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_each_load_is_released_once_when_it_returns(tiny_checkpoint, mounts, engine, path):
    # 1 MiB slabs: the cached experts' runs (64 KiB and more) are windows of the page cache, the rest slabs.
    # auto (the default): every other source shard dropped from the page cache before each load of a
    # view, so that those files are staged and the others mapped.
    # device: staged as on a GPU (bounce buffers into device slabs), host memory standing in for its.
    env = {"map": {"RANKFS_HOOK_MAP": "on"}, "slab": {"RANKFS_HOOK_MAP": "off", "RANKFS_HOOK_SLAB_MB": "1"},
           "auto": {}, "device": {"ENGINE_DRIVER_STAGE_ON": "host", "RANKFS_HOOK_SLAB_MB": "1"}}[path]
    jobs = jobs_for(tiny_checkpoint, mounts)
    if path == "auto":
        jobs = [dict(job, uncache=shard_files(tiny_checkpoint)[::2]) if job["directory"] != str(tiny_checkpoint)
                else job for job in jobs]
    reports, stderr = drive(engine, jobs, env, ["rankfs", "run", "--"])
    check(reports, stderr)
    staged = [figures for r in reports for figures in r["release_figures"]]
    assert (path == "slab") == any(f["windows"] for f in staged) and all(f["slabs"] >= f["windows"] for f in staged)
    assert (path == "map") != any(f["slab_requests"] for f in staged)
    assert all(f["staged_on"] == ("cpu" if path == "device" else "host") for f in staged)
    for name, mountpoint in mounts.items():  # every byte came from the sources, nothing read ahead twice
        status = json.loads(rankfs("status", mountpoint, "--json").stdout)
        assert status["prefetch_loads"] == 0 and status["pushed_bytes"] == 0
        assert all(v["hook_loaded_bytes"] == v["planned_bytes"] for v in status["views"] if v["active"])


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_observe_mode_loads_the_stock_way_and_reports(tiny_checkpoint, mounts, engine):
    reports, stderr = drive(engine, jobs_for(tiny_checkpoint, {"ep1-sliced": mounts["ep1-sliced"]}), {},
                            ["rankfs", "run", "--observe", "--"])
    check(reports, stderr, collector_paused=False)
    assert "slab_requests=0" in stderr


def test_sources_the_engine_cannot_see_are_read_through_the_view(tiny_checkpoint, mounts):
    """An engine that sees the mount but not the checkpoint behind it (a container): here a mount
    namespace with an empty tmpfs over the checkpoint. The hook reads the view itself."""
    sliced = mounts["ep1-sliced"]
    jobs = [dict(job, model=job["directory"])  # the engine's model shaped from what it sees: the view
            for job in jobs_for(tiny_checkpoint, {"ep1-sliced": sliced}) if job["directory"] != str(tiny_checkpoint)]
    before = json.loads(rankfs("status", sliced, "--json").stdout)["read_bytes"]
    hidden = f"mount -t tmpfs none {tiny_checkpoint} && exec \"$@\""
    reports, stderr = drive("sglang", jobs, {}, ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                                                 hidden, "sh", "rankfs", "run", "--"])
    assert [r["releases"] for r in reports] == [["target"], ["target", "draft"]]
    assert "reading through the mount" in stderr or json.loads(
        rankfs("status", sliced, "--json").stdout)["read_bytes"] > before
    want = {r["phase"]: r["digests"] for r in drive("sglang", [dict(job, directory=str(tiny_checkpoint))
                                                               for job in jobs], {}, [])[0]}
    assert {r["phase"]: r["digests"] for r in reports} == want


@pytest.mark.parametrize("switch", [{}, {"VLLM_PLUGINS": ""}, {"RANKFS_HOOK": "off"}])
def test_vllms_plugin_loader_installs_the_hook_without_rankfs_run(tiny_checkpoint, mounts, switch):
    """The installed package's vllm.general_plugins entry point: vLLM's own plugin loader puts the
    hook in (each load released once, bitwise), with no wrapper; VLLM_PLUGINS and RANKFS_HOOK=off
    leave it out (the stock path, bitwise all the same)."""
    jobs = jobs_for(tiny_checkpoint, {"ep1-sliced": mounts["ep1-sliced"]})
    reports, stderr = drive("vllm", jobs, {"ENGINE_DRIVER_PLUGINS": "1", **switch}, [])
    check(reports, stderr, expect_releases=not switch, collector_paused=not switch)


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_rank_of_a_mount_of_several_local_ranks_loads_its_own_view(tiny_checkpoint, tmp_path, engine):
    """Started with the view every local rank is started with, the rank (RANKFS_RANK) gets its own
    bytes; the pages the other rank reads too come through the page cache, the rest direct."""
    flags = ["--tp-size", 4, "--ep-size", 1, "--local-ranks", "0,1"]
    with mounted(tiny_checkpoint, tmp_path / "mnt", *flags) as mountpoint:
        jobs = [dict(job, uncache=shard_files(tiny_checkpoint)) if job["directory"] != str(tiny_checkpoint) else job
                for job in jobs_for(tiny_checkpoint, {"ep1-sliced": mountpoint})]  # TP4 rank 1's layout
        reports, stderr = drive(engine, jobs, {"RANKFS_RANK": "1", "RANKFS_HOOK_MAP": "off"}, ["rankfs", "run", "--"])
    check(reports, stderr)
    staged = [figures for r in reports for figures in r["release_figures"]]
    assert sum(f["source_direct_bytes"] for f in staged) > 0 and sum(f["source_cached_bytes"] for f in staged) > 0
