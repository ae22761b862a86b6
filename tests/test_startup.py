"""The hook is invisible until used: under `rankfs run`, a Python process that never opens a rankfs
file imports nothing heavy and starts no thread, yet has safetensors routed and the engines'
loaders wrapped for when it does. (What it costs in time and memory: python3 -m dev startup-cost.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import ROOT, checkout_env

PROBE = """
import json, sys, threading
import safetensors
from safetensors import safe_open
heavy = sorted(m for m in ("torch", "numpy", "trio", "pyfuse3", "rankfs.loader.hook", "rankfs.reader.engine",
                           "rankfs.vfs.fs", "rankfs.mount.daemon", "logging", "ctypes") if m in sys.modules)
threads = threading.active_count()
import safetensors.torch  # imports torch itself
import rankfs.loader
print(json.dumps({"heavy": heavy, "threads": threads, "hook": rankfs.loader.current() is not None,
                  "routed": [f.__module__ for f in (safetensors.safe_open, safe_open, safetensors.torch.safe_open)]}))
"""


def run_probe(*runner: str) -> dict:
    result = subprocess.run([*runner, sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if not k.startswith("RANKFS_")})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_process_that_opens_no_rankfs_file_pays_nothing_heavy():
    hooked = run_probe("rankfs", "run", "--")
    assert hooked == {"heavy": [], "threads": 1, "routed": ["rankfs.loader.routing"] * 3, "hook": False}
    assert run_probe()["routed"] == ["builtins"] * 3  # without rankfs run: the stock safetensors
    off = subprocess.run(["rankfs", "run", "--", sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "RANKFS_HOOK": "off"})
    assert json.loads(off.stdout)["routed"] == ["builtins"] * 3


def test_the_engines_loaders_are_wrapped_when_imported():
    """Wrapped on the class at import, before any load: every caller and subclass gets it."""
    probe = ("import json; from dev import engine_driver; engine_driver.stand_in_for_torchvision();"
             "import sglang.srt.model_loader.loader as s, vllm.model_executor.model_loader.default_loader as v;"
             "print(json.dumps([s.DefaultModelLoader.load_weights_and_postprocess._rankfs_load,"
             " v.DefaultModelLoader.load_weights._rankfs_load]))")
    env = checkout_env(VLLM_TARGET_DEVICE="cpu")
    result = subprocess.run(["rankfs", "run", "--", sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                            text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.splitlines()[-1]) == [True, True]


def test_the_hook_imports_nothing_of_the_daemon():
    """The engine side shares only rankfs.common.contract (and pure planning and I/O helpers) with the daemon."""
    probe = ("import json, sys, rankfs.loader.hook;"
             "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'pyfuse3')"
             " or m.startswith(('rankfs.vfs', 'rankfs.mount', 'rankfs.reader.engine', 'rankfs.plan.layout')))))")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == []
