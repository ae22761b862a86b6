"""Host memory standing in for a GPU's: the hook's GPU staging (bounce buffers, uploads, device
slabs) run on a machine without one, through the seam rankfs.loader.staging.stage_on. The copies
are made at once, with the same strides the pitched CUDA copy takes."""

from __future__ import annotations

import torch

from rankfs.loader.staging import Staging
from rankfs.loader.uploads import Upload


class HostTransfer:
    def __init__(self, device: torch.device):
        self.device = device

    def copy(self, index: int, uploads: list[Upload], source: torch.Tensor, target: torch.Tensor):
        for upload in uploads:
            rows = source.as_strided((upload.height, upload.width), (upload.pitch, 1), upload.position)
            target[upload.at:upload.end].view(upload.height, upload.width).copy_(rows)

    def wait(self, index: int):
        pass

    def mark(self) -> None:
        return None


def host_staging(setting: str = "cpu") -> Staging:
    return Staging(torch.device("cpu"), HostTransfer, lambda: None, pinned=False)
