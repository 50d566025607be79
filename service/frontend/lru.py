"""A small thread-safe LRU cache with hit/miss counters and the time spent computing misses."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


@dataclass(frozen=True)
class CacheStats:
    """Counters since start; `miss_seconds` is the total time spent computing missed entries."""

    size: int
    capacity: int
    hits: int
    misses: int
    miss_seconds: float


class LRUCache(Generic[K, V]):
    """Least-recently-used cache; `get_or_compute` runs the computation outside the lock (duplicates are harmless)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self._capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = 0
        self._misses = 0
        self._miss_seconds = 0.0

    def get_or_compute(self, key: K, compute: Callable[[], V]) -> tuple[V, bool, float]:
        """(value, was_cached, seconds spent computing)."""
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                self._hits += 1
                return self._data[key], True, 0.0
        start = time.perf_counter()
        value = compute()
        elapsed = time.perf_counter() - start
        with self._lock:
            self._misses += 1
            self._miss_seconds += elapsed
            if self._capacity:
                self._data[key] = value
                self._data.move_to_end(key)
                while len(self._data) > self._capacity:
                    self._data.popitem(last=False)
        return value, False, elapsed

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._data), self._capacity, self._hits, self._misses, self._miss_seconds)
