"""Bad checkpoints and layouts are refused with one clear message naming the file, a non-zero exit,
nothing mounted and nothing written. Header parsing is fuzzed against safetensors itself."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import rankfs
from rankfs.mount import kernel
from rankfs.plan.errors import CheckpointError
from rankfs.plan.safetensors import HeaderError, encode_header, parse_header

SHARD = "model-00002-of-00006.safetensors"


def rewrite_header(path, mutate):
    """Rewrite a shard with mutate(header dict) applied, data unchanged."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    body = data[8 + n:]
    mutate(header)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def first_tensor(header):
    return next(k for k in header if k != "__metadata__")


def hole(h):
    del h[min((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])]


def overlap(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    h[names[1]]["data_offsets"][0] -= 1
    h[names[1]]["shape"] = [h[names[1]]["data_offsets"][1] - h[names[1]]["data_offsets"][0]]
    h[names[1]]["dtype"] = "U8"


def bad_size(h):
    h[first_tensor(h)]["shape"][0] += 1


def unknown_dtype(h):
    h[first_tensor(h)]["dtype"] = "Q7"


def beyond_file(h):
    names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
    last = h[names[-1]]
    last["data_offsets"][1] += 4096
    last["dtype"], last["shape"] = "U8", [last["data_offsets"][1] - last["data_offsets"][0]]


def raw_bytes(content: bytes):
    return lambda path: path.write_bytes(content)


def index_edit(mutate):
    def apply(directory):
        path = directory / "model.safetensors.index.json"
        index = json.loads(path.read_text())
        mutate(index["weight_map"])
        path.write_text(json.dumps(index))
    return apply


CASES = {
    "header length beyond the file": (SHARD, raw_bytes(struct.pack("<Q", 10_000) + b"{}"), "runs past the end"),
    "header length above the limit": (SHARD, raw_bytes(struct.pack("<Q", 200_000_000) + b"{}"), "above the format's limit"),
    "truncated header": (SHARD, raw_bytes(b"\x10\x00\x00"), "too short for a header length"),
    "header not UTF-8": (SHARD, raw_bytes(struct.pack("<Q", 4) + b"\xff\xfe{}"), "not UTF-8 JSON"),
    "header not JSON": (SHARD, raw_bytes(struct.pack("<Q", 5) + b"{nope"), "not UTF-8 JSON"),
    "hole between tensors": (SHARD, lambda p: rewrite_header(p, hole), "hole before"),
    "overlapping tensors": (SHARD, lambda p: rewrite_header(p, overlap), "overlap at"),
    "offsets beyond the file": (SHARD, lambda p: rewrite_header(p, beyond_file), "shorter than its header says"),
    "size does not match shape": (SHARD, lambda p: rewrite_header(p, bad_size), "do not match shape"),
    "unknown dtype": (SHARD, lambda p: rewrite_header(p, unknown_dtype), "unknown dtype 'Q7'"),
    "file longer than its header": (SHARD, lambda p: p.write_bytes(p.read_bytes() + b"\0" * 3), "longer than its header says"),
    "index names a missing shard": (None, index_edit(lambda m: m.update({"x.weight": "model-missing.safetensors"})), "model-missing.safetensors"),
    "index names an unknown tensor": (None, index_edit(lambda m: m.update({"no.such.tensor": SHARD})), "no.such.tensor"),
    "missing config.json": ("config.json", lambda p: p.unlink(), "missing config.json"),
    "config.json not JSON": ("config.json", lambda p: p.write_text("{"), "config.json is not valid JSON"),
}


def digest(directory) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_refused(tiny_checkpoint, tmp_path, case):
    target, corrupt, message = CASES[case]
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, checkpoint)
    corrupt(checkpoint / target if target else checkpoint)
    before = digest(checkpoint)
    named = (checkpoint / (target or "model.safetensors.index.json")).name
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = rankfs("mount", checkpoint, mountpoint, "--tp-size", 2, "--tp-rank", 0, "--log", tmp_path / "log",
                    check=False)
    assert result.returncode == 32, result.stderr
    assert message in result.stderr and named in result.stderr, result.stderr
    assert result.stderr.count("\n") == 1  # one clear line
    assert kernel.find_mount(mountpoint) is None and not os.listdir(mountpoint)
    result = rankfs("plan", checkpoint, "--tp-size", 2, check=False)
    assert result.returncode == 1 and message in result.stderr and named in result.stderr
    assert digest(checkpoint) == before


