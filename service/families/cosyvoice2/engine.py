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
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import FAMILY_V2, V2_GRAPH_IO, V2_NOISE_NAME, CosyVoice2Constants, ModelBundle
from service.engine import native
from service.engine.acoustic_gate import AcousticGate, Pacer, until_cancelled
from service.engine.dsp import StreamingStretch
from service.engine.hift import HiFTRunner
from service.engine.memory import StateBudget, auto_budget
from service.engine.scheduler import BatchScheduler, EndAware
from service.engine.sessions import RuntimeOptions, graph_runtime, limit_malloc_arenas, open_sessions
from service.engine.speech_budget import SpeechBudget
from service.engine.synthesizer import AudioChunk, StageTimings, SynthesisOptions, TokenGenerator
from service.errors import BundleError, EmptyTextError, InvalidInputError
from service.families.cosyvoice2.flow import FlowRunner2, FlowState
from service.families.cosyvoice2.hift import Vocoder, VocoderStream
from service.families.cosyvoice2.llm import Qwen2Runner
from service.families.cosyvoice2.schedule import HopSchedule, window_tokens
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2

log = logging.getLogger(__name__)

DEFAULT_OPTIONS = SynthesisOptions()
DEFAULT_PROMPT_CACHE_BYTES = 2 << 30  # prompt flow states kept for reuse (a 10 s prompt: ~1 GB fp16 full-size)
PromptKey = tuple[str, int, int]  # voice fingerprint, Euler steps, prompt tokens the flow sees
# The sessions key of the HiFT decode graph on WIDE_THREADS threads: what a vocoder call that takes the cores runs
# (HopSchedule.vocoder_takes_cores); the wide width is the estimator's, its two guidance rows side by side.
WIDE_HIFT_DECODE = "hift_decode/wide"
WIDE_THREADS = 2
# Tasks a decode step's int8 products are split into while the acoustic gate is idle (native.spread_decode_products):
# full size, batch 1, two threads, 14.4-15.2 against 16.9-17.0 ms a step in a stream (2 tasks: 16.9-17.3 ms alone).
DECODE_SPREAD = 4
# How long a chunk's cut waits for its token stream's next delivery to learn whether the sentence has ended (one decode
# step is in flight then: 14-27 ms at batch 1 on the 2-core hosts measured; a step that does not come in time only
# leaves the look-ahead tokens to a last chunk of their own). A sentence's first chunk never waits (first audio).
TAIL_WAIT_S = 0.05


class PromptStates:
    """Flow states after a prompt's prompt-only chunks, by voice fingerprint, least recently used dropped first.

    States are shared, never written: a request continues from a `FlowState.copy()` (the estimator's caches, which
    grow in place, are copied; the encoder's arrays are shared).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._states: OrderedDict[PromptKey, FlowState] = OrderedDict()

    def get(self, key: PromptKey) -> FlowState | None:
        with self._lock:
            state = self._states.get(key)
            if state is not None:
                self._states.move_to_end(key)
            return state

    def put(self, key: PromptKey, state: FlowState) -> None:
        size = state.nbytes()
        if size > self.max_bytes:
            return
        with self._lock:
            self._states[key] = state
            self._states.move_to_end(key)
            while sum(s.nbytes() for s in self._states.values()) > self.max_bytes:
                self._states.popitem(last=False)

    def __len__(self) -> int:
        return len(self._states)


@dataclass(frozen=True)
class MelChunk:
    """A piece of a sentence's mel (80, frames) from the flow, and the seconds the flow took for it."""

    mel: np.ndarray
    final: bool
    flow_s: float
    tokens: int  # speech tokens whose frames this chunk holds


