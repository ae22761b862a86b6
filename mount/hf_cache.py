"""A Hugging Face repo id as a checkpoint: the snapshot huggingface_hub's cache holds, offline.

    $HF_HUB_CACHE (else $HF_HOME/hub, else ~/.cache/huggingface/hub)/models--ORG--NAME/
        refs/REVISION            the commit a branch or tag points to
        snapshots/COMMIT/FILE    symlinks into ../../blobs/, the files' bytes

A repo, revision or file that is not cached is an error that says which; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from rankfs.plan.errors import CheckpointError

REPO_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
COMMIT = re.compile(r"^[0-9a-f]{40}$")
INDEX_NAME = "model.safetensors.index.json"


def is_repo_id(text: str) -> bool:
    """ORG/NAME that names no directory here."""
    return bool(REPO_ID.match(text)) and not os.path.exists(text)


def cache_dir() -> Path:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(variable):
            return Path(os.environ[variable])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"),
                                                     "huggingface")
    return Path(home) / "hub"


def snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The cached snapshot of a model repo at a revision (a branch, a tag or a commit; default main),
    checked complete: its config, and every shard its index lists (or a shard, without one)."""
    cache = cache_dir()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    if not repo.is_dir():
        raise CheckpointError(repo_id, f"not in the Hugging Face cache at {cache} (download it first, e.g. "
                                       f"'huggingface-cli download {repo_id}'; HF_HUB_CACHE sets the cache)")
    revision = revision or "main"
    ref = repo / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision if COMMIT.match(revision) else None
    folder = repo / "snapshots" / commit if commit else None
    if folder is None or not folder.is_dir():
        cached = sorted(p.name for p in (repo / "refs").iterdir()) if (repo / "refs").is_dir() else []
        raise CheckpointError(repo_id, f"revision {revision!r} is not in the cache (cached: "
                                       f"{', '.join(cached) or 'none'})")
    missing = _missing(folder)
    if missing:
        raise CheckpointError(repo_id, f"the cached snapshot {commit[:12]} is partial: {len(missing)} file(s) "
                                       f"missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}); "
                                       "download the rest")
    return folder


def _missing(folder: Path) -> list[str]:
    """Files the snapshot needs and lacks (a symlink whose blob is gone counts as missing)."""
    needed = ["config.json"]
    index = folder / INDEX_NAME
    if index.exists():
        try:
            needed += sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError):
            return [INDEX_NAME]
    elif not any(folder.glob("*.safetensors")):
        needed.append("*.safetensors")
    return [name for name in needed if not (folder / name).exists()]
