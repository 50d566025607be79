"""Memory pages for caches that grow in place: anonymous mappings that take memory only once written, and memory files
whose pages many caches map copy-on-write, so that caches which start with the same frames keep them once.

A cache that continues from a shared start (a voice's prompt state, the same for every request of the voice) maps the
file's whole pages over the start of its own mapping (MAP_FIXED | MAP_PRIVATE): it reads the shared pages, and a page
it writes becomes its own (the kernel copies that one page). The file lives while any mapping of it does.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
import threading
from typing import Any

PAGE = mmap.PAGESIZE
# Python's mmap module names MAP_NORESERVE from 3.13; 0x4000 is Linux's value (elsewhere: no flag, pages reserved)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
_MAP_FIXED = 0x10  # Linux's value: replace what is mapped at the address (only inside a mapping we own)
_MAP_FAILED = ctypes.c_void_p(-1).value


def anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (at least one page): no swap reserved, no memory until written, unmapped
    when the object is released."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)


def address(region: mmap.mmap) -> int:
    """The first byte's address of a mapping (the buffer export is released at once)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


@functools.cache
def _libc_mmap() -> Any:
    """libc's mmap with its signature, or None where it cannot be called (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).mmap
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_void_p
    call.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    return call


def sharing_works() -> bool:
    """Whether memory files and fixed copy-on-write mappings are available here (Linux)."""
    return hasattr(os, "memfd_create") and _libc_mmap() is not None


class SharedPages:
    """`nbytes` (rounded up to whole pages) in a memory file, written once through `region`, then mapped copy-on-write
    by any number of caches (`map_over`). `users` counts the mappings that still exist; the file's memory is freed when
    this object and every such mapping are gone (the kernel counts the mappings too)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = -(-max(nbytes, 1) // PAGE) * PAGE
        fd = os.memfd_create("cosyvoice-lite-shared", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.nbytes)
            self.region = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._lock = threading.Lock()
        self.users = 0

    def map_over(self, target: mmap.mmap, target_offset: int, file_offset: int, length: int) -> None:
        """Replace `length` bytes of `target` at `target_offset` by a copy-on-write view of this file at `file_offset`
        (all three page-aligned, inside both); the view goes when `target` is unmapped."""
        if min(target_offset, file_offset, length) < 0 or (target_offset | file_offset | length) % PAGE:
            raise ValueError("offsets and length must be whole pages")
        if target_offset + length > len(target) or file_offset + length > self.nbytes:
            raise ValueError("the view must lie inside the mapping and the file")
        if length == 0:
            return
        call = _libc_mmap()
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | _MAP_FIXED
        got = call(address(target) + target_offset, length, prot, flags, self._fd, file_offset)
        if got is None or got == _MAP_FAILED:
            raise OSError(ctypes.get_errno(), "mmap of shared pages failed")

    def attach(self) -> None:
        """Count one more cache that maps these pages (`detach` when it is gone)."""
        with self._lock:
            self.users += 1

    def detach(self) -> None:
        with self._lock:
            self.users -= 1

    def __del__(self) -> None:
        fd = getattr(self, "_fd", -1)
        if fd >= 0:
            os.close(fd)
