"""Saved voices (analysed prompt recordings under a name) and the prompt-analysis cache: in Redis when configured,
shared by every replica, else in a local directory (voices) or this process (analyses)."""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import stat
import tempfile
import threading
import time
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import redis

from service.errors import InvalidInputError, StorageFullError, StoreUnavailableError, TooManyVoicesError, VoiceExistsError
from service.stores.redis_client import redis_client

log = logging.getLogger(__name__)

VOICE_FORMAT = 1
MAX_NAME_CHARS = 64
_NAME_PUNCTUATION = frozenset("-_.")
REDIS_VOICES_KEY = "tts:voices"
_REDIS_TIMEOUT_S = 0.5
GROUP_SHARED_FILE_MODE = 0o660  # a saved voice: read and write for its owner and its group (mkstemp's 0600, g=u)
# The longest file name kept as the name's UTF-8 hex (+ ".voice": 254 of the 255 bytes file systems allow); a longer
# one (a 42+ character name in a CJK script) is named by its hash instead, which no hex name can equal.
MAX_HEX_FILE_STEM = 248
_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True, eq=False)
class PromptFeatures:
    """A prompt recording as the model takes it (see service.engine.prompt.PromptAnalysis), storable."""

    embedding: np.ndarray  # (192,) float32 raw
    speech_tokens: np.ndarray  # (T_tok,) int32
    mel: np.ndarray  # (T_mel, 80) float32
    duration_s: float
    mel_variant: str

    def to_arrays(self) -> dict[str, Any]:
        return {"embedding": self.embedding, "speech_tokens": self.speech_tokens, "mel": self.mel}

    @classmethod
    def from_arrays(cls, arrays: Any, duration_s: float, mel_variant: str) -> PromptFeatures:
        return cls(
            np.asarray(arrays["embedding"], dtype=np.float32),
            np.asarray(arrays["speech_tokens"], dtype=np.int32),
            np.asarray(arrays["mel"], dtype=np.float32),
            float(duration_s),
            mel_variant,
        )


@dataclass(frozen=True, eq=False)
class SavedVoice:
    """A named voice: its prompt features, the transcript (empty: cross-lingual cloning) and where it came from.

    `models` fingerprints the prompt models that analysed it (a voice analysed by other models is refused);
    `made_for` names the model the saving server served (its manifest's `model`; empty for voices saved before it was
    recorded), so that a server of another model can say which one the voice belongs to.
    """

    name: str
    transcript: str
    features: PromptFeatures
    audio_sha256: str
    models: str
    created_at: float = field(default_factory=time.time)
    made_for: str = ""

    @property
    def kind(self) -> str:
        return "zero_shot" if self.transcript else "cross_lingual"

    def info(self) -> dict[str, Any]:
        """What listings show (no arrays)."""
        return {
            "id": self.name,
            "name": self.name,
            "kind": self.kind,
            "transcript": self.transcript,
            "duration_s": round(self.features.duration_s, 3),
            "prompt_tokens": int(self.features.speech_tokens.size),
            "mel_variant": self.features.mel_variant,
            "created_at": self.created_at,
            "made_for": self.made_for,
        }

    def to_bytes(self) -> bytes:
        meta = {
            "format": VOICE_FORMAT,
            "name": self.name,
            "transcript": self.transcript,
            "audio_sha256": self.audio_sha256,
            "models": self.models,
            "created_at": self.created_at,
            "made_for": self.made_for,
            "duration_s": self.features.duration_s,
            "mel_variant": self.features.mel_variant,
        }
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8), **self.features.to_arrays())
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> SavedVoice:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            meta = json.loads(bytes(npz["meta"]).decode("utf-8"))
            if meta.get("format") != VOICE_FORMAT:
                raise ValueError(f"unknown saved-voice format {meta.get('format')!r}")
            features = PromptFeatures.from_arrays(npz, meta["duration_s"], meta["mel_variant"])
        made_for = str(meta.get("made_for", ""))  # absent from voices saved before it was recorded
        return cls(meta["name"], meta["transcript"], features, meta["audio_sha256"], meta["models"], meta["created_at"], made_for)


