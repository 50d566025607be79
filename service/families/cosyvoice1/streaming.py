"""Streaming a sentence: pull tokens, cut them into chunks as the schedule says, vocode each (spec §6).

A chunk is vocoded once `hop + overlap` tokens are buffered; the first `hop` are consumed and the last
`overlap` (20) tokens start the next chunk, as in the official `CosyVoiceModel.tts`. How large each hop is, and
whether a chunk carries the request's first audio, is decided by the schedule (service.engine.chunking) from
plain state; with `ScheduleConfig.official` every boundary matches the official run.

A non-final chunk must have more than `2 * overlap` tokens. Only then does the length regulator map the last
`overlap` tokens to exactly `mel_overlap_len` (34) frames, which is what the mel cross-fade and the flow cache
assume. So every hop must exceed `overlap`; the engine's first hop is the smallest, `overlap + 1` = 21 (a
41-token first chunk: 70 frames, minus 34 held for the cross-fade, minus 20 held for the vocoder = 16 frames =
0.19 s of audio). The official first audio waits for 120 tokens (2.4 s of speech) plus one flow and one HiFT call.

Since all first chunks have the same length, the first chunks of concurrent requests are vocoded in one batched
flow call (`Token2Wav.first_chunks`, pooled at the AcousticGate). The look-ahead does not change with the hop:
every chunk has 20 tokens of right context at the flow and 20 mel frames at the vocoder.

A cloned voice's flow call solves its prompt frames with every chunk (official `MaskedDiffWithXvec.inference`).
`RequestContext.prompt_window_frames` lets streamed chunks see only the last frames of the prompt (with their
tokens); None keeps the whole prompt (the official computation, and what non-streamed sentences always use).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Protocol

import numpy as np

from service.bundle import ModelConstants
from service.engine.acoustic_gate import Pacer
from service.engine.chunking import Progress, RateMeter, first_audio
from service.engine.scheduler import EndAware
from service.families.cosyvoice1.flow import CoresFree
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.token2wav import ChunkJob, NoiseSource, SentenceState, Token2Wav, WavChunk
from service.families.cosyvoice1.voice import FlowPrompt, as_flow_prompt
from service.layers.dsp import StreamingStretch
from service.layers.mel_stream import TAIL_WAIT_S

Asks = CoresFree | None  # what a call asks before it takes both cores; None: it stays on one
MIN_FIRST_AUDIO_FRAMES = 8  # mel frames (93 ms) a streamed first chunk must yield after a tempo change


@dataclass(frozen=True)
class SpeechChunk:
    """One yielded piece of a sentence: its audio, the speech tokens it consumed, and each stage's seconds."""

    audio: np.ndarray
    is_last: bool  # last chunk of its sentence
    llm_s: float
    flow_s: float
    hift_s: float
    tokens: int = 0  # speech tokens this chunk consumed (its hop; all that remained for the last)


@dataclass
class RequestContext:
    """What every chunk of one request shares: its randomness, schedule, pacing and options (one per request)."""

    noise: NoiseSource
    pace: Pacer
    schedule: ScheduleConfig
    n_timesteps: int | None = None
    speed: float = 1.0
    cancel: threading.Event | None = None
    meter: RateMeter | None = None
    prompt_window_frames: int | None = None  # streamed chunks see this many prompt frames (None: all)
    # Whether a call that may take both cores finds them free now (its argument: the call carries the request's first
    # audio); None: every call stays on its one-thread sessions.
    cores_free: Callable[[bool], bool] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    @classmethod
    def alone(
        cls,
        noise: NoiseSource,
        schedule: ScheduleConfig,
        sample_rate: int,
        *,
        speed: float = 1.0,
        cancel: threading.Event | None = None,
    ) -> RequestContext:
        """A request on its own: no gate to share, nothing measured (checks, tests and tools)."""
        return cls(noise, Pacer(None, sample_rate), schedule, speed=speed, cancel=cancel)


