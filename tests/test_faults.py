"""Faults while serving: the loader gets an error, never zeros or stale bytes. Plus the soak test
(16 readers, every access pattern, checked byte for byte) and the mount's access defaults."""

from __future__ import annotations

import errno
import json
import mmap
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import ROOT, mounted, rankfs
from rankfs.common import contract
from rankfs.mount import kernel
from rankfs.mount.launch import wait_gone

pytestmark = pytest.mark.mount

LOADER = """
import sys
from dev.bench.engine_like import MoELayout, load
from rankfs.plan.profiles import BY_NAME
load(sys.argv[1], BY_NAME["deepseek-v4"], MoELayout(4, 1, 1, 0, n_experts=16))
print("LOADED")
"""


def load_in_subprocess(view: Path) -> subprocess.CompletedProcess:
    """The engine-like loader (stock safe_open, mmap) in a process of its own."""
    return subprocess.run([sys.executable, "-c", LOADER, str(view)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def last_target_shard(view: Path) -> Path:
    return sorted(view.glob("*.safetensors"))[-1]


def daemon_log(mountpoint: Path) -> str:
    return (mountpoint.parent / f"{mountpoint.name}.log").read_text()


def test_truncated_shard_gives_eio_and_a_failed_load(copied_checkpoint, mount_dir):
    with mounted(copied_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1, "--inflight-gb", 0.001):
        view = mount_dir / "target"
        first = sorted(view.glob("*.safetensors"))[0]
        assert len(first.read_bytes()) == first.stat().st_size
        source = copied_checkpoint / last_target_shard(view).name
        os.truncate(source, source.stat().st_size // 2)
        with pytest.raises(OSError) as info:
            last_target_shard(view).read_bytes()
        assert info.value.errno == errno.EIO
        result = load_in_subprocess(view)
        assert "LOADED" not in result.stdout and result.returncode != 0
    assert f"{source}: changed since it was mounted" in daemon_log(mount_dir)


def test_replaced_shard_gives_eio(copied_checkpoint, mount_dir):
    with mounted(copied_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1, "--inflight-gb", 0.001):
        view = mount_dir / "target"
        source = copied_checkpoint / last_target_shard(view).name
        replacement = source.with_suffix(".new")
        replacement.write_bytes(source.read_bytes())  # same bytes, new file: still not what was planned
        os.replace(replacement, source)
        with pytest.raises(OSError) as info:
            last_target_shard(view).read_bytes()
        assert info.value.errno == errno.EIO
    assert f"{source}: changed since it was mounted" in daemon_log(mount_dir)


def test_backing_read_error_gives_eio(copied_checkpoint, tmp_path):
    """The backing checkpoint is itself a rankfs view, so a read error is a real EIO from the kernel."""
    with mounted(copied_checkpoint, tmp_path / "lower", "--tp-size", 1, "--tp-rank", 0, "--tp-slice", "off",
                 "--inflight-gb", 0.001) as lower:
        with mounted(lower / "target", tmp_path / "upper", "--tp-size", 4, "--tp-rank", 1,
                     "--inflight-gb", 0.001) as upper:
            shard = last_target_shard(upper / "target")
            os.truncate(copied_checkpoint / shard.name, 100)
            with pytest.raises(OSError) as info:
                shard.read_bytes()
            assert info.value.errno == errno.EIO
            assert "Input/output error" in daemon_log(upper) and str(lower / "target" / shard.name) in daemon_log(upper)


STEPPED_LOADER = """
import sys, torch
from dev.bench.engine_like import shard_files
from safetensors import safe_open
for i, path in enumerate(shard_files(sys.argv[1])):
    with safe_open(path, "pt") as f:
        for name in f.keys():
            torch.empty_like(f.get_tensor(name)).copy_(f.get_tensor(name))
    print("done", i, flush=True)
    sys.stdin.readline()
print("LOADED", flush=True)
"""


def test_killed_daemon_fails_the_loader_and_is_cleaned_up(tiny_checkpoint, mount_dir):
    mount_dir.mkdir()
    rankfs("mount", tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--log", mount_dir.parent / "log")
    try:
        pid = contract.read_status(str(mount_dir))["pid"]
        loader = subprocess.Popen([sys.executable, "-c", STEPPED_LOADER, str(mount_dir / "target")], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert loader.stdout.readline().startswith("done 0")
        os.kill(pid, signal.SIGKILL)  # mid-load: one file read, the rest not
        assert wait_gone(pid, 30)
        out, _ = loader.communicate("go\n" * 10, timeout=60)
        assert "LOADED" not in out and loader.returncode != 0
        with pytest.raises(OSError) as info:
            (mount_dir / "target" / "config.json").read_bytes()
        assert info.value.errno == errno.ENOTCONN
        status = rankfs("status", mount_dir, check=False)
        assert status.returncode == 32 and "DEAD" in status.stderr
        assert "daemon had died" in rankfs("umount", mount_dir).stdout
        assert kernel.find_mount(mount_dir) is None
    finally:
        if kernel.find_mount(mount_dir):
            kernel.unmount(mount_dir, lazy=True)


def test_force_unmount_ends_a_stopped_daemon(tiny_checkpoint, mount_dir):
    """A daemon that hangs (here: stopped) leaves readers waiting; --force aborts the connection."""
    mount_dir.mkdir()
    rankfs("mount", tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--log", mount_dir.parent / "log")
    pid = contract.read_status(str(mount_dir))["pid"]
    shard = sorted((mount_dir / "target").glob("*.safetensors"))[0]
    waiting = kernel.connection(kernel.find_mount(mount_dir)) / "waiting"
    os.kill(pid, signal.SIGSTOP)
    reader = subprocess.Popen(["cat", str(shard)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while int(waiting.read_text()) == 0 and time.monotonic() < deadline:  # its request reaches the kernel
            time.sleep(0.01)
        assert int(waiting.read_text()) > 0 and reader.poll() is None  # waiting on the stopped daemon
        assert "connection aborted" in rankfs("umount", "--force", mount_dir).stdout
        assert reader.wait(timeout=30) != 0
        assert kernel.find_mount(mount_dir) is None
    finally:
        os.kill(pid, signal.SIGKILL)


def test_unmount_while_mapped_offers_lazy(tiny_checkpoint, mount_dir):
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0):
        f = open(sorted((mount_dir / "target").glob("*.safetensors"))[0], "rb")
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        result = rankfs("umount", mount_dir, check=False)
        assert result.returncode == 32 and "--lazy" in result.stderr and "mapped" in result.stderr
        assert "detached" in rankfs("umount", "--lazy", mount_dir).stdout
        assert mapped[:8] == f.read(8)  # what is mapped stays readable until closed
        mapped.close()
        f.close()
    assert kernel.find_mount(mount_dir) is None


def test_other_users_need_allow_other(tiny_checkpoint):
    import shutil
    import tempfile
    base = Path(tempfile.mkdtemp(prefix="rankfs-access-"))  # traversable by others, unlike pytest's tmp
    base.chmod(0o755)

    def read_as_nobody(path):
        return subprocess.run(["head", "-c", "1", str(path)], preexec_fn=lambda: os.setuid(65534),
                              capture_output=True, text=True)

    def drop_as_nobody(mnt):
        return subprocess.run(["sh", "-c", f"echo drop > {mnt / contract.CONTROL_DIR / contract.COMMAND_FILE}"],
                              preexec_fn=lambda: os.setuid(65534), capture_output=True, text=True)
    try:
        with mounted(tiny_checkpoint, base / "private", "--tp-size", 1, "--tp-rank", 0) as mnt:
            result = read_as_nobody(mnt / "target" / "config.json")
            assert result.returncode != 0 and "Permission denied" in result.stderr
            result = drop_as_nobody(mnt)
            assert result.returncode != 0 and "Permission denied" in result.stderr
            assert contract.read_status(str(mnt))["drops"] == 0
        with mounted(tiny_checkpoint, base / "shared", "--tp-size", 1, "--tp-rank", 0, "-o", "allow_other") as mnt:
            assert read_as_nobody(mnt / "target" / "config.json").returncode == 0
            assert drop_as_nobody(mnt).returncode == 0  # the engine may run as another user
            assert contract.read_status(str(mnt))["drops"] == 1
    finally:
        shutil.rmtree(base, ignore_errors=True)


# -- soak ---------------------------------------------------------------------------------------

def expected_bytes(virtual: Path, checkpoint: Path) -> bytes:
    """What a virtual shard must contain, from the original files and its own header: every tensor's
    bytes, and 0xFF outside the slices it declares."""
    import numpy as np
    head = virtual.open("rb").read(8)
    (n,) = struct.unpack("<Q", head)
    header = json.loads(virtual.open("rb").read(8 + n)[8:])
    meta = header.pop("__metadata__", {})
    slices = json.loads(meta.get(contract.SLICES_KEY, "{}"))
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    out = bytearray(virtual.open("rb").read(8 + n))
    sizes = {"I8": 1, "U8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BF16": 2, "F32": 4}
    for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        source = checkpoint / index[name]
        with source.open("rb") as f:
            (m,) = struct.unpack("<Q", f.read(8))
            original = json.loads(f.read(m))[name]["data_offsets"]
            f.seek(8 + m + original[0])
            data = bytearray(f.read(original[1] - original[0]))
        if name in slices:
            dim, start, stop = slices[name]
            shape = entry["shape"]
            inner = sizes[entry["dtype"]] * int(np.prod(shape[dim + 1:]))
            rows = np.frombuffer(data, np.uint8).reshape(-1, inner * shape[dim]).copy()
            rows[:, :inner * start] = 0xFF
            rows[:, inner * stop:] = 0xFF
            data = rows.tobytes()
        out += data
    return bytes(out)


OPERATIONS_PER_READER = 60


def test_soak_many_readers_every_pattern(tiny_checkpoint, mount_dir):
    """16 readers, OPERATIONS_PER_READER operations each: whole reads, ranges, O_DIRECT, mmap, and
    page-cache drops that force fresh reads through the daemon; every byte checked."""
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 2, "--inflight-gb", 0.02):
        files = sorted((mount_dir / "target").glob("*.safetensors")) + \
            sorted((mount_dir / "draft").glob("*.safetensors"))
        expected = {f: expected_bytes(f, tiny_checkpoint) for f in files}
        checked = [0] * 16  # reads compared, per thread

        def worker(seed):
            rng = random.Random(seed)
            for _ in range(OPERATIONS_PER_READER):
                path = rng.choice(files)
                want = expected[path]
                kind = rng.choice(["range", "whole", "direct", "mmap", "drop"])
                try:
                    if kind == "drop":  # dropping the page cache forces fresh reads through the daemon
                        with open(path, "rb") as f:
                            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                        continue
                    if kind == "whole":
                        got, start = path.read_bytes(), 0
                    elif kind == "range":
                        start = rng.randrange(len(want))
                        with open(path, "rb") as f:
                            got = os.pread(f.fileno(), rng.randint(1, 3 << 20), start)
                    elif kind == "direct":
                        start = rng.randrange(len(want)) // 4096 * 4096
                        size = rng.randint(1, 512) * 4096
                        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                        try:
                            buffer = mmap.mmap(-1, size)
                            got = bytes(buffer[:os.preadv(fd, [buffer], start)])
                        finally:
                            os.close(fd)
                    else:
                        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
                            start = rng.randrange(len(want))
                            got = m[start:start + rng.randint(1, 1 << 20)]
                    if got != want[start:start + len(got)] or (kind == "whole" and len(got) != len(want)):
                        errors.append(f"{kind} read of {path.name} at {start} differs")
                    checked[seed] += 1
                except Exception as exc:  # any error is a failure of the soak
                    errors.append(f"{kind} read of {path.name}: {exc!r}")

        errors: list[str] = []  # list.append is atomic: the threads share it
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        assert sum(checked) > 0.7 * 16 * OPERATIONS_PER_READER  # all but the drops were reads, checked
        assert contract.read_status(str(mount_dir))["errors"] == 0
