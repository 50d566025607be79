"""CosyVoice2 engine: sentences of text ids + a voice -> audio chunks (Qwen2 LLM -> cached chunk flow -> HiFT).

Streaming chunks follow a HopSchedule per request (service.families.cosyvoice2.schedule: the official 25 + pad, 50,
100, ... or a small first hop for early first audio), every chunk waiting for 3 look-ahead tokens. Unlike the
official, which runs the flow over the prompt and every token so far for each chunk, the flow continues from its
caches: each mel frame is solved once per request.
"""

from __future__ import annotations

import logging
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
from service.engine.acoustic_gate import AcousticGate, Pacer, until_cancelled
from service.engine.chunking import Progress, first_audio
from service.engine.footprint import Footprint
from service.engine.host import released_after, tune_malloc
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.speech_budget import SpeechBudget
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions, TokenGenerator
from service.errors import EmptyTextError, InvalidInputError
from service.families.cosyvoice2 import footprint
from service.families.cosyvoice2.assembly import (
    WIDE_HIFT_DECODE,
    decode_spread,
    extra_constants,
    flow_budget,
    one_thread_calls,
    open_engine_sessions,
    stream_schedule,
)
from service.families.cosyvoice2.chunks import FlowChunks2, PromptKey
from service.families.cosyvoice2.contract import NOISE_NAME
from service.families.cosyvoice2.flow import FlowRunner2, FlowState
from service.families.cosyvoice2.sentence import MelChunk
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2
from service.layers.chunk_schedule import HopSchedule, window_tokens
from service.layers.dsp import StreamingStretch
from service.layers.frame_cache import PrecisionLever, PromptStates
from service.layers.frame_window import family_window_s, window_frames
from service.layers.hift import HiFTRunner
from service.layers.qwen2 import Qwen2Runner
from service.layers.vocoder import Vocoder, VocoderStream

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = SynthesisOptions()
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30  # prompt flow states kept for reuse (a 10 s prompt: ~1 GB fp16 full-size)
# Generated speech a streamed sentence's estimator caches keep (flow_window_s "auto"): 100 frames, 2.3 MB each at full
# size (docs/memory.md: what a stream holds, and how many fit in 2, 4 and 8 GB).
DEFAULT_WINDOW_S = 2.0


