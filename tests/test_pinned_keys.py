"""Saved voices and cache keys written before a refactoring stay readable and unchanged after it.

tests/pinned/voices/70696e6e6564.voice is the voice "pinned" as the directory store wrote it at commit 0a92337 (before
the model-family seam): the first 1.5 s of tests/reference/tiny/prompts/zh_16k.wav (tests/pinned/pinned_prompt.wav)
analysed by the tiny bundle's prompt models, transcript 希望你以后能够. The constants below are what that commit's
code computed; a change that moves any of them orphans every saved voice, analysis or audio cache entry in use.
The audio cache keys moved once since, with the model's bytes, as they must: models/tiny was re-exported at f223fe5
(llm_encoder.onnx, one constant an ulp apart), and audio of another graph is not the cached audio.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.audio.encode import AudioFormat
from service.families.model import NamedVoice
from service.runtime import Runtime
from service.settings import Settings
from service.speech.request import SpeechRequest
from service.stores.voices import DirectoryVoiceStore, SavedVoice

PINNED = Path(__file__).resolve().parent / "pinned"
VOICE_FILE = "70696e6e6564.voice"  # the UTF-8 hex of "pinned"
VOICE_SHA256 = "39ea14e4868db5c6ce836d7ef9212f17a3073a38ce0efea14d68a6b94b978e80"
MODELS = "2dc97197c259489e"  # fingerprint of the tiny bundle's prompt models
SAVED_FINGERPRINT = "226f38053ca19bb6630fc4f0ceaa1243"
BUILTIN_FINGERPRINT = "9a441c813c57b4362c851efd1a8813f4"
ANALYSIS_KEY = "1b449a62ebec6f6125f4cc6b31bc06840335b3fedb49c9cf184005e7942712c7:2dc97197c259489e:trained:file"
BUILTIN_KEY = "3aa165de0f57d7116d41df4dcf80afdda79c302837f90d5b7eb31f3d0a6e8851"
SAVED_KEY = "cb5fbafbf36e193aa3039ca692c5fc5046a3dae574f34dbb9575f5361b8b83ad"


@pytest.fixture(scope="module")
def runtime(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runtime]:
    voices = tmp_path_factory.mktemp("pinned") / "voices"
    shutil.copytree(PINNED / "voices", voices)
    settings = Settings(_env_file=None, model_dir=tiny_bundle, intra_op_threads=1, voices_dir=voices)  # type: ignore[call-arg]
    loaded = Runtime(settings)
    loaded.load()
    yield loaded
    loaded.close()


def test_the_pinned_file_is_the_one_written_before() -> None:
    data = (PINNED / "voices" / VOICE_FILE).read_bytes()
    assert hashlib.sha256(data).hexdigest() == VOICE_SHA256
    voice = SavedVoice.from_bytes(data)
    assert (voice.name, voice.transcript, voice.models, voice.kind) == ("pinned", "希望你以后能够", MODELS, "zero_shot")


def test_the_directory_store_finds_it_under_its_name() -> None:
    found = DirectoryVoiceStore(PINNED / "voices").get("pinned")
    assert found is not None and found.audio_sha256 == hashlib.sha256((PINNED / "pinned_prompt.wav").read_bytes()).hexdigest()


def test_voices_resolve_to_the_same_fingerprints(runtime: Runtime) -> None:
    assert runtime.voices.models == MODELS
    service = runtime.service
    assert service.resolve_voice(NamedVoice("pinned")).fingerprint == SAVED_FINGERPRINT
    assert service.resolve_voice(NamedVoice("中文女")).fingerprint == BUILTIN_FINGERPRINT


def test_audio_cache_keys_are_unchanged(runtime: Runtime) -> None:
    service = runtime.service
    builtin = SpeechRequest("你好，世界。", NamedVoice("中文女"), seed=7)
    saved = SpeechRequest(
        "今天天气很好。", NamedVoice("pinned"), AudioFormat.MP3, speed=1.25, seed=3, engine_stream=True, chunked=True
    )
    assert service.prepare(builtin).cache_key == BUILTIN_KEY
    assert service.prepare(saved).cache_key == SAVED_KEY


def test_the_prompt_analysis_key_is_unchanged(runtime: Runtime) -> None:
    from service.families.model import PromptAudio

    voices = runtime.voices
    keys: list[str] = []
    real_get = voices.cache.get
    voices.cache.get = lambda key: keys.append(key)  # type: ignore[method-assign,func-returns-value]
    try:
        voices.analyze(PromptAudio((PINNED / "pinned_prompt.wav").read_bytes()))
    finally:
        voices.cache.get = real_get  # type: ignore[method-assign]
    assert keys == [ANALYSIS_KEY]
