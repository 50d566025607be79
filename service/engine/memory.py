"""A memory budget for state that grows while a stream runs (a chunk-causal flow's estimator caches, say).

A streamed sentence of a family whose flow keeps every Euler step's keys and values for every frame so far grows with
each frame (2.3 MB per frame for the largest served, at full size): about 0.7 GB for a 5 s sentence, 2.4 GB for a 20 s
one. Concurrent streams add up, so a process with a
memory limit (a container's) would be killed by the OS for a burst it could have queued. `StateBudget` bounds the sum:
a stream reserves bytes before it grows and gives all of them back when it ends; one that does not fit waits until
others end, except the oldest holder, which always proceeds (so streams never wait on each other in a circle, and the
bound is exceeded at most by the oldest stream's own growth).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_WAIT_POLL_S = 0.05  # how often a waiting stream looks at its cancel test
AUTO_SHARE = 0.5  # of what the memory limit leaves after the model: the rest is for decode caches, HiFT, arenas
AUTO_FLOOR = 256 << 20  # an auto budget never goes below this (one short sentence)
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes a huge number for "no limit"


class StateBudget:
    """At most `limit` bytes reserved at once over all owners (None: no bound); thread-safe.

    `reserve(owner, n)` adds n bytes to what `owner` holds, waiting while they do not fit unless `owner` is the oldest
    holder (the first one still holding); `release(owner)` returns everything `owner` holds and wakes the waiters.
    """

    def __init__(self, limit: int | None) -> None:
        if limit is not None and limit < 0:
            raise ValueError("limit must be >= 0 (or None: no bound)")
        self.limit = limit
        self._cond = threading.Condition()
        self._held: dict[object, int] = {}  # in the order owners first reserved: the first one is the oldest
        self.used = 0
        self.waiting = 0  # owners blocked in reserve() now
        self.peak = 0

    def reserve(self, owner: object, nbytes: int, cancelled: Callable[[], bool] | None = None) -> bool:
        """Hold `nbytes` more for `owner`; False (nothing reserved) if `cancelled()` turned true while waiting."""
        with self._cond:
            if not self._fits(owner, nbytes):
                self.waiting += 1
                try:
                    while not self._fits(owner, nbytes):
                        if cancelled is not None and cancelled():
                            return False
                        self._cond.wait(_WAIT_POLL_S if cancelled is not None else None)
                finally:
                    self.waiting -= 1
            self._held[owner] = self._held.get(owner, 0) + nbytes
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def release(self, owner: object) -> None:
        """Give back everything `owner` holds (a no-op for an owner that holds nothing)."""
        with self._cond:
            self.used -= self._held.pop(owner, 0)
            self._cond.notify_all()

    def held(self, owner: object) -> int:
        with self._cond:
            return self._held.get(owner, 0)

    def _fits(self, owner: object, nbytes: int) -> bool:
        if self.limit is None or self.used + nbytes <= self.limit:
            return True
        oldest = next(iter(self._held), owner)  # nobody holding: this owner is the oldest
        return oldest is owner


def cgroup_limit_bytes(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = _CGROUP_ROOT) -> int | None:
    """The memory limit of this process's cgroup (a container's, or a `systemd-run -p MemoryMax=` scope's): the
    smallest of its own cgroup's and its parents' limits (cgroup v2 or cgroup v1); None where there is none."""
    paths = [root / "memory.max", root / "memory" / "memory.limit_in_bytes"]
    for line in _read_lines(proc_cgroup):
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2: "0::/path", at the root or under `unified` in a hybrid layout
            for base in (root, root / "unified"):
                paths += [base / part / "memory.max" for part in _ancestors(path)]
        elif "memory" in controllers.split(","):
            paths += [root / "memory" / part / "memory.limit_in_bytes" for part in _ancestors(path)]
    limits = [n for n in (_read_int(p) for p in paths) if n is not None and n < _NO_LIMIT]
    return min(limits) if limits else None


def memory_limit_bytes() -> int | None:
    """The memory this process may use: its cgroup's limit (a container's) or, without one, the machine's RAM; None
    where neither can be read (not Linux)."""
    return memory_limit(None).bytes


@dataclass(frozen=True)
class MemoryLimit:
    """The memory a server keeps to (None: none could be read) and where the figure comes from, for the log."""

    bytes: int | None
    source: str  # SETTING, CGROUP or MACHINE ("" without a figure)


SETTING, CGROUP, MACHINE = "TTS_MEMORY_LIMIT", "the cgroup's limit", "the machine's RAM"


def memory_limit(setting: int | None) -> MemoryLimit:
    """`setting` (TTS_MEMORY_LIMIT) when given; else the cgroup's limit (a container's, a systemd scope's) or the
    machine's RAM, whichever is smaller: a server on a plain 4 GB VM keeps to 4 GB as one in a 4 GB container does."""
    if setting is not None:
        return MemoryLimit(setting, SETTING)
    found = [(n, source) for n, source in ((cgroup_limit_bytes(), CGROUP), (_meminfo_total(), MACHINE)) if n is not None]
    if not found:
        return MemoryLimit(None, "")
    n, source = min(found)
    return MemoryLimit(n, source)


