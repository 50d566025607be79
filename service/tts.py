"""Speech orchestration: text -> frontend -> cache -> engine (bounded worker pool) -> encoder -> cache; sync generators."""

from __future__ import annotations

import codecs
import contextvars
import logging
import queue
import struct
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from service.audio import DEFAULT_BITRATE_KBPS, AudioFormat, encode_complete, make_encoder, media_type, output_sample_rate
from service.audio_timeline import decoder_delay_s
from service.cache import AudioCache, audio_cache_key
from service.engine.synthesizer import AudioChunk, SynthesisOptions
from service.engine.voice import Voice
from service.errors import (
    EngineError,
    InvalidInputError,
    OverloadedError,
    ShuttingDownError,
    TextTooLongError,
    TTSError,
    UnknownSpeakerError,
)
from service.frontend import Sentence

log = logging.getLogger(__name__)

_OUTPUT_QUEUE_ITEMS = 16  # encoded pieces a job may run ahead of its reader
_READER_STALL_S = 120.0  # a reader that takes nothing for this long is treated as gone
_ALLOWED_CONTROLS = frozenset("\t\n\r")


class Frontend(Protocol):
    def sentences(self, text: str) -> list[Sentence]: ...

    @property
    def lexicon_version(self) -> str:
        """Changes whenever pronunciation lexicon entries change (part of the audio cache key)."""
        ...


class Engine(Protocol):
    """What the service needs from service.engine.synthesizer.Synthesizer."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def speakers(self) -> Sequence[str]: ...

    def voice(self, speaker: str) -> Voice:
        """The built-in speaker `speaker` (UnknownSpeakerError when there is none of that name)."""
        ...

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]: ...


VoiceResolver = Callable[[str], Voice | None]  # a saved voice by name, or None (service.voices)


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
class SpeechRequest:
    """One synthesis request, already validated for type and range by the API schema."""

    text: str
    speaker: str  # a built-in speaker or a saved voice (by name); ignored when `voice` is given
    fmt: AudioFormat = AudioFormat.WAV
    speed: float = 1.0
    seed: int | None = None
    engine_stream: bool = False  # stream inside a sentence too (first audio after the engine's first hop)
    chunked: bool = False  # deliver the response in pieces (else one complete file)
    pcm_rate_hz: int | None = None  # output rate of raw PCM; None = the model's
    bitrate_kbps: int = DEFAULT_BITRATE_KBPS  # MP3/Opus/AAC only
    max_chars: int = 4096
    text_param: str = "text"  # request field names, for error messages
    speaker_param: str = "speaker"
    voice: Voice | None = None  # an already resolved voice (a one-off prompt, an instruct request)
    timestamps: bool = False  # a SentenceMark after each sentence's audio (never served from the audio cache)


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


@dataclass(frozen=True)
class PreparedSpeech:
    """A request after validation and the text frontend: what the engine will read, and its cache key."""

    request: SpeechRequest
    sentences: tuple[Sentence, ...]
    cache_key: str
    sample_rate_hz: int
    media_type: str
    started: float  # time.monotonic() when the request reached the service
    frontend_s: float
    voice: Voice

    @property
    def input_tokens(self) -> int:
        return sum(len(s.ids) for s in self.sentences)


@dataclass(frozen=True)
class SentenceMark:
    """Where one spoken sentence lies in a job's audio, in seconds of what a decoder yields (priming included)."""

    index: int  # among the sentences the engine speaks, from 0
    text: str  # as the frontend read it (normalized)
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
        """Worker side: mark the end (never blocks)."""
        try:
            self._out.put_nowait(_END)
        except queue.Full:
            self.cancel_event.set()  # nobody is reading; the reader is gone


