"""The command line as a user runs it: help, version, exit codes, status, progress and drop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, mounted, rankfs
from rankfs.common import contract


def test_help_version_and_usage_errors(tmp_path):
    result = rankfs("--help")
    assert "mount" in result.stdout and "exit codes" in result.stdout and "127" in result.stdout
    assert rankfs("--version").stdout.startswith("rankfs ")
    for command in ("mount", "umount", "status", "drop", "plan", "run", "profiles"):
        assert "usage: rankfs " + command in rankfs(command, "--help").stdout
    mount_help = rankfs("mount", "--help").stdout
    assert "GiB" in mount_help and "default: 8" in mount_help and "-o OPT" in mount_help
    bad = rankfs("mount", "/nonexistent", check=False)
    assert bad.returncode == 1 and "usage" in bad.stderr
    zero = rankfs("mount", "/nonexistent", str(tmp_path), "--tp-size", 1, "--tp-rank", 0, "--inflight-gb", 0,
                  check=False)
    assert zero.returncode == 1 and "more than 0 GiB" in zero.stderr
    for flag in ("--workers", "--push-threads"):
        none = rankfs("mount", "/nonexistent", str(tmp_path), "--tp-size", 1, "--tp-rank", 0, flag, 0, check=False)
        assert none.returncode == 1 and f"{flag}: must be at least 1" in none.stderr
    for command in ("umount", "status", "drop"):  # a path that is not a rankfs mount
        result = rankfs(command, str(tmp_path), check=False)
        assert result.returncode == 32 and result.stderr == f"rankfs: {tmp_path}: not mounted\n"


def test_run_exit_codes_are_the_commands(tmp_path):
    assert rankfs("run", "--", sys.executable, "-c", "import sys; sys.exit(7)", check=False).returncode == 7
    missing = rankfs("run", "--", "no-such-command-rankfs", check=False)
    assert missing.returncode == 127 and missing.stderr == "rankfs: run: no-such-command-rankfs: command not found\n"
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    denied = rankfs("run", "--", str(script), check=False)
    assert denied.returncode == 126 and "permission denied" in denied.stderr
    assert rankfs("run", check=False).returncode == 1


@pytest.mark.mount
def test_status_and_drop(tiny_checkpoint, mount_dir):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        for shard in (mount_dir / "target").glob("*.safetensors"):
            shard.read_bytes()
        text = rankfs("status", mount_dir).stdout
        assert "alive" in text and "target" in text and "100.0%" in text
        status = json.loads(rankfs("status", mount_dir, "--json").stdout)
        target = next(v for v in status["views"] if v["view"] == "target")
        assert target["served_bytes"] >= target["planned_bytes"] > 0
        assert status["tuning"]["read_ahead_kb"] and status["tuning"]["max_background"]
        assert rankfs("drop", mount_dir).stdout == "rankfs: dropped the views' page cache and the daemon's buffers\n"
        assert contract.read_status(str(mount_dir))["drops"] == status["drops"] + 1


@pytest.mark.mount
@pytest.mark.parametrize("flags, readahead_kb", [(("--tp-size", 4, "--tp-rank", 1), 256),  # experts sliced
                                                 (("--tp-size", 4, "--tp-rank", 1, "--ep-size", 4), 1024),
                                                 (("--tp-size", 4, "--tp-rank", 1, "--readahead-kb", 512), 512)])
def test_the_mounts_readahead_is_smaller_where_experts_are_sliced(tiny_checkpoint, mount_dir, flags, readahead_kb):
    with mounted(tiny_checkpoint, mount_dir, *flags):
        device = contract.find_mount(str(mount_dir)).device
        assert int(Path(f"/sys/class/bdi/{device}/read_ahead_kb").read_text()) == readahead_kb


@pytest.mark.mount
def test_mount_progress_returns_when_the_views_are_read(tiny_checkpoint, tmp_path):
    """`rankfs mount --progress` mounts, then shows progress until the opened views are loaded: it is
    still running after the mount is ready, and returns 0 once a reader has read the target view."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "rankfs.mount.cli", "mount", str(tiny_checkpoint), str(mountpoint),
                             "--tp-size", "2", "--tp-rank", "0", "--progress", "--log", str(tmp_path / "log")],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("rankfs: ready:")
        assert proc.poll() is None  # watching, nothing read yet
        for shard in (mountpoint / "target").glob("*.safetensors"):
            shard.read_bytes()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "100.0%" in out
    finally:
        rankfs("umount", mountpoint, check=False)


@pytest.mark.mount
def test_control_file_takes_commands(tiny_checkpoint, mount_dir):
    """Commands go through the mount's own write-only control file: a drop returns once done (a
    shell's `echo drop >` works too), an unknown command is refused. Who may write it:
    test_faults.py::test_other_users_need_allow_other."""
    import errno
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 1, "--tp-rank", 0):
        control = mount_dir / contract.CONTROL_DIR / contract.COMMAND_FILE
        assert oct(control.stat().st_mode & 0o777) == "0o200"
        contract.send(str(mount_dir), "drop")
        assert contract.read_status(str(mount_dir))["drops"] == 1
        subprocess.run(["sh", "-c", f"echo drop > {control}"], check=True)
        assert contract.read_status(str(mount_dir))["drops"] == 2
        with pytest.raises(OSError) as info:
            contract.send(str(mount_dir), "format everything")
        assert info.value.errno == errno.EINVAL
        with pytest.raises(OSError):
            control.read_bytes()
