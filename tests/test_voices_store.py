"""Saved-voice stores and the prompt-analysis cache: round trips, atomic limits, damage and outages."""

from __future__ import annotations

import errno
import io
import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import redis
from servers import RedisServer

from service.errors import InvalidInputError, StorageFullError, StoreUnavailableError, TooManyVoicesError, VoiceExistsError
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import DirectoryVoiceStore, PromptFeatures, RedisVoiceStore, SavedVoice, check_voice_name


def voice(name: str, transcript: str = "") -> SavedVoice:
    g = np.random.default_rng(len(name))
    features = PromptFeatures(
        g.standard_normal(192).astype(np.float32),
        g.integers(0, 4096, size=150).astype(np.int32),
        g.standard_normal((258, 80)).astype(np.float32),
        3.0,
        "trained",
    )
    return SavedVoice(name, transcript, features, "ab" * 32, "models-x")


def test_a_saved_voice_round_trips_exactly() -> None:
    original = voice("alice", "你好。")
    back = SavedVoice.from_bytes(original.to_bytes())
    assert back.info() == original.info()
    for a, b in ((back.features.embedding, original.features.embedding), (back.features.mel, original.features.mel)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(back.features.speech_tokens, original.features.speech_tokens)
    with pytest.raises(ValueError):
        SavedVoice.from_bytes(b"not a voice")


def test_a_voice_names_the_model_it_was_made_for_and_older_voices_still_load() -> None:
    made = SavedVoice.from_bytes(replace(voice("bob"), made_for="CosyVoice2-0.5B-int8").to_bytes())
    assert made.made_for == "CosyVoice2-0.5B-int8" and made.info()["made_for"] == "CosyVoice2-0.5B-int8"
    with np.load(io.BytesIO(voice("carol").to_bytes()), allow_pickle=False) as npz:  # as saved before `made_for`
        arrays = {k: npz[k] for k in npz.files}
    meta = json.loads(bytes(arrays.pop("meta")).decode("utf-8"))
    del meta["made_for"]
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8), **arrays)
    older = SavedVoice.from_bytes(buf.getvalue())
    assert older.made_for == "" and older.name == "carol" and older.info()["made_for"] == ""


def test_directory_store_limits_duplicates_and_skips_damaged_files(tmp_path: Path) -> None:
    store = DirectoryVoiceStore(tmp_path / "voices")
    assert store.list() == [] and not (tmp_path / "voices").exists(), "nothing is written before the first save"
    store.add(voice("a"), max_voices=2)
    store.add(voice("中文名"), max_voices=2)
    with pytest.raises(VoiceExistsError):
        store.add(voice("a"), max_voices=5)
    with pytest.raises(TooManyVoicesError):
        store.add(voice("c"), max_voices=2)
    (tmp_path / "voices" / "bad.voice").write_bytes(b"garbage")
    assert sorted(v.name for v in store.list()) == ["a", "中文名"]
    assert not list((tmp_path / "voices").glob("*.partial"))
    assert store.delete("a") and not store.delete("a")


def test_directory_store_shares_its_directory_and_files_with_their_group(tmp_path: Path) -> None:
    """The image's uid 10001 and an arbitrary uid (OpenShift's) share group 0: each must use what the other saved."""
    root = tmp_path / "data" / "voices"
    DirectoryVoiceStore(root).add(voice("a"), max_voices=5)
    directory = stat.S_IMODE(root.stat().st_mode)
    assert directory & 0o070 == (directory & 0o700) >> 3, oct(directory)  # g=u: the group may list, add and delete
    assert [stat.S_IMODE(p.stat().st_mode) for p in root.iterdir()] == [0o660]