class ReadyTokens(Protocol):
    """A token stream that can tell how many tokens it holds already decoded (scheduler.TokenStream)."""

    def ready(self) -> int: ...


def default_first_hop(constants: ModelConstants) -> int:
    """Engine default for the first hop: the smallest that keeps the overlap frame-aligned (overlap + 1)."""
    return constants.token_overlap_len + 1


def first_hop_for_speed(first_hop: int, speed: float, constants: ModelConstants) -> int:
    """The smallest first hop >= `first_hop` whose first chunk still yields audio after a tempo change.

    The vocoder holds back `mel_cache_len` (20) frames of every non-final chunk, counted after the
    stretch. At speed 1 the default first chunk (41 tokens, 36 frames past the overlap) yields 16
    frames; a faster tempo shrinks it (at 1.8x to nothing), so the hop grows until the stretched first
    chunk yields MIN_FIRST_AUDIO_FRAMES. With the official constants the default first hop (21) is kept
    up to speed 1.28; it is 25 at 1.5, 33 at 2.0 and 65 at 4.0 (the OpenAI maximum). Slower tempos
    never need more.
    """
    c = constants
    hop = first_hop
    while True:
        body = c.tokens_to_mel_frames(hop + c.token_overlap_len) - c.mel_overlap_len
        probe = StreamingStretch(speed).push(np.zeros((1, body), dtype=np.float32), final=False)
        if probe.shape[-1] >= c.mel_cache_len + MIN_FIRST_AUDIO_FRAMES or speed <= 1.0:
            return hop
        hop += 1


def check_first_hop(first_hop: int, constants: ModelConstants) -> None:
    """Raise ValueError unless a first chunk of first_hop + overlap tokens keeps the overlap frame-aligned."""
    if first_hop <= constants.token_overlap_len:
        raise ValueError(f"first_hop_tokens must be > token_overlap_len ({constants.token_overlap_len}), got {first_hop}")


class _TokenPipe:
    """The sentence's tokens with the time spent waiting for them, the tokens buffered, and whether the LLM ended."""

    def __init__(self, tokens: Iterable[int], ctx: RequestContext) -> None:
        self._it = iter(tokens)
        self._ready = getattr(tokens, "ready", None)
        self._ctx = ctx
        self.buf: list[int] = []
        self.done = False
        self.waited_s = 0.0  # since the last chunk
        self._pulled = 0

    def fill(self, n: int) -> bool:
        """Pull tokens until `n` are buffered or the LLM ends (False then, or when cancelled)."""
        while len(self.buf) < n and not self.done:
            self._pull()
        self.top_up()
        return len(self.buf) >= n and not self._ctx.cancelled

    def top_up(self) -> None:
        """Take the tokens already decoded without waiting, so the schedule sees what is really buffered."""
        if self._ready is not None and not self.done:
            for _ in range(int(self._ready())):
                self._pull()

    def ended(self, wait_s: float) -> bool:
        """Whether the LLM will give no more tokens, waiting up to `wait_s` for its next delivery to learn it (a
        scheduler's stream can tell without taking a token; a plain iterator only once it has run out)."""
        if self.done:
            return True
        if not isinstance(self._it, EndAware):
            return False
        t0 = time.perf_counter()
        over = self._it.ended(wait_s)
        self.waited_s += time.perf_counter() - t0
        return over

    def take_wait(self) -> float:
        s, self.waited_s = self.waited_s, 0.0
        return s

    def close(self) -> None:
        close = getattr(self._it, "close", None)
        if close is not None:  # release a generator's resources (the LLM's KV cache) right away
            close()

    def _pull(self) -> None:
        t0 = time.perf_counter()
        tok = next(self._it, None)
        waited = time.perf_counter() - t0
        self.waited_s += waited
        if tok is None or self._ctx.cancelled:
            self.done = True
            return
        self.buf.append(int(tok))
        self._pulled += 1
        if self._ready is None and self._pulled > 1 and self._ctx.meter is not None:
            self._ctx.meter.token_interval(waited)  # decoded on demand: the wait is the token's cost (after the prefill)