NAME_RULE = f"a voice name has 1-{MAX_NAME_CHARS} letters, digits, '-', '_' or '.', and starts with a letter or digit"


def is_voice_name(name: str) -> bool:
    """True when `name` (NFC-normalized) follows the name rule, so a voice may be stored under it (reserved names
    aside). A name that does not (10,000 characters, a lone surrogate, a `/`) names no saved voice."""
    name = unicodedata.normalize("NFC", name)
    return 0 < len(name) <= MAX_NAME_CHARS and name[0].isalnum() and all(c.isalnum() or c in _NAME_PUNCTUATION for c in name)


def check_voice_name(name: str, reserved: Iterable[str] = ()) -> str:
    """The name, NFC-normalized, if it can name a voice: 1-64 letters (any script), digits, `-`, `_`, `.`, starting
    with a letter or digit, and not a built-in speaker or OpenAI voice name; else InvalidInputError."""
    if not is_voice_name(name):
        raise InvalidInputError(NAME_RULE, param="name")
    name = unicodedata.normalize("NFC", name)
    if name.lower() in {r.lower() for r in reserved}:  # OpenAI names are matched without regard to case
        message = f"{name!r} is the name of a built-in speaker or a reserved voice name; choose another name"
        raise VoiceExistsError(message, param="name")
    return name


class VoiceStore(Protocol):
    """Where saved voices live. `add` raises VoiceExistsError / TooManyVoicesError and stores nothing then."""

    backend: str

    def list(self) -> list[SavedVoice]: ...

    def get(self, name: str) -> SavedVoice | None: ...

    def add(self, voice: SavedVoice, max_voices: int) -> None: ...

    def delete(self, name: str) -> bool: ...

    def close(self) -> None: ...


class MemoryVoiceStore:
    """Saved voices in this process only (the CLI and benchmarks: nothing survives the process)."""

    backend = "memory"

    def __init__(self) -> None:
        self._voices: dict[str, SavedVoice] = {}
        self._lock = threading.Lock()

    def list(self) -> list[SavedVoice]:
        with self._lock:
            return sorted(self._voices.values(), key=lambda v: v.created_at)

    def get(self, name: str) -> SavedVoice | None:
        with self._lock:
            return self._voices.get(name)

    def add(self, voice: SavedVoice, max_voices: int) -> None:
        with self._lock:
            if voice.name in self._voices:
                raise VoiceExistsError(f"a voice named {voice.name!r} exists; delete it first", param="name")
            if len(self._voices) >= max_voices:
                raise TooManyVoicesError(f"the store holds its maximum of {max_voices} voices (TTS_MAX_VOICES)")
            self._voices[voice.name] = voice

    def delete(self, name: str) -> bool:
        with self._lock:
            return self._voices.pop(name, None) is not None

    def close(self) -> None:
        pass


