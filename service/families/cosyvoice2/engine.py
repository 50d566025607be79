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
from service.engine.chunking import Hop, Progress, first_audio
from service.engine.host import limit_malloc_arenas, released_after
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.speech_budget import SpeechBudget
from service.engine.types import AudioChunk, StageTimings, SynthesisOptions, TokenGenerator
from service.errors import EmptyTextError, InvalidInputError
from service.families.cosyvoice2.assembly import (
    WIDE_HIFT_DECODE,
    decode_spread,
    extra_constants,
    flow_budget,
    one_thread_calls,
    open_engine_sessions,
    stream_schedule,
)
from service.families.cosyvoice2.contract import NOISE_NAME
from service.families.cosyvoice2.flow import FlowRunner2, FlowState
from service.families.cosyvoice2.sentence import TAIL_WAIT_S, MelChunk, Sentence, ended
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2
from service.layers.chunk_schedule import HopSchedule, window_tokens
from service.layers.dsp import StreamingStretch
from service.layers.frame_cache import PromptStates
from service.layers.hift import HiFTRunner
from service.layers.qwen2 import Qwen2Runner
from service.layers.vocoder import Vocoder, VocoderStream

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = SynthesisOptions()
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30  # prompt flow states kept for reuse (a 10 s prompt: ~1 GB fp16 full-size)
PromptKey = tuple[str, int, int]  # voice fingerprint, Euler steps, prompt tokens the flow sees


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
    ) -> None:
        """`official_final_chunk`: end every stream like the official code, with one full-attention flow pass over the
        whole sentence for the last chunk (exact official audio, at the cost of that pass before the last audio).
        `schedule`: how streamed sentences are cut (None: the official HopSchedule). `prompt_window_tokens`: the last
        prompt tokens (with their mel) a streamed flow sees (None: the whole prompt, as the official). `cfg_lanes`: the
        estimator's two guidance rows run as two concurrent calls (FlowRunner2). `state_budget`: what the streamed
        sentences' estimator caches may hold at once (None: no bound; `load` sizes it from `flow_cache_mb`).
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
        self.flow = FlowRunner2(sessions, c, extra, noise, cfg_lanes=cfg_lanes)
        wide = sessions.get(WIDE_HIFT_DECODE)
        wide_runner = HiFTRunner({**sessions, "hift_decode": wide}, c) if wide is not None else None
        self.vocoder = Vocoder(HiFTRunner(sessions, c), wide_runner)
        self.schedule = schedule or HopSchedule.official(extra.chunk_tokens, extra.pre_lookahead, c)
        self.prompt_window_tokens = prompt_window_tokens
        self.gate = gate
        self.prompt_states: PromptStates[PromptKey, FlowState] = PromptStates(prompt_cache_bytes)
        self.official_final_chunk = official_final_chunk
        self.state_budget = state_budget or StateBudget(None)

    @classmethod
    def load(cls, bundle: ModelBundle | str | Path, runtime: RuntimeOptions | None = None, **kwargs: Any) -> CosyVoice2Engine:
        """Load a bundle, open its graphs, and start the batching scheduler / acoustic gate `runtime` asks for."""
        loaded = bundle if isinstance(bundle, ModelBundle) else ModelBundle.load(bundle)
        runtime = one_thread_calls(runtime or RuntimeOptions())
        limit_malloc_arenas(runtime.malloc_arenas)
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

    def prompt_state(self, prompt: FlowPrompt2, n_timesteps: int, fingerprint: str, capacity: int) -> FlowState:
        """The voice's prompt-only flow state (cached by fingerprint and window), as a copy this request may extend to
        `capacity` frames."""
        key = (fingerprint, n_timesteps, len(prompt.tokens))
        state = self.prompt_states.get(key)
        if state is None:
            state = self.flow.prompt_state(prompt, n_timesteps, capacity=0)  # kept: room for its own frames only
            self.prompt_states.put(key, state)
        return state.copy(capacity)

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
            mel, flow_s = self._whole(prompt, speech, steps, pace, first)
            yield MelChunk(mel, True, flow_s, len(speech), first)
            return
        prompt = self.flow_prompt(prompt, options)
        if max_tokens is None:
            capacity = self.flow.noise.shape[1]  # all the frames the flow can solve
        else:
            capacity = self.extra.token_mel_ratio * (len(prompt.tokens) + max_tokens + self.schedule.look_ahead)
        if fingerprint:
            state = self.prompt_state(prompt, steps, fingerprint, capacity)
        else:
            state = self.flow.prompt_state(prompt, steps, capacity)
        schedule = self.schedule_for(options)
        job = Sentence(prompt, state, Hop(0, 0), [])
        job.hop = schedule.next_hop(job.progress(pace.audio_s), None)
        budget, per_frame, owner = self.state_budget, state.bytes_per_frame(), object()  # owner: this sentence
        stop = cancel.is_set if cancel is not None else None
        try:
            if not budget.reserve(owner, state.nbytes(), stop):
                return
            for token in tokens:
                job.speech.append(int(token))
                while len(job.speech) - job.offset >= job.hop.tokens + job.hop.look_ahead:
                    left = len(job.speech) - job.offset - job.hop.tokens
                    if schedule.takes_tail(left) and ended(tokens, TAIL_WAIT_S if job.offset else 0.0):
                        break  # the stream has ended: this chunk is the last and takes its look-ahead along
                    if not budget.reserve(owner, per_frame * self._new_frames(job, final=False), stop):
                        return
                    yield self._flow_chunk(job, pace, final=False)
                    job.hop = schedule.next_hop(job.progress(pace.audio_s), None)
            grows = 0 if exact_final else per_frame * self._new_frames(job, final=True)  # the exact pass keeps none
            if not budget.reserve(owner, grows, stop):
                return
            yield self._flow_chunk(job, pace, final=True, exact=exact_final)
        finally:
            budget.release(owner)

    def _new_frames(self, job: Sentence, *, final: bool) -> int:
        """Mel frames the next chunk adds to the flow's caches (the final chunk: everything not yet encoded)."""
        end = len(job.prompt.tokens) + (len(job.speech) if final else job.offset + job.hop.tokens)
        return self.extra.token_mel_ratio * max(0, end - job.encoded)

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

    def _flow_chunk(self, job: Sentence, pace: Pacer, *, final: bool, exact: bool = False) -> MelChunk:
        """Flow for the next hop (or the rest): the new tokens after what is encoded, with their look-ahead."""
        prompt_tokens = len(job.prompt.tokens)
        seq = np.asarray([*job.prompt.tokens, *job.speech], dtype=np.int64)
        end = len(seq) if final else prompt_tokens + job.offset + job.hop.tokens
        start = job.encoded
        tokens = end - prompt_tokens - job.offset  # this chunk's speech tokens
        first = first_audio(job.progress(pace.audio_s))
        clock = time.perf_counter()
        if final and exact:
            mel, _ = self._whole(job.prompt, job.speech, len(job.state.steps), pace, first)
            mel = mel[:, 2 * job.offset :]
        else:
            wide = self.schedule.takes_cores(tokens, first=job.offset == 0, final=final)
            with pace.turn(first=first, pauses_llm=wide) as step_aside:
                context = seq[end : end + self.schedule.look_ahead]
                mel = self.flow.advance(seq[start:end], context, job.prompt, job.state, between_steps=step_aside, wide=wide)
            mel = mel[:, max(0, 2 * (prompt_tokens - start)) :]
        job.offset, job.chunks = end - prompt_tokens, job.chunks + 1
        return MelChunk(mel, final, time.perf_counter() - clock, tokens, first)

    def _whole(self, prompt: FlowPrompt2, speech: list[int], steps: int, pace: Pacer, first: bool) -> tuple[np.ndarray, float]:
        """The official non-streaming flow: prompt + all tokens in one call, full attention -> mel (80, 2N), seconds.
        `first`: it carries the request's first audio."""
        clock = time.perf_counter()
        seq = np.asarray([*prompt.tokens, *speech], dtype=np.int64)
        state = self.flow.empty_state(steps)
        with pace.turn(first=first) as step_aside:
            mel = self.flow.advance(seq, seq[:0], prompt, state, full_attention=True, between_steps=step_aside)
        return mel[:, 2 * len(prompt.tokens) :], time.perf_counter() - clock