def stream_sentence(
    tokens: Iterable[int], prompt: FlowPrompt | np.ndarray, t2w: Token2Wav, ctx: RequestContext
) -> Iterator[SpeechChunk]:
    """Stream one sentence: pull tokens, vocode a chunk whenever the schedule's `hop + overlap` are buffered,
    finalize with the rest once the LLM ends. A chunk whose sentence ends within the schedule's tail after its hop
    is that last call (`takes_tail`; the end is learned within one decode step, TAIL_WAIT_S, except at a sentence's
    first chunk, which never waits).

    `ctx.speed` != 1 changes the tempo chunk by chunk (StreamingStretch between the flow and the vocoder's mel
    cache); the first hop of `ctx.schedule` must come from `first_hop_for_speed` so that the first chunk still
    carries audio. Stops silently (no final chunk) when `ctx.cancel` is set; it is checked after every token, so at
    most the chunk in progress finishes. `llm_s` of a chunk is the time spent waiting for its new tokens.
    """
    c = t2w.constants
    check_first_hop(ctx.schedule.first_hop, c)
    flow_prompt = as_flow_prompt(prompt).window(ctx.prompt_window_frames)
    state, pipe = t2w.new_state(ctx.speed), _TokenPipe(tokens, ctx)
    chunks, last_hop, consumed = 0, 0, 0
    try:
        while True:
            progress = _progress(ctx, chunks, last_hop, pipe, flow_prompt)
            rates = ctx.meter.rates(beside_decode=not pipe.done) if ctx.meter else None
            hop = ctx.schedule.next_hop(progress, rates).tokens
            if not pipe.fill(hop + ctx.schedule.overlap):
                break
            if ctx.schedule.takes_tail(len(pipe.buf) - hop) and pipe.ended(TAIL_WAIT_S if chunks else 0.0):
                break  # the sentence ends within the tail: this chunk is its last and takes the rest along
            window = tuple(pipe.buf[: hop + ctx.schedule.overlap])
            wav = _chunk(window, flow_prompt, t2w, state, ctx, first_audio(progress), consumed, beside_decode=not pipe.done)
            yield SpeechChunk(wav.audio, False, pipe.take_wait(), wav.flow_s, wav.hift_s, hop)
            del pipe.buf[:hop]
            chunks, last_hop, consumed = chunks + 1, hop, consumed + hop
        if not ctx.cancelled:
            first = first_audio(_progress(ctx, chunks, last_hop, pipe, flow_prompt))
            yield _finalize(pipe.buf, flow_prompt, t2w, state, ctx, pipe.take_wait(), 1.0, first, consumed)
    finally:
        pipe.close()


def whole_sentence(
    tokens: Iterable[int], prompt: FlowPrompt | np.ndarray, t2w: Token2Wav, ctx: RequestContext
) -> Iterator[SpeechChunk]:
    """Non-stream path: collect every token, then one flow and one HiFT call over the whole prompt (the official
    computation, `ctx.speed` included). Yields 0 or 1 chunk."""
    pipe = _TokenPipe(tokens, ctx)
    try:
        pipe.fill(1 << 30)
    finally:
        pipe.close()
    if not ctx.cancelled:
        flow_prompt = as_flow_prompt(prompt)
        first = first_audio(_progress(ctx, 0, 0, pipe, flow_prompt))
        yield _finalize(pipe.buf, flow_prompt, t2w, t2w.new_state(), ctx, pipe.take_wait(), ctx.speed, first)


def _progress(ctx: RequestContext, chunks: int, last_hop: int, pipe: _TokenPipe, prompt: FlowPrompt) -> Progress:
    return Progress(chunks, last_hop, len(pipe.buf), pipe.done, ctx.pace.audio_s, prompt.frames, ctx.speed)


