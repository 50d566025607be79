"""What the engine asks of the operating system: lower thread priority, and glibc malloc's arenas and trimming."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def lower_thread_priority(nice: int) -> None:
    """Raise the calling OS thread's niceness to at least `nice` (never lowers it; no-op off Linux)."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    tid = threading.get_native_id()
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:  # not permitted in this sandbox: run at normal priority
        return


_M_ARENA_MAX = -8  # glibc mallopt parameter number (malloc.h)


@functools.cache
def _glibc_function(name: str) -> Callable[..., int] | None:
    """A glibc malloc function, looked up once (find_library runs `ldconfig` in a subprocess); None elsewhere."""
    path = ctypes.util.find_library("c")
    if path is None:
        return None
    try:
        function: Callable[..., int] = getattr(ctypes.CDLL(path), name)
    except (OSError, AttributeError):
        return None
    return function


def limit_malloc_arenas(arenas: int) -> None:
    """Cap glibc's per-thread malloc arenas for this process (0: leave the default, 8 x cores; no-op elsewhere).

    Every thread that allocates (service workers, ORT pools) otherwise gets its own arena, and each keeps
    its freed pages: under 8 concurrent streams the default arenas cost ~150 MB of resident memory.
    """
    mallopt = _glibc_function("mallopt") if arenas > 0 else None
    if mallopt is not None:
        mallopt(_M_ARENA_MAX, arenas)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); no-op elsewhere."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


def released_after(chunks: Iterator[T]) -> Iterator[T]:
    """The chunks of one request; once it ends (done, failed, cancelled or dropped), freed heap goes back to the OS.

    Without it glibc keeps the pages of each request's freed activations: the resident size stays 20-100 MB per
    finished request higher (tiny bundles) and creeps up. The trim (~5 ms) runs after the last chunk was handed over.
    """
    try:
        yield from chunks
    finally:
        release_free_memory()
