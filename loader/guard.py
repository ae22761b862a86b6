"""A full-shape stand-in for a tensor of which only this rank's slice is resident.

rankfs serves sliced expert tensors with their full declared shape (the engines compute the slice
offset from it) and fill bytes outside the slice. Through the hook, `get_tensor` returns this
stand-in instead: `narrow` (or slicing) inside the rank's slice along the sliced dim gives the real
bytes; anything else raises with the tensor's name, so an engine whose layout differs fails its boot
instead of loading fill.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


class SliceMismatch(RuntimeError):
    pass


class SlicedTensor(torch.Tensor):
    __torch_function__ = torch._C._disabled_torch_function_impl  # straight to __torch_dispatch__

    @staticmethod
    def __new__(cls, name: str, shape, dtype, dim: int, start: int, stop: int, resident: torch.Tensor):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=resident.device)
        self.rankfs_name, self.rankfs_dim, self.rankfs_start, self.rankfs_stop = name, dim, start, stop
        self.rankfs_resident = resident
        return self

    def __repr__(self):
        return (f"SlicedTensor({self.rankfs_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"resident dim {self.rankfs_dim} [{self.rankfs_start}:{self.rankfs_stop}))")

    def _refuse(self, what: str):
        raise SliceMismatch(
            f"rankfs: tensor {self.rankfs_name!r} holds only [{self.rankfs_start}:{self.rankfs_stop}) "
            f"of dim {self.rankfs_dim} (shape {tuple(self.shape)}), the slice this rank's layout "
            f"needs; the loader asked for {what}. The engine narrows differently from the mount's "
            "--tp-size/--ep-size/--tp-slice: remount with the engine's layout or --tp-slice off.")

    def narrow(self, dim, start, length):
        """The engines' loaders take their slice with this, once per expert tensor on the loop the
        load waits for: the resident bytes at once, without the dispatcher's round trip."""
        if all(type(x) is int for x in (dim, start, length)):
            dim = dim % self.dim()
            start = start + self.shape[dim] if start < 0 else start
            if dim == self.rankfs_dim and self.rankfs_start <= start and 0 <= length <= self.rankfs_stop - start:
                return self.rankfs_resident.narrow(dim, start - self.rankfs_start, length)
        return super().narrow(dim, start, length)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        self = next(a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, SlicedTensor))
        if func is aten.slice.Tensor:
            dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
            dim = dim % self.dim()
            size = self.shape[dim]
            start = 0 if start is None else (start + size if start < 0 else start)
            end = size if end is None else min(size, end + size if end < 0 else end)
            if dim == self.rankfs_dim and step == 1 and self.rankfs_start <= start <= end <= self.rankfs_stop:
                return self.rankfs_resident.narrow(dim, start - self.rankfs_start, end - start)
            self._refuse(f"dim {dim} [{start}:{end}:{step}]")
        if func in (aten.detach.default, aten.alias.default):
            return self
        self._refuse(f"{func} on the whole tensor")


def warm_up():
    """The first operation on a tensor subclass imports torch.distributed.tensor and sympy (half a
    second, holding the GIL): SGLang and vLLM have imported them by the time they load; for other
    programs the hook does it as it starts, not when the loader first narrows a sliced expert."""
    SlicedTensor("warm-up", (2,), torch.uint8, 0, 0, 1, torch.zeros(1, dtype=torch.uint8)).narrow(0, 0, 1)