class CosyVoice2Engine:
    """Owns the sessions of one CosyVoice2 bundle; every request's state lives in its own generator (thread-safe)."""

    def __init__(
        self,
        bundle: ModelBundle,
        sessions: Mapping[str, Any],
        *,
        llm: TokenGenerator | None = None,
        gate: AcousticGate | None = None,
        prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES,
        official_final_chunk: bool = False,
        schedule: HopSchedule | None = None,
        prompt_window_tokens: int | None = None,
        cfg_lanes: bool = False,
        state_budget: StateBudget | None = None,
        window_s: float | None = None,
        cache_precision: PrecisionLever = "graph",
    ) -> None:
        """`official_final_chunk`: end every stream like the official code, with one full-attention flow pass over the
        whole sentence for the last chunk (exact official audio, at the cost of that pass before the last audio).
        `schedule`: how streamed sentences are cut (None: the official HopSchedule). `prompt_window_tokens`: the last
        prompt tokens (with their mel) a streamed flow sees (None: the whole prompt, as the official). `cfg_lanes`: the
        estimator's two guidance rows run as two concurrent calls (FlowRunner2). `state_budget`: what the streamed
        sentences' estimator caches may hold at once (None: no bound; `load` sizes it from `flow_cache_mb`). `window_s`:
        seconds of generated speech a stream's estimator caches keep (None: all, official). `cache_precision`: how they
        keep their frames (frame_cache.stored_precision).
        `sessions` may hold a WIDE_HIFT_DECODE session (`open_engine_sessions`): with a gate, a vocoder call the
        schedule gives the cores to runs on it, decoding paused, when no other acoustic call runs or waits."""
        extra = extra_constants(bundle)
        c = bundle.constants
        self.bundle, self.constants, self.extra = bundle, c, extra
        self.sample_rate = c.sample_rate
        self.runner = Qwen2Runner(sessions, c, extra.text_vocab_size)
        self.llm: TokenGenerator = llm if llm is not None else self.runner
        self.scheduler = llm if isinstance(llm, BatchScheduler) else None
        noise = np.load(bundle.file(NOISE_NAME), allow_pickle=False)
        self.flow = FlowRunner2(sessions, c, extra, noise, cfg_lanes=cfg_lanes, precision=cache_precision)
        wide = sessions.get(WIDE_HIFT_DECODE)
        wide_runner = HiFTRunner({**sessions, "hift_decode": wide}, c) if wide is not None else None
        self.vocoder = Vocoder(HiFTRunner(sessions, c), wide_runner)
        self.schedule = schedule or HopSchedule.official(extra.chunk_tokens, extra.pre_lookahead, c)
        self.prompt_window_tokens = prompt_window_tokens
        self.gate = gate
        self.prompt_states: PromptStates[PromptKey, FlowState] = PromptStates(prompt_cache_bytes)
        self.official_final_chunk = official_final_chunk
        self.state_budget = state_budget or StateBudget(None)
        window = window_frames(window_s, extra.chunk_tokens * extra.token_mel_ratio, c.token_rate_hz * extra.token_mel_ratio)
        self.chunks = FlowChunks2(self.flow, extra, self.prompt_states, self.state_budget, window)

    @classmethod
    def load(cls, bundle: ModelBundle | str | Path, runtime: RuntimeOptions | None = None, **kwargs: Any) -> CosyVoice2Engine:
        """Load a bundle, open its graphs, and start the batching scheduler / acoustic gate `runtime` asks for."""
        loaded = bundle if isinstance(bundle, ModelBundle) else ModelBundle.load(bundle)
        runtime = one_thread_calls(runtime or RuntimeOptions())
        tune_malloc(runtime.malloc_arenas, runtime.mmap_threshold())
        lanes = kwargs.setdefault("cfg_lanes", runtime.threads_for("acoustic") == 1)  # the one-thread calls' parallelism
        return cls.from_sessions(loaded, open_engine_sessions(loaded, runtime, wide=lanes), runtime, **kwargs)

    @classmethod
    def from_sessions(
        cls, bundle: ModelBundle, sessions: Mapping[str, Any], runtime: RuntimeOptions, **kwargs: Any
    ) -> CosyVoice2Engine:
        """An engine over opened sessions (e.g. instrumented ones) with the scheduler and gate `runtime` asks for."""
        gate = AcousticGate(runtime.acoustic_slots, nice=runtime.acoustic_nice) if runtime.acoustic_slots > 0 else None
        step = native.DecodeSpread(sessions["llm_step"]) if runtime.max_batch > 0 else None
        spread = decode_spread(bundle, runtime, gate, step)
        if step is not None and spread is not None:
            sessions = {**sessions, "llm_step": step}
        runner = Qwen2Runner(sessions, bundle.constants, extra_constants(bundle).text_vocab_size)
        llm: TokenGenerator = runner
        schedule = kwargs.setdefault("schedule", stream_schedule(bundle, runtime))
        if runtime.max_batch > 0:
            yield_to = gate.first_audio_running if gate is not None and runtime.first_audio_priority else None
            lead = schedule.decode_lead if runtime.decode_lead_tokens is None else runtime.decode_lead_tokens
            busy = gate.busy if gate is not None else None
            llm = BatchScheduler(
                runner, max_batch=runtime.max_batch, yield_to=yield_to, lead_tokens=lead, acoustic_busy=busy, before_step=spread
            )  # fmt: skip
        window = window_tokens(runtime.prompt_window_s, schedule, bundle.constants.token_rate_hz)
        kwargs.setdefault("prompt_window_tokens", window)
        kwargs.setdefault("window_s", family_window_s(runtime.flow_window_s, DEFAULT_WINDOW_S))
        kwargs.setdefault("cache_precision", runtime.flow_cache_precision)
        if "state_budget" not in kwargs:
            kwargs["state_budget"] = flow_budget(runtime)  # after the sessions opened: auto counts the loaded model
        return cls(bundle, sessions, llm=llm, gate=gate, **kwargs)

    def request_footprint(self, voice: Voice2, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
        """The most a request of sentences of `texts` text tokens in `voice` holds at once (cosyvoice2.footprint)."""
        return footprint.footprint(self, voice, texts, options)

    def worst_footprint(self, options: SynthesisOptions) -> Footprint:
        """What one request may hold at the bounds `options` set (the longest prompt and sentence)."""
        return footprint.worst_footprint(self, options)

    def cache_bytes(self) -> dict[str, int]:
        """Bytes its caches hold now: streamed sentences' flow caches (reserved), the voices' prompt states, the
        decode batch's K/V."""
        kv = self.scheduler.kv_cache_bytes if self.scheduler is not None else 0
        return {"flow": self.state_budget.used, "prompt": self.prompt_states.nbytes(), "llm_kv": kv}

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.flow.close()

    # ---- requests -------------------------------------------------------------------------------
    def synthesize(
        self,
        sentences: Sequence[Sequence[int]],
        voice: Voice2,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        cancel: threading.Event | None = None,
    ) -> Iterator[AudioChunk]:
        """Audio for each sentence of text ids in `voice` (validation errors are raised here, work is lazy).

        Streaming yields a chunk per hop as tokens arrive; otherwise one chunk per sentence (official
        non-streaming flow: full attention over prompt and tokens). `speed` also streams (each chunk's mel is
        stretched as it comes); the official allows it only without streaming.
        """
        texts = [list(map(int, s)) for s in sentences]
        if not texts or any(not s for s in texts):
            raise EmptyTextError("nothing to synthesize: no sentences, or an empty sentence")
        self._check(voice, options)
        budget = SpeechBudget(self.constants, options.max_speech_s, options.max_sentence_speech_s)
        budget.check(texts)
        rngs = np.random.default_rng(options.seed).spawn(2)
        pace = Pacer(self.gate, self.sample_rate, cancel=cancel)  # a cancel stops a flow solve between its steps
        return released_after(until_cancelled(self._sentences(texts, voice, options, rngs, budget, cancel, pace)))

    def synthesize_tokens(
        self,
        speech_tokens: Sequence[int],
        voice: Voice2,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        *,
        exact_final: bool = False,
    ) -> Iterator[np.ndarray]:
        """Flow + HiFT only: audio pieces for given speech tokens with the chunking `synthesize` uses.

        `exact_final` makes the last streaming chunk the official one: a full-attention recompute of the
        whole sequence (the official final call drops the streaming flag), not the cached chunk-causal solve.
        """
        tokens = [int(t) for t in speech_tokens]
        if not tokens:
            raise EmptyTextError("no speech tokens to vocode")
        if min(tokens) < 0 or max(tokens) >= self.constants.speech_token_size:
            raise InvalidInputError(f"speech tokens must be in 0..{self.constants.speech_token_size - 1}", param="speech_tokens")
        self._check(voice, options)
        rng = np.random.default_rng(options.seed).spawn(2)[1]
        pace = Pacer(self.gate, self.sample_rate)
        return (piece for piece, _ in self._sentence(iter(tokens), voice.flow, options, rng, pace, None, exact_final))

    def schedule_for(self, options: SynthesisOptions) -> HopSchedule:
        """The chunk schedule of one request: the engine's, with the request's first hop when it names one."""
        first = options.first_hop_tokens
        return self.schedule if first is None else replace(self.schedule, first=first)

    def flow_prompt(self, prompt: FlowPrompt2, options: SynthesisOptions) -> FlowPrompt2:
        """What the flow of a sentence sees of the voice's prompt: its window when streaming, else all of it."""
        return prompt.window(self.prompt_window_tokens) if options.stream else prompt

    # ---- internals --------------------------------------------------------------------------------
    def _check(self, voice: Voice2, options: SynthesisOptions) -> None:
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
        voice: Voice2,
        options: SynthesisOptions,
        rngs: list[np.random.Generator],
        budget: SpeechBudget,
        cancel: threading.Event | None,
        pace: Pacer,
    ) -> Iterator[AudioChunk]:
        llm_rng, noise_rng = rngs
        for index, ids in enumerate(texts):
            if cancel is not None and cancel.is_set():
                return
            clock = time.perf_counter()
            flow_prompt = self.flow_prompt(voice.flow, options)
            urgent = self.schedule_for(options).first_audio_tokens(len(flow_prompt.tokens))
            most = budget.limit(len(ids))  # the official bound, or less under the request's caps
            tokens = self.llm.generate(ids, voice.llm, llm_rng, max_tokens=most, cancel=cancel, urgent_tokens=urgent)
            exact = self.official_final_chunk
            pieces = self._sentence(iter(tokens), voice.flow, options, noise_rng, pace, voice.fingerprint, exact, most, cancel)
            made = 0
            for audio, (last, flow_s, hift_s, tokens_in) in pieces:
                llm_s = max(0.0, time.perf_counter() - clock - flow_s - hift_s)
                timings = StageTimings(llm_s=llm_s, flow_s=flow_s, hift_s=hift_s)
                final = last and index == len(texts) - 1
                rate = self.sample_rate
                made += tokens_in
                yield AudioChunk(audio, index, final, timings, sentence_end=last, sample_rate=rate, speech_tokens=tokens_in)
                clock = time.perf_counter()
                if cancel is not None and cancel.is_set():
                    return
            budget.spent(made, len(ids))  # TextTooLongError when a cap, not the model, ended the sentence

    def mel_chunks(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt2,
        options: SynthesisOptions = DEFAULT_OPTIONS,
        *,
        fingerprint: str | None = None,
        exact_final: bool = False,
        pace: Pacer | None = None,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[MelChunk]:
        """The flow half of a sentence: mel chunks (80, 2 * tokens) as `tokens` arrive (one chunk without streaming).

        Streaming chunks end on attention-chunk boundaries (prompt + first hop is a multiple of the chunk), so
        each call continues exactly where the previous one stopped. `fingerprint` names the voice whose
        prompt-only state may be cached; `exact_final` makes the last chunk the official full-attention one.
        `max_tokens`: at most this many speech tokens will come (sizes the flow's caches; more still work).
        A streamed sentence reserves its caches' bytes in `state_budget` before each chunk grows them (waiting while
        they do not fit; it ends early if `cancel` is set meanwhile) and returns them when it ends.
        """
        steps = options.n_timesteps or self.constants.n_timesteps
        pace = pace or Pacer(None, self.sample_rate)
        if not options.stream:
            speech = list(tokens)
            first = first_audio(Progress(0, 0, len(speech), True, pace.audio_s))
            mel, flow_s = self.chunks.whole(prompt, speech, steps, pace, first)
            yield MelChunk(mel, True, flow_s, len(speech), first)
            return
        prompt, schedule = self.flow_prompt(prompt, options), self.schedule_for(options)
        yield from self.chunks.cached(
            tokens, prompt, steps, schedule, fingerprint=fingerprint, pace=pace, max_tokens=max_tokens, cancel=cancel,
            exact_final=exact_final,
        )  # fmt: skip

    def _sentence(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt2,
        options: SynthesisOptions,
        rng: np.random.Generator,
        pace: Pacer,
        fingerprint: str | None,
        exact_final: bool,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[tuple[np.ndarray, tuple[bool, float, float, int]]]:
        """Audio pieces of one sentence with (final, flow seconds, vocoder seconds, speech tokens)."""
        vocoder = VocoderStream(self.vocoder, rng)
        stretch = StreamingStretch(options.speed) if options.stream and options.speed != 1.0 else None
        chunks = self.mel_chunks(
            tokens, prompt, options, fingerprint=fingerprint, exact_final=exact_final, pace=pace, max_tokens=max_tokens,
            cancel=cancel,
        )  # fmt: skip
        before = 0  # the sentence's speech tokens in earlier chunks
        for chunk in chunks:
            clock = time.perf_counter()
            # one thread beside the decode steps (the next chunk's tokens), unless the schedule gives it the cores
            wide = self._wide_vocoder(chunk.tokens, before, chunk.final)
            with pace.turn(first=chunk.first, pauses_llm=wide):
                mel = stretch.push(chunk.mel, final=chunk.final) if stretch is not None else chunk.mel
                audio = vocoder.push(mel, final=chunk.final, speed=1.0 if options.stream else options.speed, wide=wide)
            pace.delivered(audio.shape[0])
            before += chunk.tokens
            yield audio, (chunk.final, chunk.flow_s, time.perf_counter() - clock, chunk.tokens)

    def _wide_vocoder(self, tokens: int, before: int, final: bool) -> bool:
        """Whether the vocoder call of a chunk of `tokens` after `before` of its sentence runs on both cores: the
        schedule says so, there is a wide session, and no other acoustic call runs or waits at the gate (under
        concurrency the calls already fill the cores)."""
        takes = self.schedule.vocoder_takes_cores(tokens, before=before, final=final)
        if self.vocoder.wide is None or self.gate is None or not takes:
            return False
        return self.gate.idle()
