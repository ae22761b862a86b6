"""The lightest loader there is, for the tests under memory limits: every tensor of every shard of a
directory, in the loaders' order (files and names sorted), hashed and dropped, nothing kept. With
--hook it loads through the rankfs hook and releases at the end.

    python3 tests/hash_loader.py DIRECTORY [--hook]

Prints one JSON line: {tensor: sha256} and the bytes the process read from the disk."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys

import torch
from safetensors import safe_open


def main(directory: str, hook: bool):
    if hook:
        import rankfs.loader
        rankfs.loader.activate("on")
    digests = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                tensor = f.get_tensor(name)
                digests[name] = hashlib.sha256(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()
                del tensor
    if hook:
        rankfs.loader.release("target")
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    print(json.dumps({"digests": digests, "read_bytes": read}))


if __name__ == "__main__":
    main(sys.argv[1], "--hook" in sys.argv[2:])
