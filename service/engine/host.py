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


_M_ARENA_MAX = -8  # glibc mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3


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


def tune_malloc(arenas: int, mmap_threshold: int = 0) -> None:
    """Set glibc malloc for a process of few, large, short-lived blocks (no-op elsewhere; 0 leaves a default).

    `arenas` caps the per-thread arenas (default 8 x cores): every thread that allocates (service workers, ORT pools)
    otherwise gets its own, and each keeps its freed pages: under 8 concurrent streams they cost ~150 MB resident.
    `mmap_threshold` (bytes) fixes the size from which a block is mapped on its own and unmapped when freed. glibc's
    default slides up to the largest block freed so far (up to 32 MB), after which a prefill's or a flow call's
    megabytes come from the heap and stay there, freed but resident, until the request ends: 80-120 MB at the peak of
    a full-size stream with a 10 s voice (docs/perf-log.md). A fixed threshold unmaps them, and they are faulted in
    again by the next call: ~2 % slower at 4 MiB (RuntimeOptions.mmap_threshold sets it under a memory limit).
    """
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return
    if arenas > 0:
        mallopt(_M_ARENA_MAX, arenas)
    if mmap_threshold > 0:
        mallopt(_M_MMAP_THRESHOLD, mmap_threshold)


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise); no-op elsewhere."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPU cores this process may use: its affinity, or fewer under a cgroup CPU quota (cpu.max, or in cgroup v1
    cpu.cfs_quota_us / cpu.cfs_period_us); at least 1."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = _cpu_quota(cgroup_root)
    return max(1, min(cores, quota) if quota is not None else cores)


def _cpu_quota(root: str) -> int | None:
    """Whole cores of the root cgroup's CPU quota (a container's), None without one."""
    for path, period_path in ((f"{root}/cpu.max", None), (f"{root}/cpu/cpu.cfs_quota_us", f"{root}/cpu/cpu.cfs_period_us")):
        try:
            with open(path, encoding="ascii") as f:
                fields = f.read().split()
            if period_path is not None:
                with open(period_path, encoding="ascii") as f:
                    fields.append(f.read().strip())
        except OSError:
            continue
        if len(fields) >= 2 and fields[0].lstrip("-").isdigit() and int(fields[0]) > 0 and fields[1].isdigit():
            return max(1, int(fields[0]) // max(1, int(fields[1])))
    return None


def released_after(chunks: Iterator[T]) -> Iterator[T]:
    """The chunks of one request; once it ends (done, failed, cancelled or dropped), freed heap goes back to the OS.

    Without it glibc keeps the pages of each request's freed activations: the resident size stays 20-100 MB per
    finished request higher (tiny bundles) and creeps up. The trim (~5 ms) runs after the last chunk was handed over.
    """
    try:
        yield from chunks
    finally:
        release_free_memory()
