"""One running synthesis: its timings, its output handed to the reader through a bounded queue, sentence marks, and
the pauses placed between the engine's chunks."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from service.audio.timeline import decoder_delay_s
from service.engine.types import AudioChunk
from service.speech.request import PreparedSpeech

log = logging.getLogger(__name__)

_OUTPUT_QUEUE_ITEMS = 16  # encoded pieces a job may run ahead of its reader
_READER_STALL_S = 120.0  # a reader that takes nothing for this long is treated as gone


@dataclass
class SpeechTimings:
    """Seconds spent per stage of one request, and the audio it produced."""

    frontend_s: float = 0.0
    queue_s: float = 0.0
    llm_s: float = 0.0
    flow_s: float = 0.0
    hift_s: float = 0.0
    encode_s: float = 0.0
    first_chunk_s: float | None = None
    total_s: float = 0.0
    audio_s: float = 0.0

    def add_chunk(self, chunk: AudioChunk, sample_rate: int) -> None:
        """Account one engine chunk: its stage seconds and its audio length."""
        self.llm_s += chunk.timings.llm_s
        self.flow_s += chunk.timings.flow_s
        self.hift_s += chunk.timings.hift_s
        self.audio_s += chunk.audio.size / sample_rate

    @property
    def rtf(self) -> float | None:
        """Real-time factor: synthesis seconds per second of audio (None without audio)."""
        return self.total_s / self.audio_s if self.audio_s > 0 else None

    def server_timing(self) -> str:
        """Value of a `Server-Timing` header (milliseconds)."""
        stages = {"frontend": self.frontend_s, "queue": self.queue_s, "llm": self.llm_s, "flow": self.flow_s}
        stages |= {"hift": self.hift_s, "encode": self.encode_s, "total": self.total_s}
        return ", ".join(f"{k};dur={v * 1000:.1f}" for k, v in stages.items())


class SynthesisObserver:
    """Receives what the service measures; these defaults record nothing (the API's Metrics overrides them)."""

    def queue_changed(self, waiting: int, running: int) -> None:
        """Jobs waiting for a worker and jobs running, after every change."""

    def first_chunk(self, seconds: float) -> None:
        """Seconds from request arrival to its first encoded bytes."""

    def chunk_done(self) -> None:
        """The engine produced one more audio chunk."""

    def finished(self, timings: SpeechTimings) -> None:
        """A job completed; `timings` holds its per-stage seconds and audio length."""

    def cancelled(self) -> None:
        """A job stopped early: its client went away or cancelled it."""

    def request_done(self, transport: str, route: str, status: str, seconds: float) -> None:
        """A call over a non-HTTP transport ended (`grpc`, `websocket`) with its final status, after `seconds`."""


@dataclass(frozen=True)
class SentenceMark:
    """Where one spoken sentence lies in a job's audio, in seconds of what a decoder yields (priming included)."""

    index: int  # among the sentences the engine speaks, from 0
    text: str  # as it was written (markup removed): the caption, not the reading
    start_s: float
    end_s: float


class SentenceClock:
    """Follows a job's output sample by sample (pauses included) and marks each sentence when its last chunk passes."""

    def __init__(self, texts: Sequence[str], sample_rate: int, delay_s: float) -> None:
        self.texts = texts
        self.sample_rate = sample_rate
        self.delay_s = delay_s
        self._pos = 0  # model-rate samples so far
        self._starts: dict[int, int] = {}

    def advance(self, chunk: AudioChunk | None, n_samples: int) -> SentenceMark | None:
        """Account `n_samples` of output (`chunk` None: silence); the mark of the sentence this chunk ends, if any."""
        start = self._pos
        self._pos += n_samples
        if chunk is None:
            return None
        first = self._starts.setdefault(chunk.sentence_index, start)
        if not (chunk.sentence_end or chunk.is_final):
            return None
        i = chunk.sentence_index
        return SentenceMark(i, self.texts[i], self._seconds(first), self._seconds(self._pos))

    def _seconds(self, samples: int) -> float:
        return samples / self.sample_rate + self.delay_s


def whole_mark(prepared: PreparedSpeech, audio_s: float, sample_rate: int) -> SentenceMark:
    """The mark of a one-piece text served from the cache: its `audio_s` of audio less the pauses before and after,
    counted as a synthesis counts them (pauses are whole samples at the model's `sample_rate`)."""
    (sentence,) = prepared.spoken
    lead = sum(round(s.pause_after_s * sample_rate) for s in prepared.sentences if not s.ids)
    speech_end = round(audio_s * sample_rate) - round(sentence.pause_after_s * sample_rate)
    delay_s = decoder_delay_s(prepared.request.fmt, prepared.sample_rate_hz)
    text = sentence.source or sentence.text
    return SentenceMark(0, text, lead / sample_rate + delay_s, speech_end / sample_rate + delay_s)


_END = object()


@dataclass(eq=False)
class SpeechJob:
    """The bytes of one response: a cache hit, or the output of a job running in the worker pool.

    Iterating blocks until the next piece is ready. `cancel()` (the client went away) makes the
    worker stop at its next chunk; iterating a failed job raises the job's TTSError.
    """

    prepared: PreparedSpeech
    cached: bytes | None = None
    timings: SpeechTimings = field(default_factory=SpeechTimings)
    cancel_event: threading.Event = field(default_factory=threading.Event)
    admitted_at: float = 0.0
    cached_marks: tuple[SentenceMark, ...] = ()  # after cached bytes, when the request asked for timestamps
    _out: queue.Queue[object] = field(default_factory=lambda: queue.Queue(_OUTPUT_QUEUE_ITEMS))

    @property
    def cache_hit(self) -> bool:
        return self.cached is not None

    def cancel(self) -> None:
        self.cancel_event.set()

    def __iter__(self) -> Iterator[bytes]:
        for item in self.events():
            if isinstance(item, bytes):
                yield item

    def events(self) -> Iterator[bytes | SentenceMark]:
        """The pieces, with a SentenceMark after each sentence's audio when the request asked for timestamps."""
        if self.cached is not None:
            yield self.cached
            yield from self.cached_marks
            return
        while True:
            item = self._out.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            assert isinstance(item, (bytes, SentenceMark))
            yield item

    def read_all(self) -> bytes:
        """The complete response (blocks until the job ends)."""
        return b"".join(self)

    def emit(self, item: object) -> None:
        """Worker side: hand a piece to the reader, waiting while it is behind; gives up when cancelled."""
        deadline = time.monotonic() + _READER_STALL_S
        while not self.cancel_event.is_set():
            try:
                self._out.put(item, timeout=0.1)
                return
            except queue.Full:
                if time.monotonic() > deadline:
                    log.warning("reader took nothing for %.0f s; cancelling its synthesis", _READER_STALL_S)
                    self.cancel_event.set()

    def close(self) -> None:
        """Worker side: mark the end. A job that ran ahead of its reader (a WebSocket sentence synthesized while the one
        before is sent) may have filled the queue: the mark waits, as `emit` does, so that it is never lost; a job
        cancelled with its queue still full, or whose reader takes nothing for _READER_STALL_S, has no reader left."""
        deadline = time.monotonic() + _READER_STALL_S
        while True:
            try:
                self._out.put(_END, timeout=0.1)
                return
            except queue.Full:
                if self.cancel_event.is_set() or time.monotonic() > deadline:
                    self.cancel_event.set()
                    return


def with_pauses(
    chunks: Iterator[AudioChunk], pauses_s: Sequence[float], lead_s: float, sample_rate: int
) -> Iterator[tuple[AudioChunk | None, np.ndarray]]:
    """Engine chunks as (chunk, chunk.audio), with (None, zeros) for silence: `lead_s` before everything and
    `pauses_s[i]` after the last chunk of sentence i (round(seconds * sample_rate) float32 zero samples)."""
    if lead_s > 0:
        yield None, np.zeros(round(lead_s * sample_rate), dtype=np.float32)
    done = 0  # sentences whose pause has been placed
    for chunk in chunks:
        yield from _silences(pauses_s[done : chunk.sentence_index], sample_rate)
        done = max(done, chunk.sentence_index)
        yield chunk, chunk.audio
        if chunk.is_final:
            yield from _silences(pauses_s[done:], sample_rate)
            done = len(pauses_s)
        elif chunk.sentence_end:  # the silence goes out now, not with the next sentence's first audio
            yield from _silences(pauses_s[done : chunk.sentence_index + 1], sample_rate)
            done = chunk.sentence_index + 1


def _silences(pauses_s: Sequence[float], sample_rate: int) -> Iterator[tuple[None, np.ndarray]]:
    for seconds in pauses_s:
        if seconds > 0:
            yield None, np.zeros(round(seconds * sample_rate), dtype=np.float32)


def join_audio(audio: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(audio).astype(np.float32) if audio else np.zeros(0, dtype=np.float32)
