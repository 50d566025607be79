"""Memory pages for caches that grow in place: anonymous mappings that take memory only once written and go back to the
system when the cache is dropped."""

from __future__ import annotations

import mmap
import sys

# Python's mmap module names MAP_NORESERVE from 3.13; 0x4000 is Linux's value (elsewhere: no flag, pages reserved)
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)


def anonymous(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of `nbytes` (at least one page): no swap reserved, no memory until written, unmapped
    when the object is released."""
    return mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