@dataclass
class _Sentence:
    """One sentence's streaming progress: speech tokens, flow tokens encoded, current hop."""

    prompt: FlowPrompt2
    state: FlowState
    hop: int
    speech: list[int]
    offset: int = 0  # speech tokens whose audio is out

    @property
    def encoded(self) -> int:
        return self.state.encoder.tokens


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
        extra = bundle.manifest.cosyvoice2
        if bundle.family != FAMILY_V2 or extra is None:
            raise BundleError(f"{bundle.root}: not a CosyVoice2 bundle (family {bundle.family!r})")
        c = bundle.constants
        self.bundle, self.constants, self.extra = bundle, c, extra
        self.sample_rate = c.sample_rate
        self.runner = Qwen2Runner(sessions, c, extra)
        self.llm: TokenGenerator = llm if llm is not None else self.runner
        self.scheduler = llm if isinstance(llm, BatchScheduler) else None
        noise = np.load(bundle.root / V2_NOISE_NAME, allow_pickle=False)
        self.flow = FlowRunner2(sessions, c, extra, noise, cfg_lanes=cfg_lanes)
        wide = sessions.get(WIDE_HIFT_DECODE)
        wide_runner = HiFTRunner({**sessions, "hift_decode": wide}, c) if wide is not None else None
        self.vocoder = Vocoder(HiFTRunner(sessions, c), wide_runner)
        self.schedule = schedule or HopSchedule.official(extra, c)
        self.prompt_window_tokens = prompt_window_tokens
        self.gate = gate
        self.prompt_states = PromptStates(prompt_cache_bytes)
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
        runner = Qwen2Runner(sessions, bundle.constants, _extra(bundle))
        gate = AcousticGate(runtime.acoustic_slots, nice=runtime.acoustic_nice) if runtime.acoustic_slots > 0 else None
        llm: TokenGenerator = runner
        schedule = kwargs.setdefault("schedule", stream_schedule(bundle, runtime))
        if runtime.max_batch > 0:
            yield_to = gate.first_audio_running if gate is not None and runtime.first_audio_priority else None
            lead = schedule.decode_lead if runtime.decode_lead_tokens is None else runtime.decode_lead_tokens
            busy = gate.busy if gate is not None else None
            spread = decode_spread(bundle, runtime, gate)
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
            if self.scheduler.before_step is not None:
                native.spread_decode_products(1)  # no step of this engine runs any more
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
        return until_cancelled(self._sentences(texts, voice, options, rngs, budget, cancel, pace))

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
            urgent = self.schedule.first_audio_tokens(len(flow_prompt.tokens), options.first_hop_tokens)
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
            mel, flow_s = self._whole(prompt, speech, steps, pace)
            yield MelChunk(mel, True, flow_s, len(speech))
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
        schedule = self.schedule
        base = options.first_hop_tokens or schedule.first
        job = _Sentence(prompt, state, schedule.first_hop(len(prompt.tokens), base), [])
        budget, per_frame, owner = self.state_budget, state.bytes_per_frame(), object()  # owner: this sentence
        stop = cancel.is_set if cancel is not None else None
        try:
            if not budget.reserve(owner, state.nbytes(), stop):
                return
            for token in tokens:
                job.speech.append(int(token))
                while len(job.speech) - job.offset >= job.hop + schedule.look_ahead:
                    left = len(job.speech) - job.offset - job.hop
                    if schedule.takes_tail(left) and _ended(tokens, TAIL_WAIT_S if job.offset else 0.0):
                        break  # the stream has ended: this chunk is the last and takes its look-ahead along
                    if not budget.reserve(owner, per_frame * self._new_frames(job, final=False), stop):
                        return
                    yield self._flow_chunk(job, pace, final=False)
                    job.hop, base = schedule.next_hop(base, len(prompt.tokens) + job.offset)
            grows = 0 if exact_final else per_frame * self._new_frames(job, final=True)  # the exact pass keeps none
            if not budget.reserve(owner, grows, stop):
                return
            yield self._flow_chunk(job, pace, final=True, exact=exact_final)
        finally:
            budget.release(owner)

    def _new_frames(self, job: _Sentence, *, final: bool) -> int:
        """Mel frames the next chunk adds to the flow's caches (the final chunk: everything not yet encoded)."""
        end = len(job.prompt.tokens) + (len(job.speech) if final else job.offset + job.hop)
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
            with pace.turn(first=pace.audio_s == 0.0, pauses_llm=wide):
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

    def _flow_chunk(self, job: _Sentence, pace: Pacer, *, final: bool, exact: bool = False) -> MelChunk:
        """Flow for the next hop (or the rest): the new tokens after what is encoded, with their look-ahead."""
        prompt_tokens = len(job.prompt.tokens)
        seq = np.asarray([*job.prompt.tokens, *job.speech], dtype=np.int64)
        end = len(seq) if final else prompt_tokens + job.offset + job.hop
        start = job.encoded
        tokens = end - prompt_tokens - job.offset  # this chunk's speech tokens
        clock = time.perf_counter()
        if final and exact:
            mel, _ = self._whole(job.prompt, job.speech, len(job.state.steps), pace)
            mel = mel[:, 2 * job.offset :]
        else:
            wide = self.schedule.takes_cores(tokens, first=job.offset == 0, final=final)
            with pace.turn(first=pace.audio_s == 0.0, pauses_llm=wide) as step_aside:
                context = seq[end : end + self.schedule.look_ahead]
                mel = self.flow.advance(seq[start:end], context, job.prompt, job.state, between_steps=step_aside, wide=wide)
            mel = mel[:, max(0, 2 * (prompt_tokens - start)) :]
        job.offset = end - prompt_tokens
        return MelChunk(mel, final, time.perf_counter() - clock, tokens)

    def _whole(self, prompt: FlowPrompt2, speech: list[int], steps: int, pace: Pacer) -> tuple[np.ndarray, float]:
        """The official non-streaming flow: prompt + all tokens in one call, full attention -> mel (80, 2N), seconds."""
        clock = time.perf_counter()
        seq = np.asarray([*prompt.tokens, *speech], dtype=np.int64)
        state = self.flow.empty_state(steps)
        with pace.turn(first=pace.audio_s == 0.0) as step_aside:
            mel = self.flow.advance(seq, seq[:0], prompt, state, full_attention=True, between_steps=step_aside)
        return mel[:, 2 * len(prompt.tokens) :], time.perf_counter() - clock


