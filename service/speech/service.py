"""Speech orchestration: text -> frontend -> cache -> engine (bounded worker pool) -> encoder -> cache; sync generators."""

from __future__ import annotations

import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np

from service.audio.encode import encode_complete, make_encoder, media_type, output_sample_rate
from service.audio.timeline import decoder_delay_s
from service.engine.admission import AdmissionMode, CapacityMeter
from service.engine.host import usable_cores
from service.engine.memory import StreamBudget
from service.engine.types import SynthesisOptions
from service.errors import (
    EngineError,
    InvalidInputError,
    OverloadedError,
    ShuttingDownError,
    TTSError,
    UnknownSpeakerError,
    UnsupportedCapabilityError,
)
from service.families.model import Engine, ModelVoice, NamedVoice, VoiceReference
from service.frontend import Sentence
from service.speech.admission import StreamGate, request_bytes
from service.speech.job import SentenceClock, SpeechJob, SpeechTimings, SynthesisObserver, join_audio, whole_mark, with_pauses
from service.speech.request import PreparedSpeech, SpeechRequest, check_text, effective_speed, key_text, name_of, named_as
from service.stores.audio_cache import AudioCache, audio_cache_key, pack_cached, unpack_cached

log = logging.getLogger(__name__)


class Frontend(Protocol):
    def sentences(self, text: str, captions: bool = False) -> list[Sentence]:
        """Sentences with their ids; `captions`: none holds more than one written sentence."""
        ...

    @property
    def lexicon_version(self) -> str:
        """Changes whenever pronunciation lexicon entries change (part of the audio cache key)."""
        ...


