"""CosyVoice3 engine: sentences of text ids + a voice -> audio chunks (Qwen2 LLM -> DiT flow -> causal HiFT).

Streaming sentences are cut by a HopSchedule (a 10-token first chunk, then one attention chunk per hop; or the official
25 + pad, 50, 100). By default the flow continues from its caches (each mel frame solved once, the DiT's caches bounded
by a window) and the causal HiFT decodes a bounded window of mel before each chunk; `TTS_ENGINE_PROFILE=stream_schedule=official`
switches to the official stream: every call recomputes the prompt and all tokens so far, and HiFT re-runs over the
whole mel history (`service verify` replays it).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine import native
from service.engine.acoustic_gate import AcousticGate, Pacer
from service.engine.chunking import Progress, first_audio
from service.engine.footprint import Footprint
from service.engine.host import released_after, tune_malloc
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.speech_budget import SpeechBudget
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions, TokenGenerator
from service.errors import EmptyTextError, InvalidInputError
from service.families.cosyvoice3 import footprint
from service.families.cosyvoice3.assembly import (
    SilenceFilter,
    extra_constants,
    open_engine_sessions,
    stream_schedule,
    window_frames,
)
from service.families.cosyvoice3.chunks import FlowChunks, PromptKey
from service.families.cosyvoice3.contract import NOISE_NAME
from service.families.cosyvoice3.flow import FlowRunner3, FlowState
from service.families.cosyvoice3.noise import SineNoise
from service.families.cosyvoice3.vocoder import CausalVocoder, OfficialStream, WindowedStream
from service.families.cosyvoice3.voice import Voice3
from service.layers.acoustic_plan import WIDE_HIFT_DECODE, decode_spread, flow_budget, one_thread_calls
from service.layers.chunk_schedule import HopSchedule, window_tokens
from service.layers.dsp import StreamingStretch, interpolate_linear
from service.layers.flow_prompt import FlowPrompt
from service.layers.frame_cache import PrecisionLever, PromptStates
from service.layers.frame_window import family_window_s
from service.layers.hift import HiFTRunner
from service.layers.mel_stream import MelChunk
from service.layers.qwen2 import Qwen2Runner

DEFAULT_OPTIONS = SynthesisOptions()
DEFAULT_PROMPT_CACHE_BYTES = 1 << 30  # prompt flow states kept for reuse (a 1 s window at full size: ~0.1 GB each)
DEFAULT_WINDOW_S = 4.0  # generated speech a streamed DiT keeps attending to (flow_window_s "auto")


class CosyVoice3Engine:
    """Owns the sessions of one CosyVoice3 bundle; every request's state lives in its own generator (thread-safe)."""

    def __init__(
        self,
        bundle: ModelBundle,
        sessions: Mapping[str, Any],
        *,
        llm: TokenGenerator | None = None,
        gate: AcousticGate | None = None,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        schedule: HopSchedule | None = None,
        recompute: bool = False,
        prompt_window_tokens: int | None = None,
        window_s: float | None = None,
        cfg_lanes: bool = False,
        state_budget: StateBudget | None = None,
        cache_precision: PrecisionLever = "graph",
    ) -> None:
        """`schedule`: how streamed sentences are cut (None: the official HopSchedule). `recompute`: stream as the
        official code does (every call over the prompt and all tokens so far, HiFT over the whole history) instead of
        from the caches. `prompt_window_tokens`: the last prompt tokens a cached stream's flow sees (None: all).
        `window_s`: seconds of generated speech a cached stream's DiT keeps attending to (None: all). `cfg_lanes`: the
        estimator's two guidance rows run as two concurrent calls. `state_budget`: what the streams' caches may hold at
        once (None: no bound). `cache_precision`: how the DiT's caches keep their frames (frame_cache.stored_precision)."""
        extra = extra_constants(bundle)
        c = bundle.constants
        self.bundle, self.constants, self.extra = bundle, c, extra
        self.sample_rate = c.sample_rate
        self.runner = Qwen2Runner(sessions, c, extra.text_vocab_size)
        self.llm: TokenGenerator = llm if llm is not None else self.runner
        self.scheduler = llm if isinstance(llm, BatchScheduler) else None
        noise = np.load(bundle.file(NOISE_NAME), allow_pickle=False)
        self.flow = FlowRunner3(sessions, c, extra, noise, cfg_lanes=cfg_lanes, precision=cache_precision)
        sine = SineNoise(extra.hift_noise_seed, extra.hift_noise_offset, extra.hift_noise_samples, c.nb_harmonics + 1)
        self.vocoder = CausalVocoder(HiFTRunner(sessions, c), extra, sine)
        wide = sessions.get(WIDE_HIFT_DECODE)
        self.wide_vocoder = CausalVocoder(HiFTRunner({**sessions, "hift_decode": wide}, c), extra, sine) if wide else None
        self.schedule = schedule or HopSchedule.official(extra.chunk_tokens, extra.pre_lookahead, c)
        self.recompute = recompute
        self.prompt_window_tokens = prompt_window_tokens
        self.gate = gate
        self.state_budget = state_budget or StateBudget(None)
        frame_rate = c.token_rate_hz * extra.token_mel_ratio
        states: PromptStates[PromptKey, FlowState] = PromptStates(prompt_cache_bytes)
        window = window_frames(window_s, extra, frame_rate)
        self.chunks = FlowChunks(self.flow, c, extra, states, self.state_budget, window)
        self.silent = frozenset(extra.silent_tokens)

    @classmethod
    def load(cls, bundle: ModelBundle | str | Path, runtime: RuntimeOptions | None = None, **kwargs: Any) -> CosyVoice3Engine:
        """Load a bundle, open its graphs, and start the batching scheduler / acoustic gate `runtime` asks for."""
        loaded = bundle if isinstance(bundle, ModelBundle) else ModelBundle.load(bundle)
        runtime = one_thread_calls(runtime or RuntimeOptions())
        tune_malloc(runtime.malloc_arenas, runtime.mmap_threshold())
        lanes = kwargs.setdefault("cfg_lanes", runtime.threads_for("acoustic") == 1)
        return cls.from_sessions(loaded, open_engine_sessions(loaded, runtime, wide=lanes), runtime, **kwargs)

    @classmethod
    def from_sessions(
        cls, bundle: ModelBundle, sessions: Mapping[str, Any], runtime: RuntimeOptions, **kwargs: Any
    ) -> CosyVoice3Engine:
        """An engine over opened sessions with the scheduler, gate, schedule, windows and budget `runtime` asks for."""
        gate = AcousticGate(runtime.acoustic_slots, nice=runtime.acoustic_nice) if runtime.acoustic_slots > 0 else None
        step = native.DecodeSpread(sessions["llm_step"]) if runtime.max_batch > 0 else None
        spread = decode_spread(bundle, runtime, gate, step)
        if step is not None and spread is not None:
            sessions = {**sessions, "llm_step": step}
        runner = Qwen2Runner(sessions, bundle.constants, extra_constants(bundle).text_vocab_size)
        llm: TokenGenerator = runner
        schedule = kwargs.setdefault("schedule", stream_schedule(bundle, runtime))
        official = kwargs.setdefault("recompute", runtime.stream_schedule == "official")
        if runtime.max_batch > 0:
            yield_to = gate.first_audio_running if gate is not None and runtime.first_audio_priority else None
            lead = schedule.decode_lead if runtime.decode_lead_tokens is None else runtime.decode_lead_tokens
            busy = gate.busy if gate is not None else None
            llm = BatchScheduler(
                runner, max_batch=runtime.max_batch, yield_to=yield_to, lead_tokens=lead, acoustic_busy=busy, before_step=spread
            )  # fmt: skip
        if not official:  # the official stream conditions on the whole prompt and attends to every frame
            window = window_tokens(runtime.prompt_window_s, schedule, bundle.constants.token_rate_hz)
            kwargs.setdefault("prompt_window_tokens", window)
            kwargs.setdefault("window_s", family_window_s(runtime.flow_window_s, DEFAULT_WINDOW_S))
            kwargs.setdefault("cache_precision", runtime.flow_cache_precision)
        if "state_budget" not in kwargs:
            kwargs["state_budget"] = flow_budget(runtime)  # after the sessions opened: auto counts the loaded model
        return cls(bundle, sessions, llm=llm, gate=gate, **kwargs)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.flow.close()

    # ---- requests -------------------------------------------------------------------------------
    def synthesize(
        self,
        sentences: Sequence[Sequence[int]],
        voice: Voice3,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Audio for each sentence of text ids in `voice` (validation errors are raised here, work is lazy).

        Streaming yields a chunk per hop as tokens arrive; otherwise one chunk per sentence (official non-streaming:
        full attention over prompt and tokens). `speed` also streams (each chunk's mel is stretched as it comes); the
        official allows it only without streaming."""
        texts = [list(map(int, s)) for s in sentences]
        if not texts or any(not s for s in texts):
            raise EmptyTextError("nothing to synthesize: no sentences, or an empty sentence")
        self._check(voice, options)
        budget = SpeechBudget(self.constants, options.max_speech_s, options.max_sentence_speech_s)
        budget.check(texts)
        llm_rng = np.random.default_rng(options.seed)
        pace = Pacer(self.gate, self.sample_rate)
        return released_after(self._sentences(texts, voice, options, llm_rng, budget, cancel, pace))

    def synthesize_tokens(
        self, speech_tokens: Sequence[int], voice: Voice3, options: SynthesisOptions = DEFAULT_OPTIONS
    ) -> Iterator[np.ndarray]:
        """Flow + HiFT only: audio pieces for given speech tokens with the chunking `synthesize` uses."""
        tokens = [int(t) for t in speech_tokens]
        if not tokens:
            raise EmptyTextError("no speech tokens to vocode")
        if min(tokens) < 0 or max(tokens) >= self.constants.speech_token_size:
            raise InvalidInputError(f"speech tokens must be in 0..{self.constants.speech_token_size - 1}", param="speech_tokens")
        self._check(voice, options)
        pace = Pacer(self.gate, self.sample_rate)
        return (piece for piece, _ in self._sentence(iter(tokens), voice.flow, options, pace, voice.fingerprint))

    def request_footprint(self, voice: Voice3, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
        """The most a request of sentences of `texts` text tokens in `voice` holds at once (cosyvoice3.footprint)."""
        return footprint.footprint(self, voice, texts, options)

    def worst_footprint(self, options: SynthesisOptions) -> Footprint:
        """What one request may hold at the bounds `options` set (cosyvoice3.footprint.worst_footprint)."""
        return footprint.worst_footprint(self, options)

    def schedule_for(self, options: SynthesisOptions) -> HopSchedule:
        """The chunk schedule of one request: the engine's, with the request's first hop when it names one."""
        first = options.first_hop_tokens
        return self.schedule if first is None else replace(self.schedule, first=first)

    def flow_prompt(self, prompt: FlowPrompt, options: SynthesisOptions) -> FlowPrompt:
        """What the flow of a sentence sees of the voice's prompt: its window when streaming, else all of it."""
        return prompt.window(self.prompt_window_tokens) if options.stream and not self.recompute else prompt

    def mel_chunks(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        *,
        fingerprint: str | None = None,
        pace: Pacer | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[MelChunk]:
        """The flow half of a sentence: mel chunks (80, 2 x tokens) as `tokens` arrive (one chunk without streaming)."""
        steps = options.n_timesteps or self.constants.n_timesteps
        pace = pace or Pacer(None, self.sample_rate)
        if not options.stream:
            speech = list(tokens)
            first = first_audio(Progress(0, 0, len(speech), True, pace.audio_s))
            mel, flow_s = self.chunks.whole(prompt, speech, steps, pace, first)
            yield MelChunk(mel, True, flow_s, len(speech), first)
            return
        schedule = self.schedule_for(options)
        if self.recompute:
            yield from self.chunks.official(tokens, prompt, steps, schedule, pace=pace)
            return
        yield from self.chunks.cached(
            tokens, self.flow_prompt(prompt, options), steps, schedule, fingerprint=fingerprint, pace=pace,
            max_tokens=max_tokens, cancel=cancel,
        )  # fmt: skip

    # ---- internals --------------------------------------------------------------------------------
    def _check(self, voice: Voice3, options: SynthesisOptions) -> None:
        c = self.constants
        if voice.flow.embedding.shape != (c.spk_embed_dim,):
            raise InvalidInputError(f"a voice's speaker embedding must have {c.spk_embed_dim} values", param="voice")
        if not (math.isfinite(options.speed) and options.speed > 0):
            raise InvalidInputError(f"speed must be a positive number, got {options.speed}", param="speed")
        if options.n_timesteps is not None and options.n_timesteps < 1:
            raise InvalidInputError(f"n_timesteps must be >= 1, got {options.n_timesteps}", param="n_timesteps")
        if options.first_hop_tokens is not None and options.first_hop_tokens < 1:
            raise InvalidInputError("first_hop_tokens must be >= 1", param="first_hop_tokens")

    def _sentences(
        self,
        texts: list[list[int]],
        voice: Voice3,
        options: SynthesisOptions,
        llm_rng: np.random.Generator,
        budget: SpeechBudget,
        cancel: threading.Event | None,
        pace: Pacer,
    ) -> Iterator[AudioChunk]:
        for index, ids in enumerate(texts):
            if cancel is not None and cancel.is_set():
                return
            clock = time.perf_counter()
            urgent = self.schedule_for(options).first_audio_tokens(len(self.flow_prompt(voice.flow, options).tokens))
            most = budget.limit(len(ids))  # the official bound, or less under the request's caps
            raw = self.llm.generate(ids, voice.llm_prompt(ids), llm_rng, max_tokens=most, cancel=cancel, urgent_tokens=urgent)
            tokens = SilenceFilter(iter(raw), self.silent, self.extra.max_silent_run)
            pieces = self._sentence(tokens, voice.flow, options, pace, voice.fingerprint, most, cancel)
            for audio, (last, flow_s, hift_s, tokens_in) in pieces:
                llm_s = max(0.0, time.perf_counter() - clock - flow_s - hift_s)
                timings = StageTimings(llm_s=llm_s, flow_s=flow_s, hift_s=hift_s)
                final = last and index == len(texts) - 1
                rate = self.sample_rate
                yield AudioChunk(audio, index, final, timings, sentence_end=last, sample_rate=rate, speech_tokens=tokens_in)
                clock = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    return
            budget.spent(tokens.taken, len(ids))  # TextTooLongError when a cap, not the model, ended the sentence

    def _sentence(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt,
        options: SynthesisOptions,
        pace: Pacer,
        fingerprint: str | None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[tuple[np.ndarray, tuple[bool, float, float, int]]]:
        """Audio pieces of one sentence with (final, flow seconds, vocoder seconds, speech tokens)."""
        streaming = options.stream
        stretch = StreamingStretch(options.speed) if streaming and options.speed != 1.0 else None
        chunks = self.mel_chunks(
            tokens, prompt, options, fingerprint=fingerprint, pace=pace, max_tokens=max_tokens, cancel=cancel
        )
        stream: WindowedStream | OfficialStream | None = None
        before = 0
        for chunk in chunks:
            clock = time.perf_counter()
            wide = self._wide_vocoder(chunk.tokens, before, chunk.final)
            if stream is None:
                stream = (
                    OfficialStream.start(self.vocoder) if self.recompute and streaming else WindowedStream.start(self.vocoder)
                )
            with pace.turn(first=chunk.first, pauses_llm=wide):
                mel = chunk.mel
                if stretch is not None:
                    mel = stretch.push(mel, final=chunk.final)
                elif not streaming and options.speed != 1.0:
                    mel = interpolate_linear(mel, int(mel.shape[1] / options.speed))
                audio = stream.push(mel, final=chunk.final, vocoder=self.wide_vocoder if wide else None)
            pace.delivered(audio.shape[0])
            before += chunk.tokens
            yield audio, (chunk.final, chunk.flow_s, time.perf_counter() - clock, chunk.tokens)

    def _wide_vocoder(self, tokens: int, before: int, final: bool) -> bool:
        """Whether a chunk's vocoder call runs on both cores: the schedule says so, there is a wide session, and no
        other acoustic call runs or waits at the gate."""
        takes = self.schedule.vocoder_takes_cores(tokens, before=before, final=final)
        if self.wide_vocoder is None or self.gate is None or not takes:
            return False
        return self.gate.idle()
