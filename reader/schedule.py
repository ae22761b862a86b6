"""The order prefetch follows: each view's files as the loaders open them, each file's chunks in the
order the loaders consume its tensors (sorted names, not file offsets)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankfs.reader.chunks import CHUNK_BYTES, Chunk

# More than the kernel reads around a header at a readahead of up to 16 MiB: a file whose
# requests were answered with this much is being consumed.
CONSUMING_BYTES = 3 * CHUNK_BYTES
# One chunk of source bytes in this many is pushed with its first page left out: the loader's read of
# that page (a request it waits on) tells the engine how far it has consumed the file. The chunks
# between are passed once the loader asks for a later one (`FileStream.passed`).
SIGNAL_EVERY_CHUNKS = 8


@dataclass
class FileStream:
    """One virtual file's prefetchable chunks in the loaders' consumption order. Loaders read
    several files at once (SGLang's iterator eight), each in its own order, so each file has its
    own prefetch cursor and its own frontier: the loader has read every chunk before it, at least
    in part (fill needs no reading). Not the furthest position read: the kernel reads around each
    tensor's first page as safetensors lists them, chunks the loaders need last among them."""

    view: "ViewStream"
    chunks: list[Chunk]
    cursor: int = 0
    frontier: int = 0
    handles: int = 0  # open file handles
    direct_handles: int = 0  # of them, opened with O_DIRECT: their reads never look in the page cache
    reading: bool = False  # read since it was opened
    requested_bytes: int = 0  # source bytes a loader's requests were answered with since then
    reached: int = 0  # the furthest stream position a loader asked for
    dropped: bool = False  # its pages were dropped from the page cache once the loader was done
    listed: bool = False  # the pages a listing reads were pushed, at or before its first open (a drop leaves them out)

    def passed(self, chunk: Chunk) -> bool:
        """A loader is past a chunk of this file: it read some of it, or there is nothing for it to
        read (fill), or it was pushed and the loader has asked for a later chunk (a signal page the
        listing pushed is never asked for)."""
        return chunk.requested or chunk.fill or (chunk.pushed and chunk.stream_pos < self.reached)

    def take_listing(self, pushing: bool) -> bool:
        """Whether the pages a listing of it reads are to be pushed now: pushes on, not pushed yet,
        no engine hook loading its view. From now on they count as pushed."""
        push = pushing and not self.listed and not self.view.hooked
        self.listed = self.listed or push
        return push

    def not_dropped(self) -> list[Chunk]:
        """Its chunks whose pages were not dropped since it was last read from its start; from now
        on, all were."""
        dropped, self.dropped = self.dropped, True
        return [] if dropped else self.chunks

    def lead(self) -> int:
        return self.cursor - self.frontier

    def advance(self) -> bool:
        """Move the frontier past the chunks a loader has read, and the cursor with it (nothing to
        read ahead where the loader has been); whether it moved."""
        start = self.frontier
        while self.frontier < len(self.chunks) and self.passed(self.chunks[self.frontier]):
            self.frontier += 1
        self.cursor = max(self.cursor, self.frontier)
        return self.frontier != start

    @property
    def read_direct(self) -> bool:
        """Its readers read past the page cache (runai-model-streamer, InstantTensor's direct
        backends): only O_DIRECT handles hold it open, or, with none open, the view's latest open
        was one. A push into its page cache would only cost the daemon's CPU and the kernel's memory."""
        if self.handles:
            return self.handles == self.direct_handles
        return self.view.opened_direct

    @property
    def consuming(self) -> bool:
        """A loader reads its tensors, not only the header and the kernel's read-around."""
        return self.reading and self.requested_bytes >= CONSUMING_BYTES

    @property
    def consumed_some(self) -> bool:
        """A loader read its tensors, by requests or from pushed pages (its frontier is past more
        than a header's read-around)."""
        return self.consuming or self.frontier * CHUNK_BYTES > CONSUMING_BYTES


@dataclass
class ViewStream:
    """One view: its files in the order the loaders open them."""

    name: str
    files: list[FileStream] = field(default_factory=list)
    active: bool = False  # a file of the view has been read
    running: bool = False  # a prefetch pass is under way
    hooked: bool = False  # an engine hook loads it from the sources: not prefetched
    opened_direct: bool = False  # its latest file open was with O_DIRECT
    direct_opener: int | None = None  # the latest process to open one of its files with O_DIRECT
    passes: int = 0
    planned_bytes: int = 0
    served_bytes: int = 0
    reader_bytes: int = 0  # of them, served since its current reader began (the last restart)
    reader: int | None = None  # the process reading it: the first to open a file since the last one exited

    @classmethod
    def of(cls, name: str, files_chunks: list[list[Chunk]]) -> "ViewStream":
        """A view's stream from its files' chunks (of source bytes and of fill), files in the view's
        order. On-demand chunks (row stores) are left to demand reads."""
        stream = cls(name)
        for chunks in files_chunks:
            prefetchable = sorted((c for c in chunks if not c.on_demand), key=lambda c: c.order)
            file = FileStream(stream, prefetchable)
            data = 0
            for pos, chunk in enumerate(prefetchable):
                chunk.place(file, pos, signal=not chunk.fill and data % SIGNAL_EVERY_CHUNKS == 0)
                data += not chunk.fill
            stream.files.append(file)
            stream.planned_bytes += sum(c.length for c in prefetchable if not c.fill)
        return stream

    def _next_file(self) -> FileStream | None:
        """Where to prefetch next: the file being consumed that the prefetcher is least ahead in
        (several, for loaders that read files in parallel), else the first file not prefetched to
        its end. A file whose header alone was read (opened ahead of its turn) is not being
        consumed: it would take its share of the read-ahead from the one that is."""
        consuming = [f for f in self.files if f.consuming and f.cursor < len(f.chunks)]
        candidates = consuming or [f for f in self.files if f.cursor < len(f.chunks)][:1]
        return min(candidates, key=FileStream.lead) if candidates else None

    def next_chunks(self, nbytes: int, this_pass: int) -> tuple[list[Chunk], bool]:
        """The next chunks to read ahead in one go, each from the file `_next_file` picks, `nbytes` at most (one
        larger alone); and whether the pass `this_pass` is done (ended, or nothing left). Fill, and
        chunks the loader read or that are in memory or being read, are passed over: a pass offers
        each chunk once (a file's cursor only moves on)."""
        chunks, taken = [], 0
        while True:
            file = self._next_file() if self.passes == this_pass else None
            if file is None:
                return chunks, True
            chunk = file.chunks[file.cursor]
            wanted = not (chunk.fill or chunk.requested or chunk.buffer is not None or chunk.loading is not None
                          or chunk.handed_bytes >= chunk.length)
            if wanted and chunks and taken + chunk.length > nbytes:
                return chunks, False  # left for the next group
            file.cursor += 1
            if wanted:
                chunks.append(chunk)
                taken += chunk.length

    def prefetched(self) -> bool:
        """Whether every file was prefetched, or read, to its end."""
        return all(f.cursor >= len(f.chunks) for f in self.files)

    def new_reader(self):
        """Another process reads it now: not taken for the last one's hook (its own, if it has one,
        says so again), and its listings are pushed again, their pages maybe gone (a drop, which
        `restart` serves too, leaves them out: a look at the files after it must not refill the
        page cache)."""
        self.hooked = False
        for file in self.files:
            file.listed = False

    def restart(self):
        """A view read again after a drop, or by a new reader (another engine, a restart), is
        prefetched from its start, once that reader has read PREFETCH_AFTER_BYTES."""
        self.running, self.passes, self.reader_bytes = False, self.passes + 1, 0  # ends the pass under way
        for file in self.files:
            file.cursor, file.frontier, file.reading, file.requested_bytes, file.reached = 0, 0, False, 0, 0
            file.dropped = False
            for chunk in file.chunks:
                chunk.restart()
