"""The order prefetch follows: each view's files as the loaders open them, each file's chunks in the
order the loaders consume its tensors (sorted names, not file offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankfs.reader.chunks import Chunk


@dataclass
class FileStream:
    """One virtual file's prefetchable chunks in the loaders' consumption order. Loaders read
    several files at once (SGLang's iterator eight), each in its own order, so each file has its
    own prefetch cursor and its own frontier: the furthest position the loader has read."""

    view: "ViewStream"
    chunks: list[Chunk]
    cursor: int = 0
    frontier: int = -1
    handles: int = 0  # open file handles
    reading: bool = False  # read since it was opened: a loader is consuming it

    def lead(self) -> int:
        return self.cursor - self.frontier


@dataclass
class ViewStream:
    """One view: its files in the order the loaders open them."""

    name: str
    files: list[FileStream] = field(default_factory=list)
    active: bool = False  # a file of the view has been read
    running: bool = False  # a prefetch pass is under way
    hooked: bool = False  # an engine hook loads it from the sources: not prefetched
    passes: int = 0
    planned_bytes: int = 0
    served_bytes: int = 0

    @classmethod
    def of(cls, name: str, files_chunks: list[list[Chunk]]) -> "ViewStream":
        """A view's stream from its files' chunks, files in the view's order. On-demand chunks (row
        stores) are left to demand reads."""
        stream = cls(name)
        for chunks in files_chunks:
            prefetchable = sorted((c for c in chunks if not c.on_demand), key=lambda c: c.order)
            file = FileStream(stream, prefetchable)
            for pos, chunk in enumerate(prefetchable):
                chunk.stream_pos, chunk.file = pos, file
            stream.files.append(file)
            stream.planned_bytes += sum(c.length for c in prefetchable)
        return stream

    def next_chunk(self) -> Chunk | None:
        """What to prefetch next: in the open file the prefetcher is least ahead in, else in the
        first file not read yet (loaders that open one file at a time)."""
        being_read = [f for f in self.files if f.reading and f.cursor < len(f.chunks)]
        candidates = being_read or [f for f in self.files if f.cursor < len(f.chunks)][:1]
        if not candidates:
            return None
        file = min(candidates, key=FileStream.lead)
        file.cursor += 1
        return file.chunks[file.cursor - 1]

    def restart(self):
        """A view read again after a drop (another engine, a restart) is prefetched from its start."""
        self.running, self.passes = False, self.passes + 1  # ends the pass under way
        for file in self.files:
            file.cursor, file.frontier, file.reading = 0, -1, False
            for chunk in file.chunks:
                chunk.served = 0