@pytest.mark.parametrize("flags,message", [
    (["--tp-size", 4, "--tp-rank", 0, "--ep-size", 3], "--ep-size 3 does not divide --tp-size 4"),
    (["--tp-size", 6, "--tp-rank", 0, "--ep-size", 3], "16 routed experts are not divisible by --ep-size 3"),
    (["--tp-size", 4, "--tp-rank", 4], "--tp-rank 4 is outside 0..3"),
    (["--tp-size", 32, "--tp-rank", 0, "--tp-slice", "on"], "is not divisible by the MoE TP size 32"),
])
def test_layout_that_does_not_fit_is_refused(tiny_checkpoint, tmp_path, flags, message):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = rankfs("mount", tiny_checkpoint, mountpoint, *flags, "--log", tmp_path / "log", check=False)
    assert result.returncode in (1, 32) and message in result.stderr, result.stderr
    assert kernel.find_mount(mountpoint) is None


def test_symlink_outside_the_checkpoint_is_refused_unless_allowed(tiny_checkpoint, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, checkpoint)
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of the model")
    (checkpoint / "notes.txt").symlink_to(secret)
    result = rankfs("plan", checkpoint, "--tp-size", 1, check=False)
    assert result.returncode == 1 and "notes.txt" in result.stderr and "outside the checkpoint" in result.stderr
    assert "profile deepseek-v4" in rankfs("plan", checkpoint, "--tp-size", 1, "--allow-outside-symlinks").stdout


# -- fuzzing the header parser against safetensors ------------------------------------------------

def safetensors_accepts(data: bytes) -> bool:
    from safetensors import deserialize
    try:
        deserialize(data)
        return True
    except Exception:
        return False


def check_against_safetensors(data: bytes):
    if len(data) < 8:
        return
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        return  # read_header refuses before parsing; covered by the cases above
    try:
        parse_header("fuzz.safetensors", data[8:8 + n], len(data))
    except HeaderError:
        return
    assert safetensors_accepts(data), data[:200]


def valid_file(entries, metadata=None) -> bytes:
    header = encode_header(entries, metadata)
    return header + bytes(entries[-1][4] if entries else 0)


dtypes = st.sampled_from(["U8", "I8", "F8_E4M3", "F8_E8M0", "BF16", "F16", "F32", "I32", "I64", "BOOL", "F64"])


@st.composite
def tensor_tables(draw):
    count = draw(st.integers(0, 5))
    entries, offset = [], 0
    sizes = {"U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E8M0": 1, "BOOL": 1, "BF16": 2, "F16": 2, "F32": 4, "I32": 4,
             "I64": 8, "F64": 8}
    for i in range(count):
        dtype = draw(dtypes)
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        n = sizes[dtype]
        for d in shape:
            n *= d
        entries.append((f"t{i}", dtype, shape, offset, offset + n))
        offset += n
    return entries


json_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**65) | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(tensor_tables(), st.data())
def test_fuzz_mutated_headers_never_accepted_where_safetensors_refuses(entries, data):
    file = bytearray(valid_file(entries, data.draw(st.none() | st.just({"format": "pt"}))))
    assert safetensors_accepts(bytes(file))
    check_against_safetensors(bytes(file))
    (n,) = struct.unpack("<Q", file[:8])
    header = json.loads(file[8:8 + n])
    choice = data.draw(st.integers(0, 3))
    if choice == 0 and len(file) > 8:  # flip bytes anywhere
        for _ in range(data.draw(st.integers(1, 4))):
            position = data.draw(st.integers(0, len(file) - 1))
            file[position] = data.draw(st.integers(0, 255))
        check_against_safetensors(bytes(file))
        return
    if choice == 1 and header:  # replace a field with any JSON value
        key = data.draw(st.sampled_from(sorted(header)))
        if isinstance(header[key], dict) and header[key]:
            field = data.draw(st.sampled_from(sorted(header[key])))
            header[key][field] = data.draw(json_values)
        else:
            header[key] = data.draw(json_values)
    elif choice == 2:  # add an entry of any shape
        header[data.draw(st.text(max_size=6))] = data.draw(json_values)
    raw = json.dumps(header).encode()
    tail = data.draw(st.integers(-2, 2))
    body = bytes(max(0, len(file) - 8 - n + tail))
    check_against_safetensors(struct.pack("<Q", len(raw)) + raw + body)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64))
def test_fuzz_random_bytes_never_crash_the_parser(blob):
    try:
        parse_header("fuzz.safetensors", blob, len(blob) + 8)
    except CheckpointError:
        pass
