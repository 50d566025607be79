"""Synthesizer facade: sentences of text ids + a voice -> a generator of audio chunks (LLM -> flow -> HiFT)."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine.acoustic_gate import AcousticGate, Pacer, until_cancelled
from service.engine.chunking import RateMeter
from service.engine.footprint import Footprint
from service.engine.host import released_after, tune_malloc
from service.engine.llm import kv_cache_dtype
from service.engine.options import RuntimeOptions
from service.engine.runtimes import graph_runtime
from service.engine.scheduler import BatchScheduler
from service.engine.sessions import open_sessions
from service.engine.speech_budget import SpeechBudget
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions, TokenGenerator
from service.errors import EmptyTextError, InvalidInputError, UnknownSpeakerError
from service.families.cosyvoice1 import footprint
from service.families.cosyvoice1.flow import FlowRunner
from service.families.cosyvoice1.llm import TRANSIENT_GRAPHS, CosyVoice1LLM, position_table, reads_rows_in_use
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import (
    RequestContext,
    SpeechChunk,
    check_first_hop,
    first_hop_for_speed,
    stream_sentence,
    whole_sentence,
)
from service.families.cosyvoice1.token2wav import GeneratorNoise, NoiseSource, Token2Wav
from service.families.cosyvoice1.voice import FlowPrompt, Voice
from service.layers.acoustic_plan import WIDE_HIFT_DECODE, one_thread_calls, wide_hift_decode
from service.layers.hift import HiFTRunner

DEFAULT_OPTIONS = SynthesisOptions()


@dataclass(frozen=True)
class _Plan:
    """Validated per-request settings."""

    stream: bool
    speed: float
    schedule: ScheduleConfig
    n_timesteps: int | None


class Synthesizer:
    """The engine: owns the sessions of one bundle; every request's state lives in its own generator.

    Thread-safe: sessions and runners are shared read-only, so several threads may iterate
    different `synthesize` generators at once. With a BatchScheduler as `llm`, their decode steps are
    batched on its thread and the calling threads only do flow/HiFT work, `gate` deciding whose turn it is.
    """

    def __init__(
        self,
        bundle: ModelBundle,
        sessions: Mapping[str, Any],
        *,
        llm: TokenGenerator | None = None,
        first_hop_tokens: int | None = None,
        gate: AcousticGate | None = None,
        schedule: ScheduleConfig | None = None,
        prompt_window_s: float | None = None,
        meter: RateMeter | None = None,
        cfg_lanes: bool = False,
    ) -> None:
        """`schedule`: how streamed sentences are cut (default: adaptive, ScheduleConfig.default; the official one
        is ScheduleConfig.official). `prompt_window_s`: seconds of a cloned voice's prompt that the flow sees with
        each streamed chunk (None: all of it, the official computation). `meter` learns the rates the adaptive
        schedule plans with (the scheduler thread, if any, records into the same one). `cfg_lanes`: an estimator
        call whose chunk may take both cores runs its two guidance rows side by side when they are free
        (`cores_free`); `sessions` may hold a WIDE_HIFT_DECODE session for such chunks' vocoder calls."""
        c = bundle.constants
        self.bundle = bundle
        self.sample_rate = c.sample_rate
        self.speakers: tuple[str, ...] = tuple(bundle.speakers)
        self.llm: TokenGenerator = llm if llm is not None else CosyVoice1LLM(sessions, c)
        wide = sessions.get(WIDE_HIFT_DECODE)
        wide_hift = HiFTRunner({**sessions, "hift_decode": wide}, c) if wide is not None else None
        self.token2wav = Token2Wav(FlowRunner(sessions, c, cfg_lanes=cfg_lanes), HiFTRunner(sessions, c), c, wide_hift)
        self.schedule = schedule if schedule is not None else ScheduleConfig.default(c)
        if first_hop_tokens is not None:
            self.schedule = self.schedule.with_first_hop(first_hop_tokens)
        check_first_hop(self.schedule.first_hop, c)
        if prompt_window_s is not None and prompt_window_s < 0:
            raise ValueError("prompt_window_s must be >= 0")
        self.prompt_window_frames = (
            None if prompt_window_s is None else round(prompt_window_s * c.sample_rate / c.mel_hop_samples)
        )
        self.meter = meter if meter is not None else RateMeter()
        self.gate = gate
        self.scheduler = llm if isinstance(llm, BatchScheduler) else None
        self.kv_itemsize = np.dtype(kv_cache_dtype(sessions["llm_step"])).itemsize

    @property
    def first_hop_tokens(self) -> int:
        """The first hop of streamed requests (before any change for their speed)."""
        return self.schedule.first_hop

    @classmethod
    def load(cls, bundle: ModelBundle | str | Path, runtime: RuntimeOptions | None = None) -> Synthesizer:
        """Load a bundle (or take a loaded one), open its sessions and start the stage scheduling `runtime` asks for.

        `runtime.max_batch` > 0 starts a BatchScheduler thread (call `close()` to stop it);
        `acoustic_slots` > 0 or `acoustic_nice` > 0 puts flow/HiFT calls behind an AcousticGate;
        `first_audio_priority` pauses decoding while a first chunk is vocoded (unless a request still waits for
        the tokens of its own first chunk).
        """
        loaded = bundle if isinstance(bundle, ModelBundle) else ModelBundle.load(bundle)
        runtime = one_thread_calls(runtime or RuntimeOptions())
        lanes = runtime.threads_for("acoustic") == 1  # the one-thread calls' parallelism, as CosyVoice2 plans it
        tune_malloc(runtime.malloc_arenas, runtime.mmap_threshold())
        # The table is built before the big graphs are opened, so llm_pos's transient memory is reused
        # by them instead of adding to the peak.
        positions = position_table(
            open_sessions(loaded, runtime, ["llm_pos"], transient=TRANSIENT_GRAPHS)["llm_pos"],
            loaded.constants,
            windowed=not reads_rows_in_use(graph_runtime(loaded, "llm_step", runtime).path),
        )
        sessions = open_sessions(loaded, runtime, transient=TRANSIENT_GRAPHS)
        if lanes:
            sessions[WIDE_HIFT_DECODE] = wide_hift_decode(loaded, runtime)
        runner = CosyVoice1LLM(sessions, loaded.constants, positions=positions)
        gate = None
        if runtime.acoustic_slots > 0 or runtime.acoustic_nice > 0:
            gate = AcousticGate(runtime.acoustic_slots, nice=runtime.acoustic_nice)
        llm, meter = None, RateMeter()
        if runtime.max_batch > 0:
            yield_to = gate.first_audio_running if gate is not None and runtime.first_audio_priority else None
            llm = BatchScheduler(runner, max_batch=runtime.max_batch, yield_to=yield_to, meter=meter)
        official = runtime.stream_schedule == "official"
        c = loaded.constants
        schedule = ScheduleConfig.official(c) if official else ScheduleConfig.default(c, tail=runtime.look_ahead_tail)
        return cls(
            loaded,
            sessions,
            llm=llm or runner,
            gate=gate,
            first_hop_tokens=runtime.first_hop_tokens,
            schedule=schedule,
            prompt_window_s=runtime.prompt_window_s,
            meter=meter,
            cfg_lanes=lanes,
        )

    def request_footprint(self, voice: Voice, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
        """The most a request of sentences of `texts` text tokens in `voice` holds at once (cosyvoice1.footprint)."""
        return footprint.footprint(self.bundle.constants, self.kv_itemsize, voice, texts, options)

    def worst_footprint(self, options: SynthesisOptions) -> Footprint:
        """What one request may hold at the bounds `options` set (the longest prompt and sentence)."""
        return footprint.worst_footprint(self.bundle.constants, self.kv_itemsize, options)

    def cache_bytes(self) -> dict[str, int]:
        """Bytes its caches hold now: the decode batch's K/V (a streamed sentence keeps no growing flow state)."""
        return {"llm_kv": self.scheduler.kv_cache_bytes if self.scheduler is not None else 0}

    def close(self) -> None:
        """Stop the scheduler thread, if this synthesizer has one (requests still decoding fail)."""
        if self.scheduler is not None:
            self.scheduler.close()
        self.token2wav.flow.close()

    def cores_free(self, first_audio: bool) -> bool:
        """Whether a call that may take both cores (schedule.takes_cores) finds them free now: no other acoustic call
        holds a slot or waits (asked from inside the caller's own), and no decode step competes: the LLM scheduler has
        no request, or the call carries a request's first audio (`first_audio`), for which the decode steps step aside
        (first_audio_priority). Without a gate or a scheduler nothing tells: no."""
        if self.gate is None or self.scheduler is None or not self.gate.alone():
            return False
        if first_audio and self.scheduler.yield_to is not None:
            return True
        return self.scheduler.active == 0

    def synthesize(
        self,
        sentences: Sequence[Sequence[int]],
        voice: Voice | str,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Audio for each sentence of text token ids, one after another (fresh caches per sentence).

        `voice` is a Voice, or the name of a built-in speaker. Validation errors (UnknownSpeakerError,
        EmptyTextError, InvalidInputError) are raised by this call, before any inference. The returned
        generator does the work lazily; it checks `cancel` after every LLM token and between chunks, and
        simply ends (without an is_final chunk) when set.
        """
        resolved = self._resolve(voice)
        texts = [list(map(int, s)) for s in sentences]
        if not texts or any(not s for s in texts):
            raise EmptyTextError("nothing to synthesize: no sentences, or an empty sentence")
        plan = self._plan(options)
        budget = SpeechBudget(self.bundle.constants, options.max_speech_s, options.max_sentence_speech_s)
        budget.check(texts)
        llm_rng, noise_rng = _request_rngs(options.seed)
        ctx = self._context(plan, GeneratorNoise(noise_rng), cancel)
        return released_after(until_cancelled(self._sentences(texts, resolved, plan, llm_rng, ctx, budget)))

    def synthesize_tokens(
        self,
        speech_tokens: Sequence[int],
        voice: Voice | str,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        cancel: threading.Event | None = None,
        *,
        noise: NoiseSource | None = None,
    ) -> Iterator[AudioChunk]:
        """Vocoder-only path: audio for given speech tokens (flow + HiFT, same chunking as `synthesize`).

        With the same seed, the tokens `synthesize` generated for a one-sentence input give the same
        audio here. `noise` replaces the seeded randomness (e.g. token2wav.ReplayNoise with recorded draws).
        """
        flow = self._resolve(voice).flow
        tokens = [int(t) for t in speech_tokens]
        if not tokens:
            raise EmptyTextError("no speech tokens to vocode")
        limit = self.bundle.constants.speech_token_size
        if min(tokens) < 0 or max(tokens) >= limit:
            raise InvalidInputError(f"speech tokens must be in 0..{limit - 1}", param="speech_tokens")
        plan = self._plan(options)
        source = noise if noise is not None else GeneratorNoise(_request_rngs(options.seed)[1])
        return released_after(
            until_cancelled(self._chunks(iter(tokens), flow, 0, True, plan, self._context(plan, source, cancel)))
        )

    # ---- internals -----------------------------------------------------------------------------
    def _context(self, plan: _Plan, noise: NoiseSource, cancel: threading.Event | None) -> RequestContext:
        pace = Pacer(self.gate, self.sample_rate, cancel=cancel)  # a cancel stops a flow solve between its steps
        window = self.prompt_window_frames
        return RequestContext(
            noise, pace, plan.schedule, plan.n_timesteps, plan.speed, cancel, self.meter, window, self.cores_free
        )

    def voice(self, speaker: str) -> Voice:
        """The built-in speaker `speaker` of the bundle (UnknownSpeakerError when it has none of that name)."""
        try:
            return Voice.builtin(speaker, self.bundle.speakers[speaker])
        except KeyError:
            known = ", ".join(self.speakers)
            raise UnknownSpeakerError(f"unknown speaker {speaker!r}; available: {known}", param="voice") from None

    def _resolve(self, voice: Voice | str) -> Voice:
        resolved = self.voice(voice) if isinstance(voice, str) else voice
        dim = self.bundle.constants.spk_embed_dim
        if resolved.flow.embedding.shape != (dim,):
            raise InvalidInputError(f"a voice's speaker embedding must have {dim} values", param="voice")
        if resolved.flow.mel is not None and resolved.flow.mel.shape[1:] != (self.bundle.constants.n_mels,):
            raise InvalidInputError(f"a voice's prompt mel must have {self.bundle.constants.n_mels} bins", param="voice")
        return resolved

    def _plan(self, options: SynthesisOptions) -> _Plan:
        c = self.bundle.constants
        if not (math.isfinite(options.speed) and options.speed > 0):
            raise InvalidInputError(f"speed must be a positive number, got {options.speed}", param="speed")
        if options.seed is not None and options.seed < 0:
            raise InvalidInputError(f"seed must be >= 0, got {options.seed}", param="seed")
        if options.n_timesteps is not None and options.n_timesteps < 1:
            raise InvalidInputError(f"n_timesteps must be >= 1, got {options.n_timesteps}", param="n_timesteps")
        first_hop = self.first_hop_tokens if options.first_hop_tokens is None else options.first_hop_tokens
        if first_hop <= c.token_overlap_len:
            raise InvalidInputError(
                f"first_hop_tokens must be > {c.token_overlap_len} (the token overlap), got {first_hop}", param="first_hop_tokens"
            )
        if options.stream:
            first_hop = first_hop_for_speed(first_hop, options.speed, c)
        schedule = self.schedule.with_first_hop(first_hop)
        return _Plan(options.stream, float(options.speed), schedule, options.n_timesteps)

    def _sentences(
        self,
        texts: list[list[int]],
        voice: Voice,
        plan: _Plan,
        llm_rng: np.random.Generator,
        ctx: RequestContext,
        budget: SpeechBudget,
    ) -> Iterator[AudioChunk]:
        for index, ids in enumerate(texts):
            if ctx.cancelled:
                return
            # the first sentence's first chunk carries the request's first audio: its tokens are urgent
            urgent = plan.schedule.first_audio_tokens(0) if index == 0 and plan.stream else 0
            most = budget.limit(len(ids))
            tokens = self.llm.generate(ids, voice.llm, llm_rng, max_tokens=most, cancel=ctx.cancel, urgent_tokens=urgent)
            made = 0
            for chunk in self._chunks(tokens, voice.flow, index, index == len(texts) - 1, plan, ctx):
                made += chunk.speech_tokens
                yield chunk
            if not ctx.cancelled:
                budget.spent(made, len(ids))  # TextTooLongError when a cap, not the model, ended the sentence

    def _chunks(
        self, tokens: Iterable[int], prompt: FlowPrompt, index: int, last_sentence: bool, plan: _Plan, ctx: RequestContext
    ) -> Iterator[AudioChunk]:
        pieces: Iterator[SpeechChunk]
        if plan.stream:
            pieces = stream_sentence(tokens, prompt, self.token2wav, ctx)
        else:
            pieces = whole_sentence(tokens, prompt, self.token2wav, ctx)
        for piece in pieces:
            timings = StageTimings(llm_s=piece.llm_s, flow_s=piece.flow_s, hift_s=piece.hift_s)
            final = piece.is_last and last_sentence
            yield AudioChunk(piece.audio, index, final, timings, piece.is_last, self.sample_rate, piece.tokens)
            if ctx.cancelled:
                return


def _request_rngs(seed: int | None) -> tuple[np.random.Generator, np.random.Generator]:
    """Independent generators for LLM sampling and acoustic noise, so stream and non-stream share tokens."""
    llm_rng, noise_rng = np.random.default_rng(seed).spawn(2)
    return llm_rng, noise_rng
