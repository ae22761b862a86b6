"""A checkpoint directory as the engines see it: config.json, the shards the index (or a glob)
selects, their headers, and every other top-level file. Reads headers only, never tensor data."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from rankfs.common.contract import Source
from rankfs.plan.errors import CheckpointError
from rankfs.plan.safetensors import ShardHeader, TensorEntry, read_header

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"


@dataclass(frozen=True)
class Checkpoint:
    root: Path
    config: dict
    shards: tuple[ShardHeader, ...]  # sorted by file name, as the engines open them
    shard_names: tuple[str, ...]  # their names in the checkpoint (a symlink's, not its target's)
    shard_sources: tuple[Source, ...]  # the shards' files, as stat'ed when planned
    other_files: tuple[tuple[str, Source], ...]  # config.json, tokenizer files, ... as they are

    @classmethod
    def open(cls, root: str | os.PathLike, allow_outside_symlinks: bool = False) -> "Checkpoint":
        root = Path(root).absolute()
        if not root.is_dir():
            raise CheckpointError(root, "not a directory")
        files = _top_level_files(root, allow_outside_symlinks)
        config = _read_config(root)
        shard_names = sorted(n for n in files if n.endswith(".safetensors"))
        index = _read_index(root) if INDEX_NAME in files else None
        if index is not None:
            shard_names = sorted(set(index.values()))
            for name in shard_names:
                if name not in files:
                    raise CheckpointError(root / INDEX_NAME, f"names shard {name!r}, which is missing")
        if not shard_names:
            raise CheckpointError(root, "no *.safetensors shards")
        shards = tuple(read_header(files[name]) for name in shard_names)
        _check_names(root, shard_names, shards, index)
        shard_sources = tuple(Source(str(s.path), s.file_size, s.mtime_ns, s.inode) for s in shards)
        others = tuple((n, Source.stat(files[n])) for n in sorted(files)
                       if not n.endswith(".safetensors") and n != INDEX_NAME)
        return cls(root, config, shards, tuple(shard_names), shard_sources, others)


def _top_level_files(root: Path, allow_outside_symlinks: bool) -> dict[str, Path]:
    """Regular files at the top level (the engines do not recurse), symlinks resolved."""
    files = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        path = Path(entry.path)
        if entry.is_symlink():
            target = path.resolve()
            if not allow_outside_symlinks and not target.is_relative_to(root.resolve()):
                raise CheckpointError(path, f"symlink points outside the checkpoint ({target}); "
                                            "pass --allow-outside-symlinks to serve it")
            path = target
        if path.is_file():
            files[entry.name] = path
    return files


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(path, f"missing {what}") from None
    except OSError as exc:
        raise CheckpointError(path, f"cannot read {what}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(path, f"{what} is not valid JSON ({exc})") from None


def _read_config(root: Path) -> dict:
    config = _read_json(root / CONFIG_NAME, "config.json")
    if not isinstance(config, dict):
        raise CheckpointError(root / CONFIG_NAME, "config.json is not a JSON object")
    return config


def _read_index(root: Path) -> dict[str, str]:
    index = _read_json(root / INDEX_NAME, "index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise CheckpointError(root / INDEX_NAME, "no weight_map of tensor names to file names")
    return weight_map


def _check_names(root: Path, names: list[str], shards: tuple[ShardHeader, ...], index: dict[str, str] | None):
    owner: dict[str, str] = {}
    for file_name, shard in zip(names, shards):
        for name in shard.tensors:
            if name in owner:
                raise CheckpointError(root / file_name, f"tensor {name!r} is also in {owner[name]}")
            owner[name] = file_name
    for name, file_name in (index or {}).items():
        if owner.get(name) != file_name:
            raise CheckpointError(root / INDEX_NAME,
                                  f"names tensor {name!r} in {file_name}, whose header has no such tensor")


__all__ = ["Checkpoint", "TensorEntry", "INDEX_NAME", "CONFIG_NAME"]