class DirectoryVoiceStore:
    """One file per voice in a directory that survives restarts; writes are atomic (temp file + rename).

    The directory and the files give their group the owner's rights: the image runs as uid 10001 in group 0, and
    OpenShift (or `docker run --user 12345`) runs it as another uid in group 0, so a voice saved by one can be
    read, replaced and deleted by the other on the same volume.
    """

    backend = "directory"

    def __init__(self, root: Path) -> None:
        self.root = Path(root)  # created by the first save, so a server that never saves a voice writes nothing
        self._lock = threading.Lock()

    def _path(self, name: str) -> Path:
        # names may hold any letter: the file name is its UTF-8 hex, safe on every file system (a hash when too long)
        raw = name.encode("utf-8", "surrogatepass")  # a lone surrogate names no saved voice, but is no crash either
        stem = raw.hex()
        if len(stem) > MAX_HEX_FILE_STEM:
            stem = "sha256-" + hashlib.sha256(raw).hexdigest()
        return self.root / f"{stem}.voice"

    def list(self) -> list[SavedVoice]:
        voices = [v for p in sorted(self.root.glob("*.voice")) if (v := self._read(p)) is not None]
        return sorted(voices, key=lambda v: v.created_at)

    def get(self, name: str) -> SavedVoice | None:
        return self._read(self._path(name))

    def add(self, voice: SavedVoice, max_voices: int) -> None:
        with self._lock:
            try:
                self._make_root()
            except OSError as e:
                raise self._fault("create", e) from e
            path = self._path(voice.name)
            if path.exists():
                raise VoiceExistsError(f"a voice named {voice.name!r} exists; delete it first", param="name")
            if len(list(self.root.glob("*.voice"))) >= max_voices:
                raise TooManyVoicesError(f"the store holds its maximum of {max_voices} voices (TTS_MAX_VOICES)")
            try:
                self._write(path, voice.to_bytes())
            except OSError as e:  # not writable, disk full: the server's problem, said plainly, nothing half-written
                raise self._fault("write to", e) from e

    def _fault(self, action: str, error: OSError) -> StorageFullError | StoreUnavailableError:
        """What a client is told when the directory fails: what is wrong, never the server's path (the log has it).
        Neither a full disk nor a directory the server may not write clears by itself: no retry hint."""
        log.error("the voices directory %s: cannot %s: %s", self.root, action, error)
        if error.errno in _FULL:
            return StorageFullError("the server's storage for saved voices is full; the voice was not saved")
        reason = error.strerror or type(error).__name__
        return StoreUnavailableError(f"the server cannot {action} its saved-voices directory ({reason})", retry_after_s=None)

    def _make_root(self) -> None:
        """Create the directory if missing, its group given the owner's rights (`chmod g=u`, see the class docstring)."""
        if self.root.is_dir():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        mode = stat.S_IMODE(self.root.stat().st_mode)
        self.root.chmod(mode | (mode & 0o700) >> 3)

    def _write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".partial")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), GROUP_SHARED_FILE_MODE)
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, name: str) -> bool:
        with self._lock:
            try:
                self._path(name).unlink()
            except FileNotFoundError:
                return False
            except OSError as e:
                raise self._fault("delete from", e) from e
            return True

    def close(self) -> None:
        pass

    @staticmethod
    def _read(path: Path) -> SavedVoice | None:
        try:
            return SavedVoice.from_bytes(path.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError):  # a damaged file is skipped, never served
            return None


_ADD_SCRIPT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return -1 end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return -2 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""


class RedisVoiceStore:
    """Saved voices in one Redis hash (name -> blob), shared by every replica; add is one atomic script."""

    backend = "redis"

    def __init__(self, url: str, key: str = REDIS_VOICES_KEY) -> None:
        self._client = redis_client(url, _REDIS_TIMEOUT_S)
        self._key = key
        self._add = self._client.register_script(_ADD_SCRIPT)

    def list(self) -> list[SavedVoice]:
        blobs = self._call(lambda: self._client.hvals(self._key))
        return sorted((v for b in blobs if (v := _parse(b)) is not None), key=lambda v: v.created_at)

    def get(self, name: str) -> SavedVoice | None:
        blob = self._call(lambda: self._client.hget(self._key, name))
        return _parse(blob) if blob is not None else None

    def add(self, voice: SavedVoice, max_voices: int) -> None:
        result = self._call(lambda: self._add(keys=[self._key], args=[voice.name, voice.to_bytes(), max_voices]))
        if result == -1:
            raise VoiceExistsError(f"a voice named {voice.name!r} exists; delete it first", param="name")
        if result == -2:
            raise TooManyVoicesError(f"the store holds its maximum of {max_voices} voices (TTS_MAX_VOICES)")

    def delete(self, name: str) -> bool:
        return bool(self._call(lambda: self._client.hdel(self._key, name)))

    def close(self) -> None:
        self._client.close()

    @staticmethod
    def _call(op: Any) -> Any:
        try:
            return op()
        except redis.exceptions.OutOfMemoryError as e:  # at maxmemory with nothing it may evict: no retry helps
            raise StorageFullError("the voice store (Redis) is full (its maxmemory is reached); nothing was saved") from e
        except redis.RedisError as e:
            raise StoreUnavailableError(f"the voice store (Redis) is unavailable: {type(e).__name__}", retry_after_s=2) from e


def _parse(blob: Any) -> SavedVoice | None:
    try:
        return SavedVoice.from_bytes(bytes(blob))
    except (OSError, ValueError, KeyError):
        return None
