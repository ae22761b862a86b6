"""The safetensors container: parse a shard's header strictly, and encode a new one.

The parser accepts only what the `safetensors` reader itself accepts (and a little less: duplicate
keys are refused), so a virtual file built from it never surprises a loader.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from rankfs.plan.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000
HEADER_ALIGN = 8

DTYPE_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}
_MAX_U64 = (1 << 64) - 1


class HeaderError(CheckpointError):
    """A shard that no safetensors reader would accept."""


class TensorEntry(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the data region
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    path: Path
    file_size: int
    mtime_ns: int
    inode: int
    data_start: int  # 8 + header length
    tensors: dict[str, TensorEntry]  # in file (offset) order
    metadata: dict[str, str] | None


def _parse_entry(path, name: str, raw) -> TensorEntry:
    # Hot for 100k-tensor checkpoints: plain type checks, one pass.
    try:
        dtype, shape, offsets = raw["dtype"], raw["shape"], raw["data_offsets"]
    except (TypeError, KeyError):
        raise HeaderError(path, f"tensor {name!r}: entry needs dtype, shape and data_offsets") from None
    itemsize = DTYPE_SIZES.get(dtype) if type(dtype) is str else None
    if itemsize is None:
        raise HeaderError(path, f"tensor {name!r}: unknown dtype {dtype!r}")
    if type(shape) is not list:
        raise HeaderError(path, f"tensor {name!r}: shape must be a list of non-negative integers")
    numel = 1
    for dim in shape:
        if type(dim) is not int or not 0 <= dim <= _MAX_U64:
            raise HeaderError(path, f"tensor {name!r}: shape must be a list of non-negative integers")
        numel *= dim
    if (type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int
            or type(offsets[1]) is not int or not 0 <= offsets[0] <= offsets[1] <= _MAX_U64):
        raise HeaderError(path, f"tensor {name!r}: data_offsets must be [begin, end] with begin <= end")
    begin, end = offsets
    if numel * itemsize != end - begin:
        raise HeaderError(path, f"tensor {name!r}: {end - begin} bytes do not match "
                                f"shape {shape} of {dtype}")
    return TensorEntry(name, dtype, tuple(shape), begin, end)


def _no_duplicate_keys(pairs):
    out = dict(pairs)
    if len(out) != len(pairs):
        seen = set()
        duplicate = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"duplicate key {duplicate!r}")
    return out


def _by_offsets(entry: TensorEntry):
    return entry.begin, entry.end


def parse_header(path, header: bytes, file_size: int, mtime_ns: int = 0, inode: int = 0) -> ShardHeader:
    """Validate a header (the JSON bytes after the length prefix) against the file's size."""
    try:
        obj = json.loads(header.decode("utf-8"), object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise HeaderError(path, f"header is not UTF-8 JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise HeaderError(path, "header is not a JSON object")
    metadata = obj.pop("__metadata__", None)
    if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise HeaderError(path, "__metadata__ must map strings to strings")
    entries = [_parse_entry(path, name, raw) for name, raw in obj.items()]
    entries.sort(key=_by_offsets)
    position = 0
    for entry in entries:
        if entry.begin != position:
            kind = "hole before" if entry.begin > position else "overlap at"
            raise HeaderError(path, f"tensor {entry.name!r}: {kind} offset {entry.begin} "
                                    f"(previous data ends at {position})")
        position = entry.end
    data_start = 8 + len(header)
    if data_start + position != file_size:
        what = "longer" if data_start + position < file_size else "shorter"
        raise HeaderError(path, f"file is {what} than its header says "
                                f"({file_size} bytes, header describes {data_start + position})")
    return ShardHeader(Path(path), file_size, mtime_ns, inode, data_start,
                       {e.name: e for e in entries}, metadata)


def _pread_full(fd: int, length: int, offset: int) -> bytes:
    parts = []
    while length > 0:
        part = os.pread(fd, length, offset)
        if not part:
            break
        parts.append(part)
        length, offset = length - len(part), offset + len(part)
    return b"".join(parts)


def read_header(path: str | os.PathLike, direct: bool = False) -> ShardHeader:
    """Read and validate one shard's header; never reads tensor data. `direct`: with O_DIRECT, for a
    file on a rankfs view, where even a page-cache read of the header would fetch a megabyte of
    tensor data around it and start the daemon's prefetch."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            st = os.fstat(fd)
            if not direct:  # no readahead of tensor data
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            prefix = _pread_full(fd, 8, 0)
            if len(prefix) < 8:
                raise HeaderError(path, f"file is {len(prefix)} bytes, too short for a header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise HeaderError(path, f"header length {length} is above the format's limit "
                                        f"of {MAX_HEADER_BYTES}")
            if 8 + length > st.st_size:
                raise HeaderError(path, f"header length {length} runs past the end of the file "
                                        f"({st.st_size} bytes)")
            header = _pread_full(fd, length, 8)
        finally:
            os.close(fd)
    except OSError as exc:
        raise HeaderError(path, f"cannot read: {exc.strerror or exc}") from None
    if len(header) != length:
        raise HeaderError(path, "truncated header")
    return parse_header(path, header, st.st_size, st.st_mtime_ns, st.st_ino)


def _json_string(text: str) -> str:
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text:
        return f'"{text}"'
    return json.dumps(text)


def encode_header(entries, metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix plus JSON, padded with spaces so the data region starts 8-aligned.

    `entries` yields (name, dtype, shape, begin, end) relative to the data region. Formatted by hand:
    json.dumps of 100k nested dicts is the slowest step of planning a large checkpoint.
    """
    parts = [f'"__metadata__":{json.dumps(metadata, separators=(",", ":"))}'] if metadata else []
    for name, dtype, shape, begin, end in entries:
        parts.append(f'{_json_string(name)}:{{"dtype":"{dtype}","shape":[{",".join(map(str, shape))}],'
                     f'"data_offsets":[{begin},{end}]}}')
    body = ("{" + ",".join(parts) + "}").encode()
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body


def writer_order(name: str, dtype: str):
    """Sort key of the safetensors writer: larger element size first, then name. Every tensor then
    stays aligned to its element size without padding (the format allows no gaps)."""
    return -DTYPE_SIZES[dtype], name
