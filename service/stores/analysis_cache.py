"""Prompt analyses by the hash of their recording: in Redis with a TTL when configured (shared by replicas), else an LRU
in this process."""

from __future__ import annotations

import io
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import redis

from service.stores.redis_client import redis_client
from service.stores.voices import PromptFeatures

REDIS_ANALYSIS_PREFIX = "tts:prompt-analysis:"
_REDIS_TIMEOUT_S = 0.5


class AnalysisCache:
    """Prompt features by the hash of the audio (and the analysing models and mel variant): in Redis with a
    TTL when configured, shared by replicas, else an LRU of `capacity` entries in this process. Failures of
    Redis only cost a re-analysis."""

    def __init__(self, redis_url: str | None, *, capacity: int = 64, ttl_s: int = 86_400) -> None:
        self._client = redis_client(redis_url, _REDIS_TIMEOUT_S) if redis_url else None
        self._ttl_s = ttl_s
        self._capacity = capacity
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> PromptFeatures | None:
        blob = self._read(key)
        if blob is None:
            return None
        try:
            with np.load(io.BytesIO(blob), allow_pickle=False) as npz:
                meta = json.loads(bytes(npz["meta"]).decode("utf-8"))
                return PromptFeatures.from_arrays(npz, meta["duration_s"], meta["mel_variant"])
        except (OSError, ValueError, KeyError):
            return None

    def put(self, key: str, features: PromptFeatures) -> None:
        meta = json.dumps({"duration_s": features.duration_s, "mel_variant": features.mel_variant}).encode("utf-8")
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(meta, dtype=np.uint8), **features.to_arrays())
        blob = buf.getvalue()
        if self._client is not None:
            try:
                self._client.set(REDIS_ANALYSIS_PREFIX + key, blob, ex=self._ttl_s)
                return
            except redis.RedisError:
                pass  # fall through to this process's LRU
        with self._lock:
            self._memory[key] = blob
            self._memory.move_to_end(key)
            while len(self._memory) > self._capacity:
                self._memory.popitem(last=False)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()

    def _read(self, key: str) -> bytes | None:
        if self._client is not None:
            try:
                blob: Any = self._client.get(REDIS_ANALYSIS_PREFIX + key)
                if blob is not None:
                    return bytes(blob)
            except redis.RedisError:
                pass
        with self._lock:
            found = self._memory.get(key)
            if found is not None:
                self._memory.move_to_end(key)
            return found
