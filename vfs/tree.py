"""The mount's namespace: directories and files built from the rank layouts.

    MOUNTPOINT/target/           one rank: its views at the top
    MOUNTPOINT/draft/
    MOUNTPOINT/rank-R/target/    several local ranks (--local-ranks): one directory per rank,
    MOUNTPOINT/target/           and the shared view they are all started with: its shards are read
                                 only through the hook, which sends each rank to its own directory
    MOUNTPOINT/.rankfs/status.json   live figures (read by `rankfs status`)
    MOUNTPOINT/.rankfs/control       commands to the daemon (see rankfs.common.contract)
    MOUNTPOINT/.rankfs/sources/VIEW.json   where each view tensor lies in the sources (for the hook)

Every regular file is a list of extents: in-memory bytes (headers, indexes), fill (outside slices)
or source bytes in chunks the read engine loads.
"""

from __future__ import annotations

import functools
import stat
import time
from dataclasses import dataclass, field
from typing import Callable

import trio

from rankfs.common import contract
from rankfs.common.disk import align_down, align_up
from rankfs.plan.checkpoint import INDEX_NAME
from rankfs.plan.extents import Extent, tensors_at
from rankfs.plan.layout import RankLayout, View, index_json, sources_json
from rankfs.reader.chunks import ChunkRun, listing_pages, overlapping, split_extent
from rankfs.reader.engine import ReadEngine
from rankfs.reader.schedule import FileStream

ROOT_INODE = 1


@dataclass
class Content:
    """What a regular file holds: its bytes as extents; data extents carry their chunks."""

    size: int
    extents: list[Extent]
    memory: bytes = b""  # the bytes of "header" extents (at the file's start)
    runs: dict[int, ChunkRun] = field(default_factory=dict)  # data extent offset -> its chunks
    stream: FileStream | None = None  # for virtual shards
    path: str = ""  # in the mount, for messages: "target/model-00001-of-00048.safetensors"
    listing: list[int] = field(default_factory=list)  # pages a safetensors listing reads (`listing_pages`)
    tensor_starts: list[int] = field(default_factory=list)  # where each tensor starts in the file, for messages
    tensor_names: list[str] = field(default_factory=list)

    def __post_init__(self):
        self._starts = [e.offset for e in self.extents]

    def tensors_at(self, offset: int, end: int) -> str:
        """The tensors with bytes in [offset, end), for messages: 'a', 'b'."""
        return tensors_at(self.tensor_starts, self.tensor_names, offset, end)

    def extents_at(self, offset: int, end: int):
        return overlapping(self.extents, self._starts, offset, end)


class LazyView:
    """A view's virtual shards, as content. Laid out once the mount is ready, a file at a time
    between requests (`lay_out`), or at once by an open of one of them that comes sooner: a 48-shard
    view takes a second, which neither the mount nor a load's first opens should wait for."""

    def __init__(self, directory: str, view: View, engine: ReadEngine):
        self.directory, self.view, self.engine = directory, view, engine
        self.inodes: list[int] = []  # of its files, by position
        self._built: list[tuple[Content, list]] = []  # files laid out so far: content, chunks
        self._contents: list[Content] | None = None  # once every file is, and the view registered

    def content(self, position: int) -> Content:
        if self._contents is None:
            while self._build_next():
                pass
            self._register()
        return self._contents[position]

    async def lay_out(self):
        while self._contents is None and self._build_next():
            await trio.sleep(0)  # a request waits for one file's layout at most
        if self._contents is None:
            self._register()

    def _build_next(self) -> bool:
        """Lay out the next file; False once every file is."""
        position = len(self._built)
        if position == len(self.view.files):
            return False
        vfile, inode = self.view.files[position], self.inodes[position]
        extents = vfile.extents()
        runs = {e.offset: ChunkRun(e, file_id=inode) for e in extents if e.kind == "data"}
        for before, extent, after in zip([None, *extents], extents, [*extents[1:], None]):
            if extent.kind == "data":
                run = runs[extent.offset].chunks
                run[0].set_fill_edges(before=_fills(before, align_down(extent.offset), extent.offset))
                run[-1].set_fill_edges(after=_fills(after, extent.end, align_up(extent.end)))
        # Fill is served from memory, never from chunks; its chunks only mark its place in the stream.
        chunks = [c for run in runs.values() for c in run.chunks]
        chunks += [c for e in extents if e.kind == "fill" for c in split_extent(e, file_id=inode)]
        path = f"{self.directory}/{vfile.name}"
        self.engine.trace.file(inode, path)
        listing = listing_pages(len(vfile.header), [t.offset for t in vfile.tensors])
        content = Content(vfile.size, extents, vfile.header, runs, path=path, listing=listing,
                          tensor_starts=[t.offset for t in vfile.tensors], tensor_names=[t.name for t in vfile.tensors])
        self._built.append((content, chunks))
        return True

    def _register(self):
        self._contents = [content for content, _ in self._built]
        streams = self.engine.add_view(self.directory, [chunks for _, chunks in self._built])
        for content, stream in zip(self._contents, streams):
            content.stream = stream
        self._built = []


def _fills(extent: Extent | None, lo: int, hi: int) -> bool:
    """Bytes [lo, hi) of a file lie in this extent of fill."""
    return extent is not None and extent.kind == "fill" and extent.offset <= lo and hi <= extent.end