def test_an_unwritable_directory_is_a_store_error_not_a_crash(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    store = DirectoryVoiceStore(blocker / "voices")  # a directory under a file cannot be created
    with pytest.raises(StoreUnavailableError):
        store.add(voice("a"), max_voices=5)


def test_directory_store_names_a_long_name_by_its_hash_and_keeps_hex_names(tmp_path: Path) -> None:
    """A name's UTF-8 hex is its file name while that fits (voices saved before stay found); 64 CJK letters (384 hex
    characters) were ENAMETOOLONG, a 503 for a valid name."""
    store = DirectoryVoiceStore(tmp_path)
    long_name, short_name = "𠀀" * 64, "小明"
    store.add(voice(long_name), max_voices=5)
    store.add(voice(short_name), max_voices=5)
    files = sorted(p.name for p in tmp_path.glob("*.voice"))
    assert f"{short_name.encode().hex()}.voice" in files and all(len(f) <= 255 for f in files), files
    got = store.get(long_name)
    assert got is not None and got.name == long_name
    assert sorted(v.name for v in store.list()) == sorted([long_name, short_name])
    assert store.delete(long_name) and store.get(long_name) is None


def test_directory_store_answers_names_no_voice_has_without_a_crash(tmp_path: Path) -> None:
    """A lone surrogate could not be encoded for the file name (UnicodeEncodeError: a 500); 10,000 characters were
    ENAMETOOLONG (a 503 naming the directory)."""
    store = DirectoryVoiceStore(tmp_path)
    store.add(voice("a"), max_voices=5)
    for name in ("\ud800", "a" * 10_000):
        assert store.get(name) is None and store.delete(name) is False


@pytest.mark.parametrize(
    ("code", "error", "retry"), [(errno.ENOSPC, StorageFullError, None), (errno.EACCES, StoreUnavailableError, None)]
)
def test_directory_store_faults_name_no_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, error: type[Exception], retry: int | None
) -> None:
    """Disk full or not writable: what is wrong, in words, without the server's path and without a retry hint."""
    store = DirectoryVoiceStore(tmp_path / "voices")

    def failing_write(self: DirectoryVoiceStore, path: Path, data: bytes) -> None:
        raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(DirectoryVoiceStore, "_write", failing_write)
    with pytest.raises(error) as info:
        store.add(voice("a"), max_voices=5)
    assert str(tmp_path) not in str(info.value) and getattr(info.value, "retry_after_s", None) is retry
    assert store.list() == []


def test_redis_store_at_its_memory_limit_is_storage_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """Redis at maxmemory with nothing it may evict refuses the write (OOM): no retry helps, unlike a Redis restart."""
    store = RedisVoiceStore("redis://127.0.0.1:1/0")

    def out_of_memory(**_: object) -> None:
        raise redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")

    monkeypatch.setattr(store, "_add", out_of_memory)
    with pytest.raises(StorageFullError):
        store.add(voice("a"), max_voices=5)
    store.close()


@pytest.mark.parametrize("name", ["", "-x", "a b", "a/b", "x" * 65, "..", "a\u0000b"])
def test_bad_voice_names(name: str) -> None:
    with pytest.raises(InvalidInputError):
        check_voice_name(name)


def test_good_voice_names_and_reserved_ones() -> None:
    assert check_voice_name("Alice_2.v-1") == "Alice_2.v-1"
    assert check_voice_name("小明") == "小明"
    with pytest.raises(VoiceExistsError):
        check_voice_name("alloy", reserved=["alloy"])


@pytest.mark.integration
def test_redis_store_is_atomic_and_fails_as_a_store_error(redis_server: RedisServer) -> None:
    store = RedisVoiceStore(redis_server.url, key="test:voices")
    try:
        store.add(voice("r1"), max_voices=2)
        with pytest.raises(VoiceExistsError):
            store.add(voice("r1"), max_voices=2)
        store.add(voice("r2"), max_voices=2)
        with pytest.raises(TooManyVoicesError):
            store.add(voice("r3"), max_voices=2)
        assert [v.name for v in store.list()] == ["r1", "r2"] and store.get("r3") is None
        assert store.delete("r1") and store.get("r1") is None
    finally:
        store._client.delete("test:voices")
        store.close()
    down = RedisVoiceStore("redis://127.0.0.1:1/0")
    with pytest.raises(StoreUnavailableError):
        down.list()


def test_analysis_cache_keeps_features_and_survives_a_missing_redis() -> None:
    cache = AnalysisCache("redis://127.0.0.1:1/0", capacity=1)  # unreachable: falls back to this process
    features = voice("x").features
    cache.put("k1", features)
    got = cache.get("k1")
    assert got is not None and np.array_equal(got.mel, features.mel) and got.mel_variant == "trained"
    cache.put("k2", features)
    assert cache.get("k1") is None and cache.get("k2") is not None  # LRU of one
