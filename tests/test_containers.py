"""The shape most fleets run: the mount made on the host with --local-ranks all, after the engine's
container started, which sees it through a propagated bind (Kubernetes' mountPropagation:
HostToContainer, a slave mount) and nothing of the checkpoint behind it. With rankfs in the engine's
image the hook loads the shared view (and, the sources out of its sight, reads through the mount);
without, the engine loads its rank's own view. Either way, the rank's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, mounted

pytestmark = pytest.mark.mount

ENGINE = """
mount --make-rslave /
mount -t tmpfs none "$CHECKPOINT"
echo started
read go
exec "$@"
"""


def _stock(checkpoint, rank: int) -> dict:
    """The rank's tensors, as the engine gets them from the original shards (EP2: no slices)."""
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "hash_loader.py"), checkpoint], cwd=ROOT,
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.splitlines()[-1])["digests"]


@pytest.mark.parametrize("image", ["with rankfs", "without rankfs"])
def test_an_engine_container_sees_only_the_propagated_view(tiny_checkpoint, tmp_path, image):
    host = tmp_path / "host"
    host.mkdir()
    subprocess.run(["mount", "--bind", host, host], check=True)
    subprocess.run(["mount", "--make-shared", host], check=True)
    try:
        view = "target" if image == "with rankfs" else "rank-1/target"
        loader = [sys.executable, str(ROOT / "tests" / "hash_loader.py"), host / "rankfs" / view]
        if image == "with rankfs":
            loader = ["rankfs", "run", "--", *loader, "--hook"]
        engine = subprocess.Popen(["unshare", "--mount", "--propagation", "unchanged", "sh", "-c", ENGINE, "sh",
                                   *map(str, loader)], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "CHECKPOINT": str(tiny_checkpoint), "RANKFS_RANK": "1"})
        assert engine.stdout.readline().strip() == "started"  # its namespace made before the mount
        (host / "rankfs").mkdir()
        with mounted(tiny_checkpoint, host / "rankfs", "--tp-size", 4, "--ep-size", 2, "--local-ranks", "all"):
            out, err = engine.communicate("go\n", timeout=300)
        assert engine.returncode == 0, err[-3000:]
        got = json.loads(out.splitlines()[-1])["digests"]
        assert (image == "with rankfs") == ("rankfs hook memlog: phase=target" in err)
        want = _stock(tiny_checkpoint, 1)
        assert got == {name: want[name] for name in got} and len(got) > 10
    finally:
        subprocess.run(["umount", "-l", host], check=False)