def _cores(ctx: RequestContext, tokens: int, *, before: int, final: bool, first: bool) -> tuple[Asks, Asks]:
    """(lanes, wide_vocoder) of a chunk of `tokens` after `before` of its sentence: what its flow and its vocoder call
    ask before they take both cores, where the schedule lets them (takes_cores, vocoder_takes_cores) and the engine
    can tell whether the cores are free (`ctx.cores_free`; `first`: the chunk carries the request's first audio).
    None: that call stays on one core."""
    free = ctx.cores_free
    if free is None:
        return None, None

    def ask() -> bool:
        return free(first)

    flow = ask if ctx.schedule.takes_cores(tokens, first=before == 0, final=final) else None
    return flow, ask if ctx.schedule.vocoder_takes_cores(tokens, before=before, final=final) else None


def _chunk(
    chunk: tuple[int, ...],
    prompt: FlowPrompt,
    t2w: Token2Wav,
    state: SentenceState,
    ctx: RequestContext,
    first: bool,
    before: int,
    *,
    beside_decode: bool,
) -> WavChunk:
    """One non-final chunk after `before` tokens of its sentence. The request's first audio is pooled with other
    requests' first chunks at the gate."""
    lanes, wide = _cores(ctx, len(chunk) - ctx.schedule.overlap, before=before, final=False, first=first)
    if first and ctx.pace.gate is not None:  # several requests' first chunks may be solved in one batch
        job = ChunkJob(chunk, prompt, state, ctx.noise, ctx.n_timesteps)
        key, limit = t2w.pool_key(chunk, prompt, ctx.n_timesteps), t2w.pool_limit(chunk, prompt)
        wav = ctx.pace.pooled(key, job, partial(t2w.first_chunks, lanes=lanes, wide_vocoder=wide), max_group=limit)
    else:
        with ctx.pace.turn(first=first) as step_aside:
            wav = t2w(
                chunk, prompt, state, ctx.noise, finalize=False, n_timesteps=ctx.n_timesteps, between_steps=step_aside,
                lanes=lanes, wide_vocoder=wide,
            )  # fmt: skip
        _observe(ctx.meter, wav, beside_decode)
    ctx.pace.delivered(wav.audio.size)
    return wav


def _finalize(
    buf: list[int],
    prompt: FlowPrompt,
    t2w: Token2Wav,
    state: SentenceState,
    ctx: RequestContext,
    llm_s: float,
    speed: float,
    first: bool,
    before: int = 0,
) -> SpeechChunk:
    if not buf:  # nothing generated (e.g. max_tokens=0): an empty final chunk keeps the sentence boundary
        return SpeechChunk(np.zeros(0, dtype=np.float32), True, llm_s, 0.0, 0.0)
    lanes, wide = _cores(ctx, len(buf), before=before, final=True, first=first)
    with ctx.pace.turn(first=first) as step_aside:
        wav = t2w(
            buf, prompt, state, ctx.noise, finalize=True, speed=speed, n_timesteps=ctx.n_timesteps, between_steps=step_aside,
            lanes=lanes, wide_vocoder=wide,
        )  # fmt: skip
    _observe(ctx.meter, wav, False)  # its sentence's tokens are all decoded
    ctx.pace.delivered(wav.audio.size)
    return SpeechChunk(wav.audio, True, llm_s, wav.flow_s, wav.hift_s, len(buf))


def _observe(meter: RateMeter | None, wav: WavChunk, beside_decode: bool) -> None:
    """Record a chunk's acoustic rates, made `beside_decode` (its sentence's tokens still being decoded) or after."""
    if meter is not None:
        meter.flow_call(wav.solver_frames, wav.flow_s, beside_decode=beside_decode)
        meter.vocoder_call(wav.vocoded_frames, wav.hift_s, beside_decode=beside_decode)