def resident_bytes() -> int:
    """This process's resident memory now (0 where /proc is missing)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def auto_budget(limit: int | None = None, resident: int | None = None) -> int | None:
    """The budget of `StateBudget` when none is set: AUTO_SHARE of what the memory limit (`limit`, else the cgroup's
    or the machine's) leaves after what is resident now (the loaded model), at least AUTO_FLOOR; None (no bound) when
    the limit cannot be read."""
    limit = memory_limit_bytes() if limit is None else limit
    if limit is None:
        return None
    resident = resident_bytes() if resident is None else resident
    return max(AUTO_FLOOR, int(AUTO_SHARE * (limit - resident)))


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _ancestors(path: str) -> list[str]:
    """ "/a/b" -> ["a/b", "a"]: a cgroup's own directory and its parents' (relative to the hierarchy's root)."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), 0, -1)]


def _read_lines(path: Path) -> list[str]:
    try:
        return [line for line in path.read_text().splitlines() if line.count(":") >= 2]
    except OSError:
        return []


def _meminfo_total() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


HEADROOM_SHARE = 0.1  # of the memory limit kept free of reservations
HEADROOM_FLOOR = 256 << 20  # and at least this: acoustic calls' activations and arenas, a prefill, Python's heap


def headroom_bytes(limit: int) -> int:
    """What a memory budget keeps free for what no request owns alone: the running acoustic calls' activations and
    ONNX Runtime's arenas, an LLM prefill, the HTTP and Python heap."""
    return max(HEADROOM_FLOOR, int(HEADROOM_SHARE * limit))


def stream_budget_bytes(limit: int, resident: int) -> int:
    """What requests may reserve under a memory `limit` with `resident` bytes held by the loaded models (0 or more)."""
    return max(0, limit - resident - headroom_bytes(limit))


class StreamBudget:
    """The bytes the running requests of every model of a process may hold at most (their footprints), thread-safe.

    `limit` None: no bound. `try_take(owner, n)` takes n bytes for `owner` when they fit and says whether they did
    (never waits: the caller queues the request); `release(owner)` gives back everything `owner` holds and then calls
    every `listen`er (outside the lock), so queued requests of any model may start.
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[object, int] = {}
        self._listeners: list[Callable[[], None]] = []
        self.used = 0
        self.peak = 0

    def fits(self, nbytes: int) -> bool:
        with self._lock:
            return self._fits(nbytes)

    def try_take(self, owner: object, nbytes: int) -> bool:
        with self._lock:
            if not self._fits(nbytes):
                return False
            self._held[owner] = self._held.get(owner, 0) + nbytes
            self.used += nbytes
            self.peak = max(self.peak, self.used)
            return True

    def release(self, owner: object) -> None:
        with self._lock:
            self.used -= self._held.pop(owner, 0)
            listeners = list(self._listeners)
        for listener in listeners:
            listener()

    def listen(self, listener: Callable[[], None]) -> None:
        """Call `listener` whenever reserved bytes are given back."""
        with self._lock:
            self._listeners.append(listener)

    def _fits(self, nbytes: int) -> bool:
        return self.limit is None or self.used + nbytes <= self.limit