class TTSService:
    """Validates and prepares requests, serves cache hits, and synthesizes up to `concurrency` of them at once.

    Each running job has a thread of its own; with a batching engine their LLM steps are decoded together.
    At most `concurrency + queue_max` jobs are admitted; one more is refused at once with OverloadedError.
    """

    def __init__(
        self,
        frontend: Frontend,
        engine: Engine,
        cache: AudioCache,
        *,
        bundle_sha256: str,
        concurrency: int = 1,
        queue_max: int = 8,
        retry_after_s: int = 1,
        n_timesteps: int | None = None,
        observer: SynthesisObserver | None = None,
        saved_voices: VoiceResolver | None = None,
    ) -> None:
        self.frontend = frontend
        self.engine = engine
        self.saved_voices = saved_voices
        self.cache = cache
        self.bundle_sha256 = bundle_sha256
        self.concurrency = concurrency
        self.capacity = concurrency + queue_max
        self.retry_after_s = retry_after_s
        self.n_timesteps = n_timesteps
        self.observer = observer or SynthesisObserver()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tts-worker")
        self._lock = threading.Lock()
        self._admitted = 0
        self._running = 0
        self._closing = False
        self._jobs: set[SpeechJob] = set()
        self._probe_lock = threading.Lock()
        self._last_success = float("-inf")

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def speakers(self) -> list[str]:
        return list(self.engine.speakers)

    def queue_state(self) -> tuple[int, int]:
        """(waiting, running) jobs right now."""
        with self._lock:
            return self._admitted - self._running, self._running

    def queue_full(self) -> bool:
        """True while one more job would be refused (every slot busy, queue full). Cheap; any thread may call it."""
        with self._lock:
            return self._admitted >= self.capacity

    def overloaded(self) -> OverloadedError:
        """The error a request gets while the queue is full (Retry-After: `retry_after_s`)."""
        return OverloadedError(
            f"all {self.concurrency} synthesis slots are busy and the queue is full; retry shortly",
            retry_after_s=self.retry_after_s,
        )

    def submit(self, request: SpeechRequest) -> SpeechJob:
        """Prepare, look up the cache, else start a job. Raises the request's TTSError before any audio exists."""
        prepared = self.prepare(request)
        # stored bytes carry no sentence marks: a timestamped request is always synthesized
        entry = None if request.timestamps else unpack_cached(self.cache.get(prepared.cache_key))
        if entry is not None:
            audio_s, data = entry  # the audio length comes with the bytes: SSE usage counts its tokens from it
            return SpeechJob(prepared, cached=data, timings=SpeechTimings(frontend_s=prepared.frontend_s, audio_s=audio_s))
        job = SpeechJob(prepared, timings=SpeechTimings(frontend_s=prepared.frontend_s))
        self._admit(job)
        # the job thread runs in a copy of this context: its log lines carry the request's id (service.requestids)
        self._pool.submit(contextvars.copy_context().run, self._run, job)
        return job

    def prepare(self, request: SpeechRequest) -> PreparedSpeech:
        """Check text and speaker, run the frontend, compute the cache key (no engine work)."""
        started = time.monotonic()
        check_text(request.text, request.max_chars, request.text_param)
        voice = self.resolve_voice(request)
        # read before the frontend runs: a lexicon write in between can only make the key older, never newer
        lexicon_version = self.frontend.lexicon_version
        sentences = self._sentences(request)
        rate = output_sample_rate(request.fmt, self.sample_rate, request.pcm_rate_hz)
        # the "format" of the key names everything besides the audio parameters that changes the bytes
        variant = f"{request.fmt.value};{'chunked' if request.chunked else 'file'};engine_stream={request.engine_stream}"
        key = audio_cache_key(
            bundle_sha256=self.bundle_sha256,
            text="\n".join(_key_text(s) for s in sentences),
            speaker=voice.fingerprint,  # the numbers the audio depends on, not a name that may be reused
            speed=request.speed,
            fmt=f"{variant};n_timesteps={self.n_timesteps};kbps={request.bitrate_kbps}",
            sample_rate=rate,
            seed=request.seed,
            lexicon_version=lexicon_version,
        )
        mtype = media_type(request.fmt, rate)
        return PreparedSpeech(request, tuple(sentences), key, rate, mtype, started, time.monotonic() - started, voice)

    def resolve_voice(self, request: SpeechRequest) -> Voice:
        """The request's voice: given, a built-in speaker, or a saved voice (UnknownSpeakerError naming both kinds)."""
        if request.voice is not None:
            return request.voice
        if request.speaker in self.engine.speakers:
            return self.engine.voice(request.speaker)
        saved = self.saved_voices(request.speaker) if self.saved_voices is not None else None
        if saved is not None:
            return saved
        known = ", ".join(self.engine.speakers)
        extra = " or a saved voice (GET /v1/voices)" if self.saved_voices is not None else ""
        raise UnknownSpeakerError(f"unknown speaker {request.speaker!r}; known: {known}{extra}", param=request.speaker_param)

    def probe(self, text: str, speaker: str, max_age_s: float = 0.0) -> None:
        """Run a real inference unless one succeeded within `max_age_s`; raises EngineError when it fails."""
        with self._probe_lock:
            if time.monotonic() - self._last_success < max_age_s:
                return
            ids = [list(s.ids) for s in self.frontend.sentences(text) if s.ids]
            options = self._options(SpeechRequest(text, speaker))
            try:
                chunks = list(self.engine.synthesize(ids, self.engine.voice(speaker), options, threading.Event()))
            except TTSError:
                raise
            except Exception as e:
                raise EngineError(f"probe inference failed: {type(e).__name__}: {e}") from e
            if not chunks or sum(c.audio.size for c in chunks) == 0:
                raise EngineError("probe inference produced no audio")
            self._last_success = time.monotonic()

    def close(self) -> None:
        """Refuse new jobs, cancel running ones, and wait for the workers to stop."""
        with self._lock:
            self._closing = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        self._pool.shutdown(wait=True, cancel_futures=False)
        close_engine = getattr(self.engine, "close", None)  # stops the engine's scheduler thread, if it has one
        if callable(close_engine):
            close_engine()

    def _sentences(self, request: SpeechRequest) -> list[Sentence]:
        try:
            return self.frontend.sentences(request.text)
        except TTSError as e:
            e.param = request.text_param  # the frontend cannot know which request field held the text
            raise
        except Exception as e:  # a normalizer that chokes on odd input must not turn into a 5xx
            log.warning("text frontend failed on %d characters: %s: %s", len(request.text), type(e).__name__, e)
            raise InvalidInputError("the text could not be normalized", param=request.text_param) from e

    def _options(self, request: SpeechRequest) -> SynthesisOptions:
        return SynthesisOptions(
            speed=request.speed, seed=request.seed, stream=request.engine_stream, n_timesteps=self.n_timesteps
        )

    def _admit(self, job: SpeechJob) -> None:
        with self._lock:
            if self._closing:
                raise ShuttingDownError("the service is shutting down")
            if self._admitted >= self.capacity:
                raise self.overloaded()
            self._admitted += 1
            self._jobs.add(job)
            job.admitted_at = time.monotonic()
            waiting, running = self._admitted - self._running, self._running
        self.observer.queue_changed(waiting, running)

    def _set_running(self, job: SpeechJob, delta: int, done: bool = False) -> None:
        with self._lock:
            self._running += delta
            if done:
                self._admitted -= 1
                self._jobs.discard(job)
            waiting, running = self._admitted - self._running, self._running
        self.observer.queue_changed(waiting, running)

    def _run(self, job: SpeechJob) -> None:
        """Worker thread: synthesize, encode, hand the pieces over, store complete responses in the cache."""
        t = job.timings
        t.queue_s = time.monotonic() - job.admitted_at
        self._set_running(job, +1)
        try:
            pieces = self._produce(job)
            if pieces is not None:
                self._complete(job, pieces)
        except TTSError as e:
            job.emit(e)
        except Exception as e:  # the engine failed for a reason that is not the caller's
            log.exception("synthesis failed")
            job.emit(EngineError(f"synthesis failed: {type(e).__name__}"))
        finally:
            if job.cancel_event.is_set():
                self.observer.cancelled()
            job.close()
            self._set_running(job, -1, done=True)

    def _produce(self, job: SpeechJob) -> list[bytes] | None:
        """Run the engine; returns the encoded pieces, or None when cancelled."""
        p, req, t = job.prepared, job.prepared.request, job.timings
        encoder = make_encoder(req.fmt, self.sample_rate, p.sample_rate_hz, req.bitrate_kbps) if req.chunked else None
        pieces: list[bytes] = []
        audio: list[np.ndarray] = []
        spoken = [s for s in p.sentences if s.ids]  # a pure pause (leading silence) is not for the engine
        lead_s = sum(s.pause_after_s for s in p.sentences if not s.ids)
        chunks = self.engine.synthesize([list(s.ids) for s in spoken], p.voice, self._options(req), job.cancel_event)
        clock = self._clock(p, spoken) if req.timestamps else None
        for chunk, samples in with_pauses(chunks, [s.pause_after_s for s in spoken], lead_s, self.sample_rate):
            if job.cancel_event.is_set():
                return None
            if chunk is None:
                t.audio_s += samples.size / self.sample_rate
            else:
                t.add_chunk(chunk, self.sample_rate)
                self.observer.chunk_done()
            mark = clock.advance(chunk, samples.size) if clock else None
            if encoder is None:
                audio.append(samples)
                continue
            start = time.monotonic()
            data = encoder.encode(samples)
            t.encode_s += time.monotonic() - start
            if data:
                self._hand_over(job, data, pieces)
            if mark is not None:
                job.emit(mark)  # after the sentence's last audio; never part of the stored bytes
        if job.cancel_event.is_set():
            return None
        start = time.monotonic()
        rate_hz, kbps = p.sample_rate_hz, req.bitrate_kbps
        tail = encoder.finish() if encoder else encode_complete(req.fmt, _join(audio), self.sample_rate, rate_hz, kbps)
        t.encode_s += time.monotonic() - start
        self._hand_over(job, tail, pieces)
        return pieces

    def _clock(self, prepared: PreparedSpeech, spoken: list[Sentence]) -> SentenceClock:
        """Sentence marks in seconds of the decoded output: the signal's time plus the format's decoder priming."""
        delay_s = decoder_delay_s(prepared.request.fmt, prepared.sample_rate_hz)
        return SentenceClock([s.text for s in spoken], self.sample_rate, delay_s)

    def _hand_over(self, job: SpeechJob, data: bytes, pieces: list[bytes]) -> None:
        if job.timings.first_chunk_s is None:
            job.timings.first_chunk_s = time.monotonic() - job.prepared.started
            self.observer.first_chunk(job.timings.first_chunk_s)
        pieces.append(data)
        job.emit(data)

    def _complete(self, job: SpeechJob, pieces: list[bytes]) -> None:
        t = job.timings
        t.total_s = time.monotonic() - job.prepared.started
        self._last_success = time.monotonic()
        self.observer.finished(t)
        log.info(
            "synthesized %.2f s of audio in %.2f s (RTF %.3f, first bytes after %.3f s, queue %.3f s)",
            t.audio_s, t.total_s, t.rtf or 0.0, t.first_chunk_s or 0.0, t.queue_s,
        )  # fmt: skip
        if not job.cancel_event.is_set():
            self.cache.put(job.prepared.cache_key, pack_cached(t.audio_s, b"".join(pieces)))


