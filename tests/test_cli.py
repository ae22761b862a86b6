"""The command line as a user runs it: help, exit codes, status and progress."""

from __future__ import annotations

import json

from conftest import mounted, rankfs


def test_help_and_usage_errors():
    result = rankfs("--help")
    assert "mount" in result.stdout and "Exit codes" in result.stdout
    for command in ("mount", "umount", "status", "drop", "plan", "run", "fixture", "demo", "profiles"):
        assert rankfs(command, "--help").returncode == 0
    bad = rankfs("mount", "/nonexistent", check=False)
    assert bad.returncode == 1 and "usage" in bad.stderr
    assert rankfs("umount", "/tmp", check=False).returncode == 32


def test_status_shows_progress_against_the_plan(tiny_checkpoint, mount_dir):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        for shard in (mount_dir / "target").glob("*.safetensors"):
            shard.read_bytes()
        text = rankfs("status", mount_dir).stdout
        assert "alive" in text and "target" in text and "100.0%" in text
        status = json.loads(rankfs("status", mount_dir, "--json").stdout)
        target = next(v for v in status["views"] if v["view"] == "target")
        assert target["served_bytes"] >= target["planned_bytes"] > 0
        assert status["tuning"]["read_ahead_kb"] and status["tuning"]["max_background"]


def test_mount_progress_returns_when_the_views_are_read(tiny_checkpoint, tmp_path):
    import subprocess
    import sys
    import threading
    import time

    from conftest import ROOT
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "mount.cli", "mount", str(tiny_checkpoint), str(mountpoint),
                             "--tp-size", "2", "--tp-rank", "0", "--progress", "--log", str(tmp_path / "log")],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (mountpoint / "target").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        reader = threading.Thread(target=lambda: [p.read_bytes() for p in (mountpoint / "target").glob("*.safetensors")])
        reader.start()
        reader.join()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "100.0%" in out
    finally:
        rankfs("umount", mountpoint, check=False)