@dataclass
class Node:
    inode: int
    name: str
    parent: int
    mtime_ns: int
    children: dict[str, int] | None = None  # directories
    file: Content | None = None  # regular files with fixed content
    shard: tuple[LazyView, int] | None = None  # virtual shards: their view and position in it
    render: Callable[[], bytes] | None = None  # generated files (status)
    command_mode: int = 0  # the control file: written, never read

    @property
    def is_dir(self) -> bool:
        return self.children is not None

    @property
    def mode(self) -> int:
        if self.command_mode:
            return stat.S_IFREG | self.command_mode
        return (stat.S_IFDIR | 0o555) if self.is_dir else (stat.S_IFREG | 0o444)

    @property
    def size(self) -> int:
        if self.shard is not None:
            view, position = self.shard
            return view.view.files[position].size
        return self.file.size if self.file else 0

    def content(self) -> Content:
        if self.shard is not None:
            view, position = self.shard
            return view.content(position)
        return self.file


def memory_content(data: bytes, path: str = "") -> Content:
    return Content(len(data), [Extent(0, len(data), "header")], data, path=path)


class Tree:
    def __init__(self, layouts: list[RankLayout], engine: ReadEngine, render_status: Callable[[], bytes],
                 allow_other: bool = False,
                 shared_pages: Callable[[str], dict[int, list[tuple[int, int]]]] | None = None):
        """shared_pages(view path): {source: pages} other local ranks read too, for its sources map."""
        self.nodes: dict[int, Node] = {}
        self._shared_pages = shared_pages
        self.lazy_views: list[LazyView] = []  # one per view (of each rank), laid out after the mount is ready
        now = time.time_ns()
        root = self._add("", ROOT_INODE, now, children={})
        control = self._add(contract.CONTROL_DIR, root.inode, now, children={})
        self._add(contract.STATUS_FILE, control.inode, now, render=render_status)
        # Writable by the mount's user, and by everyone the mount lets in with --allow-other.
        self.command = self._add(contract.COMMAND_FILE, control.inode, now,
                                 command_mode=0o222 if allow_other else 0o200)
        self._sources = self._add(contract.SOURCES_DIR, control.inode, now, children={})
        for layout in layouts:
            parent = root
            if len(layouts) > 1:
                parent = self._add(f"rank-{layout.spec.tp_rank}", root.inode, now, children={})
            for view in layout.views:
                self._add_view(parent, layout, view, engine, now)
        if len(layouts) > 1:
            for name in ("target", "draft"):
                views = [v for layout in layouts for v in layout.views if v.name == name]
                if views:
                    self._add_shared_view(root, layouts[0], views, now)

    def _add(self, name: str, parent: int, mtime_ns: int, **kind) -> Node:
        inode = len(self.nodes) + ROOT_INODE
        node = Node(inode, name, parent, mtime_ns, **kind)
        self.nodes[inode] = node
        if inode != ROOT_INODE:
            self.nodes[parent].children[name] = inode
        return node

    def _add_view(self, parent: Node, layout: RankLayout, view, engine: ReadEngine, now: int):
        path = f"{parent.name + '/' if parent.inode != ROOT_INODE else ''}{view.name}"
        directory = self._add(view.name, parent.inode, now, children={})
        self._add_plain_files(directory, path, layout, view)
        self._add(INDEX_NAME, directory.inode, now, file=memory_content(view.index, f"{path}/{INDEX_NAME}"))
        lazy = LazyView(path, view, engine)
        self.lazy_views.append(lazy)
        if self._shared_pages is None:
            mapping = functools.cache(lambda: sources_json(view, layout.sources))
        else:  # what other ranks still need changes as they load
            mapping = lambda: sources_json(view, layout.sources, self._shared_pages(path))  # noqa: E731
        self._add(f"{contract.flat_name(path)}.json", self._sources.inode, now, render=mapping)
        for position, vfile in enumerate(view.files):
            node = self._add(vfile.name, directory.inode, layout.sources[vfile.source].mtime_ns,
                             shard=(lazy, position))
            lazy.inodes.append(node.inode)

    def _add_plain_files(self, directory: Node, path: str, layout: RankLayout, view):
        for name, source_index in view.plain_files:
            source = layout.sources[source_index]
            extent = Extent(0, source.size, "data", source_index, 0, tensor=name, on_demand=True)
            content = Content(source.size, [extent], path=f"{path}/{name}")
            content.runs[0] = ChunkRun(extent)
            self._add(name, directory.inode, source.mtime_ns, file=content)

    def _add_shared_view(self, root: Node, layout: RankLayout, views: list, now: int):
        """The directory every local rank is started with: the union of their shard names and an
        index to match. Its shards refuse reads (EIO): only the hook, which redirects each rank to
        rank-R/, may load them; read directly they would give one rank another rank's bytes."""
        name = views[0].name
        directory = self._add(name, root.inode, now, children={})
        self._add_plain_files(directory, name, layout, views[0])
        self._add(INDEX_NAME, directory.inode, now, file=memory_content(index_json(views), f"{name}/{INDEX_NAME}"))
        sizes: dict[str, int] = {}
        for view in views:
            for vfile in view.files:
                sizes.setdefault(vfile.name, vfile.size)
        for file_name, size in sorted(sizes.items()):
            content = Content(size, [Extent(0, size, "shared", tensor=file_name)], path=f"{name}/{file_name}")
            self._add(file_name, directory.inode, now, file=content)

    def lookup(self, parent: int, name: str) -> Node | None:
        node = self.nodes.get(parent)
        inode = node.children.get(name) if node and node.is_dir else None
        return self.nodes.get(inode) if inode else None

    def files(self):
        return [n for n in self.nodes.values() if not n.is_dir]
