"""rankfs' own threads, named in the kernel as in Python (standard library only)."""

from __future__ import annotations

import ctypes
import threading
from typing import Callable

_PR_SET_NAME = 15
_COMM_BYTES = 15  # the kernel keeps a thread's name in 16 bytes, the last a NUL
_libc = ctypes.CDLL(None, use_errno=True)


def start_thread(target: Callable[..., object], name: str, *args) -> threading.Thread:
    """A started daemon thread running target(*args), named `name` in Python and in the kernel
    (its comm: /proc/PID/task/TID/comm, `top -H`, perf), so that rankfs' threads in an engine's
    process are told from the engine's; Python names its threads in the kernel only from 3.14."""
    thread = threading.Thread(target=_run_named, args=(name, target, args), name=name, daemon=True)
    thread.start()
    return thread


def _run_named(name: str, target: Callable[..., object], args: tuple):
    _libc.prctl(_PR_SET_NAME, name.encode()[:_COMM_BYTES], 0, 0, 0)  # fails only for a bad address
    target(*args)
