"""Errors that planning raises; each names the file (or the layout) and the problem."""

from __future__ import annotations

import os


class CheckpointError(ValueError):
    """A checkpoint rankfs cannot serve correctly. The message names the file and the problem."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path = str(path)
        self.problem = problem


class LayoutError(ValueError):
    """A rank layout that does not fit the checkpoint (or is inconsistent in itself)."""
