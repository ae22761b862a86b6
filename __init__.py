"""rankfs: a FUSE filesystem that serves each inference-engine rank a virtual checkpoint holding only
the tensors it loads (its experts, pre-sliced), and a hook that loads them at the disk's speed.

    import rankfs
    with rankfs.mount(checkpoint, mountpoint, tp_size=4, tp_rank=0, ep_size=1) as mnt:
        mnt.status()

`rankfs.mount` and `rankfs.attach` are rankfs.mount.api's (the types and errors are there too); the
engine hook is rankfs.loader. Importing the package imports nothing heavy: the hook's start-up path
in every engine process goes through it.
"""



def __getattr__(name: str):
    """`rankfs.mount`, imported when first asked for: the hook's processes never need it."""
    if name == "mount":
        import importlib
        return importlib.import_module("rankfs.mount")
    raise AttributeError(f"module 'rankfs' has no attribute {name!r}")


def attach(path):
    """A live mount already there: rankfs.mount.api.attach."""
    from rankfs.mount.api import attach as attach_mount
    return attach_mount(path)


__all__ = ["attach", "mount"]
