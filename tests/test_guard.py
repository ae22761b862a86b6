"""The stand-in for a sliced expert: narrowing inside the rank's slice gives the resident bytes
(the engines' `narrow`, slicing, negative offsets); anything else names the tensor and refuses."""

from __future__ import annotations

import pytest
import torch

from rankfs.loader.guard import SlicedTensor, SliceMismatch


@pytest.fixture
def full():
    return torch.arange(8 * 6, dtype=torch.int32).reshape(8, 6)


@pytest.mark.parametrize("dim", [0, 1])
def test_narrowing_inside_the_slice_gives_the_resident_bytes(full, dim):
    stop = full.shape[dim]
    sliced = SlicedTensor("w", full.shape, full.dtype, dim, stop // 2, stop, full.narrow(dim, stop // 2, stop // 2))
    assert sliced.shape == full.shape and type(sliced.narrow(dim, stop // 2, 2)) is torch.Tensor
    assert torch.equal(sliced.narrow(dim, stop // 2, stop // 2), full.narrow(dim, stop // 2, stop // 2))
    assert torch.equal(sliced.narrow(dim - 2, -2, 2), full.narrow(dim, stop - 2, 2))  # negative dim and start
    assert torch.equal(torch.narrow(sliced, dim, stop // 2 + 1, 1), full.narrow(dim, stop // 2 + 1, 1))
    index = (slice(stop // 2, stop),) if dim == 0 else (slice(None), slice(stop // 2, stop))
    assert torch.equal(sliced[index], full[index])


def test_anything_outside_the_slice_names_the_tensor(full):
    sliced = SlicedTensor("layers.0.w1", full.shape, full.dtype, 0, 4, 8, full[4:])
    for touch in (lambda: sliced.narrow(0, 2, 4), lambda: sliced.narrow(1, 0, 3), lambda: sliced[:2],
                  lambda: sliced + 1, lambda: sliced.clone()):
        with pytest.raises(SliceMismatch, match=r"tensor 'layers\.0\.w1' holds only \[4:8\) of dim 0"):
            touch()