def open_engine_sessions(bundle: ModelBundle, runtime: RuntimeOptions, *, wide: bool) -> dict[str, Any]:
    """The bundle's CosyVoice2 graphs as `runtime` asks; `wide` adds the HiFT decode graph on WIDE_THREADS intra-op
    threads (WIDE_HIFT_DECODE) for the vocoder calls that take both cores."""
    sessions = open_sessions(bundle, runtime, names=tuple(V2_GRAPH_IO))
    if wide:
        two = replace(runtime, acoustic_threads=WIDE_THREADS)
        sessions[WIDE_HIFT_DECODE] = open_sessions(bundle, two, names=("hift_decode",))["hift_decode"]
    return sessions


def decode_spread(bundle: ModelBundle, runtime: RuntimeOptions, gate: AcousticGate | None) -> Callable[[], None] | None:
    """What the scheduler calls before each decode step when the step runs our int8 kernel on more than one thread:
    while no acoustic call runs or waits (`gate.idle`), the step's products are shared over its threads
    (DECODE_SPREAD tasks), else they stay on the scheduler's thread beside the flow. None where that cannot apply."""
    if gate is None or runtime.threads_for("llm") < 2 or graph_runtime(bundle, "llm_step", runtime).custom_ops is None:
        return None

    def spread() -> None:
        native.spread_decode_products(DECODE_SPREAD if gate.idle() else 1)

    return spread


def one_thread_calls(runtime: RuntimeOptions) -> RuntimeOptions:
    """The acoustic thread budget spent as one-thread calls: unless `acoustic_threads` is set, every flow/HiFT call runs
    one intra-op thread and the gate admits as many calls at once as the budget had threads (slots x threads).

    The full-size estimator runs ~3,300 small kernels per call and ONNX Runtime's second intra-op thread barely shortens a call
    (100 frames: 190 ms -> 180 ms), while two one-thread calls on two cores run at full speed each (measured 208 ms
    each side by side); a request alone gets both cores through the CFG lanes (FlowRunner2)."""
    if runtime.acoustic_threads is not None or runtime.acoustic_slots == 0:
        return runtime
    return replace(runtime, acoustic_threads=1, acoustic_slots=runtime.acoustic_slots * runtime.intra_op_threads)


def flow_budget(runtime: RuntimeOptions) -> StateBudget:
    """The bound on streamed sentences' estimator caches that `runtime.flow_cache_mb` asks for: None sizes it from the
    memory limit and what is resident now (call it with the sessions open), 0 leaves it unbounded."""
    mb = runtime.flow_cache_mb
    limit = auto_budget() if mb is None else (mb << 20 if mb > 0 else None)
    if limit is None:
        log.info("flow caches of streamed sentences: no bound")
    else:
        log.info("flow caches of streamed sentences: at most %d MB at once%s", limit >> 20, " (auto)" if mb is None else "")
    return StateBudget(limit)


def stream_schedule(bundle: ModelBundle, runtime: RuntimeOptions) -> HopSchedule:
    """The schedule `runtime` asks for: "official" (CosyVoice2Model.tts) or the default early first audio; either with
    `runtime.first_hop_tokens` as its first hop when that is set (the official one still pads it to a chunk boundary)."""
    extra, c = _extra(bundle), bundle.constants
    if runtime.stream_schedule == "official":
        official = HopSchedule.official(extra, c)
        return official if runtime.first_hop_tokens is None else replace(official, first=runtime.first_hop_tokens)
    return HopSchedule.early(extra, c, runtime.first_hop_tokens)


def _ended(tokens: Iterator[int], wait_s: float) -> bool:
    """Whether `tokens` will give no more, waiting up to `wait_s` to learn it (a scheduler's TokenStream can tell; a
    plain iterator cannot, and its look-ahead tokens get a last chunk of their own)."""
    return isinstance(tokens, EndAware) and tokens.ended(wait_s)


def _extra(bundle: ModelBundle) -> CosyVoice2Constants:
    extra = bundle.manifest.cosyvoice2
    if bundle.family != FAMILY_V2 or extra is None:
        raise BundleError(f"{bundle.root}: not a CosyVoice2 bundle (family {bundle.family!r})")
    return extra