_CACHED = struct.Struct("<4sd")  # an audio cache entry starts with b"TTS1" and the audio's length in seconds
_CACHED_MAGIC = b"TTS1"


def pack_cached(audio_s: float, data: bytes) -> bytes:
    """An audio cache entry: the response bytes after a small header holding the audio's length in seconds."""
    return _CACHED.pack(_CACHED_MAGIC, audio_s) + data


def unpack_cached(entry: bytes | None) -> tuple[float, bytes] | None:
    """(audio seconds, response bytes) of an entry written by pack_cached; None for a miss or anything else."""
    if entry is None or len(entry) < _CACHED.size or not entry.startswith(_CACHED_MAGIC):
        return None
    _, audio_s = _CACHED.unpack_from(entry)
    return float(audio_s), entry[_CACHED.size :]


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


def _key_text(sentence: Sentence) -> str:
    """A sentence's part of the audio cache key; a pause after it changes the key (no pause: the text alone)."""
    return f"{sentence.text}\t{sentence.pause_after_s!r}" if sentence.pause_after_s else sentence.text


def _join(audio: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(audio).astype(np.float32) if audio else np.zeros(0, dtype=np.float32)


def decode_text(raw: bytes, what: str, param: str | None, charset: str = "utf-8") -> str:
    """`raw` decoded as `charset` (strictly); InvalidInputError naming `what`, the first bad byte and its offset
    otherwise. Every transport decodes request text with it: a GBK transcript is refused, never kept as mojibake."""
    try:
        return raw.decode(charset)
    except UnicodeDecodeError as e:
        name = codecs.lookup(charset).name.upper().replace("_", "-")
        bad = f"byte 0x{raw[e.start]:02X} at offset {e.start}"
        raise InvalidInputError(f"{what} is not valid {name} text ({bad}); encode text as UTF-8", param=param) from e


def check_text(text: str, max_chars: int, param: str) -> None:
    """Reject over-long text (TextTooLongError) and characters no text should hold: C0/C1 controls, lone
    surrogates (InvalidInputError). `param` names the request field in the error."""
    if len(text) > max_chars:
        raise TextTooLongError(f"text has {len(text)} characters; the limit is {max_chars}", param=param)
    for i, ch in enumerate(text):
        if ch in _ALLOWED_CONTROLS:
            continue
        category = unicodedata.category(ch)
        if category in ("Cc", "Cs"):
            raise InvalidInputError(f"text holds a disallowed character U+{ord(ch):04X} at position {i}", param=param)
