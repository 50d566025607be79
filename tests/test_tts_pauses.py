"""Pauses from the frontend become runs of zero samples in the audio, and change the audio cache key; a finished job
lets go of its place before its reader sees its end."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence

import numpy as np
import pytest

from service.audio.encode import AudioFormat
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions
from service.families.cosyvoice1.voice import Voice
from service.families.model import NamedVoice
from service.frontend import Sentence
from service.speech.job import SpeechJob, with_pauses
from service.speech.request import SpeechRequest
from service.speech.service import TTSService
from service.stores.audio_cache import MemoryAudioCache

RATE = 1000
SPEAKER = "voice"


class ScriptedFrontend:
    """Returns fixed sentences for any text."""

    lexicon_version = "v"

    def __init__(self, sentences: list[Sentence]) -> None:
        self.script = sentences

    def sentences(self, text: str) -> list[Sentence]:
        return list(self.script)


class OnesEngine:
    """Two chunks of ones per sentence (the second 2x as long); records the ids it was given."""

    sample_rate = RATE
    speakers: Sequence[str] = (SPEAKER,)

    def voice(self, speaker: str) -> Voice:
        return Voice.builtin(speaker, np.ones(192, np.float32))

    def __init__(self, marks_ends: bool = True) -> None:
        self.seen: list[list[int]] = []
        self.marks_ends = marks_ends  # False: an engine whose chunks do not say where a sentence ends

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        self.seen = sentences
        timings = StageTimings(0.0, 0.0, 0.0)
        for i, ids in enumerate(sentences):
            last = i == len(sentences) - 1
            yield AudioChunk(np.ones(len(ids) * 10, np.float32), i, False, timings)
            yield AudioChunk(np.ones(len(ids) * 20, np.float32), i, last, timings, sentence_end=self.marks_ends)


def _pcm(sentences: list[Sentence], chunked: bool = False) -> tuple[np.ndarray, OnesEngine]:
    engine = OnesEngine()
    service = TTSService(ScriptedFrontend(sentences), engine, MemoryAudioCache(0), bundle_sha256="0" * 64)
    try:
        request = SpeechRequest("x", NamedVoice(SPEAKER), fmt=AudioFormat.PCM, chunked=chunked)
        data = service.submit(request).read_all()
    finally:
        service.close()
    return np.frombuffer(data, dtype="<i2"), engine


def _runs(samples: np.ndarray) -> list[tuple[bool, int]]:
    """(is_silent, length) of each run of equal silence."""
    silent = samples == 0
    edges = np.flatnonzero(np.diff(silent.astype(np.int8))) + 1
    return [(bool(part[0] == 0), part.size) for part in np.split(samples, edges)]


def test_pauses_are_zero_runs_of_the_right_length() -> None:
    script = [Sentence("", (), 0.25), Sentence("a", (1,), 0.5), Sentence("b", (1, 2), 0.0), Sentence("c", (3,), 1.5)]
    for chunked in (False, True):
        pcm, engine = _pcm(script, chunked)
        assert engine.seen == [[1], [1, 2], [3]]  # the pure pause never reaches the engine
        assert _runs(pcm) == [(True, 250), (False, 30), (True, 500), (False, 60 + 30), (True, 1500)]


def test_no_pause_no_silence() -> None:
    pcm, _ = _pcm([Sentence("a", (1,)), Sentence("b", (2,))])
    assert _runs(pcm) == [(False, 60)]


def test_pauses_change_the_cache_key() -> None:
    keys = []
    for pause in (0.0, 0.5, 1.0):
        service = TTSService(
            ScriptedFrontend([Sentence("a", (1,), pause), Sentence("b", (2,))]), OnesEngine(), MemoryAudioCache(0),
            bundle_sha256="0" * 64,
        )  # fmt: skip
        keys.append(service.prepare(SpeechRequest("x", NamedVoice(SPEAKER))).cache_key)
        service.close()
    assert len(set(keys)) == 3


def test_silence_follows_its_sentence_at_once() -> None:
    """The pause after sentence 0 goes out right after that sentence's last chunk, before sentence 1 is made."""
    ids = [[1, 2], [3]]

    def order(engine: OnesEngine) -> list[str]:
        log: list[str] = []

        def produced() -> Iterator[AudioChunk]:
            for chunk in engine.synthesize(ids, engine.voice(SPEAKER), SynthesisOptions(), threading.Event()):
                log.append(f"made s{chunk.sentence_index}")
                yield chunk

        for chunk, _ in with_pauses(produced(), [0.5, 0.0], 0.0, RATE):
            log.append("sent silence" if chunk is None else f"sent s{chunk.sentence_index}")
        return log

    assert order(OnesEngine()).index("sent silence") < order(OnesEngine()).index("made s1")
    lagging = order(OnesEngine(marks_ends=False))  # without sentence ends: the silence waits for the next sentence
    assert lagging.index("sent silence") > lagging.index("made s1")


def test_a_jobs_place_is_free_before_its_reader_can_see_the_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that starts its next job on the end of this one (the WebSocket's sentence pipeline: one streaming, one
    ahead) must never find this one still running: the gate lets go of a job before the job marks its end."""
    service = TTSService(ScriptedFrontend([Sentence("a", (1, 2, 3))]), OnesEngine(), MemoryAudioCache(0), bundle_sha256="0" * 64)
    at_close: list[tuple[int, int]] = []
    close = SpeechJob.close

    def recording_close(job: SpeechJob) -> None:
        at_close.append(service.queue_state())
        close(job)

    monkeypatch.setattr(SpeechJob, "close", recording_close)
    try:
        request = SpeechRequest("x", NamedVoice(SPEAKER), fmt=AudioFormat.PCM, chunked=True)
        assert b"".join(service.submit(request))
    finally:
        service.close()
    assert at_close == [(0, 0)]