VoiceResolver = Callable[[VoiceReference], ModelVoice]  # the model's resolve: names, prompts, instructions


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
        voices: VoiceResolver | None = None,
        aliases: Mapping[str, str] | None = None,
        alias_names: Collection[str] = (),
        probe_voice: ModelVoice | None = None,
        default_voice: str | None = None,
        max_speech_s: float | None = None,
        max_sentence_speech_s: float | None = None,
        admission: AdmissionMode = "count",
        budget: StreamBudget | None = None,
    ) -> None:
        """`max_speech_s`, `max_sentence_speech_s`: seconds of speech a request and each of its sentences may make
        (SynthesisOptions; None: only the model's own bound). `admission`: when a job starts (StreamGate); `budget`:
        the process's memory budget every job reserves its footprint in (None: one of its own without a bound)."""
        self.frontend = frontend
        self.max_speech_s = max_speech_s
        self.max_sentence_speech_s = max_sentence_speech_s
        self.default_voice = default_voice  # what requests that name no voice speak as (named in their errors)
        self.probe_voice = probe_voice  # the probes' voice when their speaker is not built in (the model's warm-up voice)
        self.engine = engine
        self.voices = voices  # None: the engine's built-in speakers only
        self.aliases = dict(aliases or {})  # lower-case name -> the speaker or saved voice it speaks as
        # names that speak only through an alias (OpenAI's, lower-case): one without an alias here is told how to get one
        self.alias_names = frozenset(alias_names)
        self.cache = cache
        self.bundle_sha256 = bundle_sha256
        self.concurrency = concurrency
        self.capacity = concurrency + queue_max
        self.retry_after_s = retry_after_s
        self.n_timesteps = n_timesteps
        self.observer = observer or SynthesisObserver()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="tts-worker")
        self._lock = threading.Lock()
        meter = CapacityMeter(usable_cores())
        self.gate = StreamGate(concurrency=concurrency, queue_max=queue_max, mode=admission,
                               budget=budget or StreamBudget(), meter=meter, observer=self.observer)  # fmt: skip
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
        return self.gate.counts()

    def queue_full(self) -> bool:
        """True while one more job would be refused (no stream may start now, queue full). Cheap; any thread."""
        return self.gate.full()

    def overloaded(self) -> OverloadedError:
        """The error a request gets while the queue is full (Retry-After: `retry_after_s`)."""
        _, running = self.queue_state()
        if running >= self.concurrency:
            why = f"all {self.concurrency} synthesis slots are busy"
        else:
            why = f"the {running} streams running take what the engine keeps up with in real time or in memory"
        return OverloadedError(f"{why} and the queue is full; retry shortly", retry_after_s=self.retry_after_s)

    def submit(self, request: SpeechRequest) -> SpeechJob:
        """Prepare, look up the cache, else start a job. Raises the request's TTSError before any audio exists."""
        prepared = self.prepare(request)
        # stored bytes carry no sentence marks: a timestamped text of several pieces is always synthesized
        cacheable = not request.timestamps or len(prepared.spoken) == 1
        entry = unpack_cached(self.cache.get(prepared.cache_key)) if cacheable else None
        if entry is not None:
            audio_s, data = entry  # the audio length comes with the bytes: SSE usage counts its tokens from it
            marks = (whole_mark(prepared, audio_s, self.sample_rate),) if request.timestamps else ()
            timings = SpeechTimings(frontend_s=prepared.frontend_s, audio_s=audio_s)
            return SpeechJob(prepared, cached=data, timings=timings, cached_marks=marks)
        job = SpeechJob(prepared, timings=SpeechTimings(frontend_s=prepared.frontend_s))
        options = self._options(request, prepared.speed)
        self._admit(job, request_bytes(self.engine, prepared, options, self.sample_rate, self.gate.budget.limit))
        return job

    def prepare(self, request: SpeechRequest) -> PreparedSpeech:
        """Check text and speaker, run the frontend, compute the cache key (no engine work)."""
        started = time.monotonic()
        check_text(request.text, request.max_chars)
        voice = self.resolve_voice(request.voice)
        # read before the frontend runs: a lexicon write in between can only make the key older, never newer
        lexicon_version = self.frontend.lexicon_version
        sentences = self._sentences(request)
        speed = effective_speed(request.speed, sentences)
        rate = output_sample_rate(request.fmt, self.sample_rate, request.pcm_rate_hz, request.rate_hz)
        # the "format" of the key names everything besides the audio parameters that changes the bytes
        variant = f"{request.fmt.value};{'chunked' if request.chunked else 'file'};engine_stream={request.engine_stream}"
        key = audio_cache_key(
            bundle_sha256=self.bundle_sha256,
            text="\n".join(key_text(s) for s in sentences),
            speaker=voice.fingerprint,  # the numbers the audio depends on, not a name that may be reused
            speed=speed,
            fmt=f"{variant};n_timesteps={self.n_timesteps};kbps={request.bitrate_kbps}",
            sample_rate=rate,
            seed=request.seed,
            lexicon_version=lexicon_version,
        )
        mtype = media_type(request.fmt, rate)
        elapsed = time.monotonic() - started
        return PreparedSpeech(request, tuple(sentences), key, rate, mtype, started, elapsed, voice, speed)

    def voice_name(self, name: str) -> str:
        """The speaker or saved voice `name` speaks as: a built-in speaker as it is, an alias (an OpenAI voice name,
        case-insensitive: the defaults and TTS_VOICE_ALIASES) as its target, any other name as it is."""
        if name in self.engine.speakers:
            return name
        return self.aliases.get(name.lower(), name)

    def resolve_voice(self, reference: VoiceReference | ModelVoice) -> ModelVoice:
        """The voice a reference names, its name first followed through an alias (UnknownSpeakerError naming what
        exists); an already resolved voice as it is. Reads the voice store: call it off the event loop."""
        if not isinstance(reference, VoiceReference):
            return reference
        wanted = name_of(reference)
        target = self.voice_name(wanted) if wanted is not None else None
        aliased = named_as(reference, target) if target is not None else reference
        try:
            return self.voices(aliased) if self.voices is not None else self._builtin(aliased)
        except UnknownSpeakerError as e:
            if target == wanted and wanted == self.default_voice:
                # the caller may have named no voice at all: say where the name came from
                default = f"{e.message} ({wanted!r} is TTS_DEFAULT_SPEAKER, the voice of requests that name none)"
                raise UnknownSpeakerError(default, param="voice") from e
            if wanted is not None and target == wanted and wanted.lower() in self.alias_names:
                raise UnknownSpeakerError(self._unaliased(wanted), param="voice") from e
            if target == wanted:
                raise
            known = ", ".join(self.engine.speakers)
            message = (f"the voice {wanted!r} speaks as {target!r} (TTS_VOICE_ALIASES), which is neither a "
                       f"built-in speaker ({known}) nor a saved voice")  # fmt: skip
            raise UnknownSpeakerError(message, param="voice") from e

    def _unaliased(self, name: str) -> str:
        """Why OpenAI voice name `name` has no voice here (its default built-in speaker is not in this model, as on
        CosyVoice2, which has none) and how to give it one."""
        why = "the served model has no built-in speakers" if not self.engine.speakers else "its default speaker is not here"
        return (
            f"{name!r} is an OpenAI voice name with no voice behind it on this model ({why}): save a voice with "
            f"POST /v1/voices (a recording and its name) and use that name, or set TTS_VOICE_ALIASES="
            f"{name.lower()}=<saved voice> to make {name!r} speak as it; GET /v1/audio/voices lists the voices there are"
        )

    def _builtin(self, reference: VoiceReference) -> ModelVoice:
        """Without the model's resolver (tests, benchmarks): built-in speakers by name only."""
        if not isinstance(reference, NamedVoice):
            raise UnsupportedCapabilityError("this service speaks with built-in speakers only", param="voice")
        if reference.name not in self.engine.speakers:
            known = ", ".join(self.engine.speakers)
            raise UnknownSpeakerError(f"unknown speaker {reference.name!r}; known: {known}", param="voice")
        return self.engine.voice(reference.name)

    def probe(self, text: str, speaker: str, max_age_s: float = 0.0) -> None:
        """Run a real inference unless one succeeded within `max_age_s`; raises EngineError when it fails."""
        with self._probe_lock:
            if time.monotonic() - self._last_success < max_age_s:
                return
            ids = [list(s.ids) for s in self.frontend.sentences(text) if s.ids]
            # the operator's warm-up text, not a client's: a babbling random test model must not fail readiness
            options = dataclasses.replace(self._options(SpeechRequest(text, NamedVoice(speaker)), 1.0), max_speech_s=None,
                                          max_sentence_speech_s=None)  # fmt: skip
            voice = self._probe_voice(speaker)
            try:
                chunks = list(self.engine.synthesize(ids, voice, options, threading.Event()))
            except TTSError:
                raise
            except Exception as e:
                raise EngineError(f"probe inference failed: {type(e).__name__}: {e}") from e
            if not chunks or sum(c.audio.size for c in chunks) == 0:
                raise EngineError("probe inference produced no audio")
            self._last_success = time.monotonic()

    def _probe_voice(self, speaker: str) -> ModelVoice:
        """The built-in speaker `speaker`, else the warm-up voice this service was given (UnknownSpeakerError without)."""
        if speaker in self.engine.speakers or self.probe_voice is None:
            return self.engine.voice(speaker)
        return self.probe_voice

    def close(self) -> None:
        """Refuse new jobs, cancel running ones, and wait for the workers to stop."""
        with self._lock:
            self._closing = True
            jobs = list(self._jobs)
        for job in jobs:
            job.cancel()
        self.gate.dispatch()  # queued jobs, cancelled now, end on a worker at once
        self._pool.shutdown(wait=True, cancel_futures=False)
        close_engine = getattr(self.engine, "close", None)  # stops the engine's scheduler thread, if it has one
        if callable(close_engine):
            close_engine()

    def _sentences(self, request: SpeechRequest) -> list[Sentence]:
        try:
            if request.timestamps:  # a caption per written sentence: sentences are not merged
                return self.frontend.sentences(request.text, captions=True)
            return self.frontend.sentences(request.text)
        except TTSError as e:
            e.param = "text"  # the frontend's errors are about the request's text
            raise
        except Exception as e:  # a normalizer that chokes on odd input must not turn into a 5xx
            log.warning("text frontend failed on %d characters: %s: %s", len(request.text), type(e).__name__, e)
            raise InvalidInputError("the text could not be normalized", param="text") from e

    def _options(self, request: SpeechRequest, speed: float) -> SynthesisOptions:
        return SynthesisOptions(
            speed=speed,
            seed=request.seed,
            stream=request.engine_stream,
            n_timesteps=self.n_timesteps,
            max_speech_s=self.max_speech_s,
            max_sentence_speech_s=self.max_sentence_speech_s,
        )

    def _admit(self, job: SpeechJob, nbytes: int) -> None:
        """Start the job on a worker or queue it (StreamGate); OverloadedError when the queue is full."""
        # the job thread runs in a copy of this context: its log lines carry the request's id (service.requestids)
        context = contextvars.copy_context()

        def start() -> None:
            try:
                self._pool.submit(context.run, self._run, job)
            except RuntimeError:  # the workers stopped (closing): the job ends without running
                job.cancel()
                self.gate.finished(job)
                job.close()

        with self._lock:
            if self._closing:
                raise ShuttingDownError("the service is shutting down")
            self._jobs.add(job)
            job.admitted_at = time.monotonic()
        if not self.gate.offer(job, nbytes, start):
            with self._lock:
                self._jobs.discard(job)
            raise self.overloaded()

    def _run(self, job: SpeechJob) -> None:
        """Worker thread: synthesize, encode, hand the pieces over, store complete responses in the cache."""
        t = job.timings
        t.queue_s = time.monotonic() - job.admitted_at
        self.gate.on_worker(job)
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
            with self._lock:
                self._jobs.discard(job)
            # its place goes back before its reader sees the end (the WebSocket starts its next sentence on that end)
            self.gate.finished(job)
            job.close()

    def _produce(self, job: SpeechJob) -> list[bytes] | None:
        """Run the engine; returns the encoded pieces, or None when cancelled."""
        p, req, t = job.prepared, job.prepared.request, job.timings
        encoder = make_encoder(req.fmt, self.sample_rate, p.sample_rate_hz, req.bitrate_kbps) if req.chunked else None
        pieces: list[bytes] = []
        audio: list[np.ndarray] = []
        spoken = list(p.spoken)  # a pure pause (leading silence) is not for the engine
        lead_s = sum(s.pause_after_s for s in p.sentences if not s.ids)
        chunks = self.engine.synthesize([list(s.ids) for s in spoken], p.voice, self._options(req, p.speed), job.cancel_event)
        clock = self._clock(p, spoken) if req.timestamps else None
        for chunk, samples in with_pauses(chunks, [s.pause_after_s for s in spoken], lead_s, self.sample_rate):
            if job.cancel_event.is_set():
                return None
            if chunk is None:
                t.audio_s += samples.size / self.sample_rate
            else:
                t.add_chunk(chunk, self.sample_rate)
                self.observer.chunk_done()
            self.gate.produced(job, samples.size / self.sample_rate)
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
        tail = encoder.finish() if encoder else encode_complete(req.fmt, join_audio(audio), self.sample_rate, rate_hz, kbps)
        t.encode_s += time.monotonic() - start
        self._hand_over(job, tail, pieces)
        return pieces

    def _clock(self, prepared: PreparedSpeech, spoken: list[Sentence]) -> SentenceClock:
        """Sentence marks in seconds of the decoded output: the signal's time plus the format's decoder priming; each
        mark carries the written text of its sentence (the caption), not its reading."""
        delay_s = decoder_delay_s(prepared.request.fmt, prepared.sample_rate_hz)
        return SentenceClock([s.source or s.text for s in spoken], self.sample_rate, delay_s)

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
