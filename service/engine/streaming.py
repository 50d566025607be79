"""The v1 token-to-waveform state machine (spec §6): overlapping token chunks, flow/HiFT caches, Hamming cross-fades.

Chunking follows the official `CosyVoiceModel.tts`: a chunk is vocoded once `hop + overlap` tokens are
buffered; the first `hop` are consumed and the last `overlap` (20) tokens start the next chunk. The only
change is the size of the first hop. Officially every hop is `token_hop_len` (100), so the first audio
waits for 120 tokens (2.4 s of speech) plus one flow and one HiFT call. Here the first hop defaults to
the smallest one that keeps the overlap frame-aligned, `overlap + 1` = 21 tokens (the first chunk has
41 tokens), and later hops follow the official schedule (`token_hop_len`, scaled by
`stream_scale_factor` up to `token_max_hop_len`). With `first_hop_tokens = token_hop_len`, every
boundary matches the official run.

A non-final chunk must have more than `2 * overlap` tokens. Only then does the length regulator map
the last `overlap` tokens to exactly `mel_overlap_len` (34) frames, which is what the mel cross-fade
and the flow cache assume. So the first hop must be at least `overlap + 1` tokens.

Why the smallest: measured on the full-size int8 model (2 cores), the first audio is about 0.4 s of
decoding plus 0.45 s of flow plus 0.08 s of HiFT with a 41-token first chunk, against 0.55 + 0.7 + 0.13 s
with 50 tokens; flow calls this small are overhead bound, so every frame saved counts. And since all
first chunks have the same length, the first chunks of concurrent requests are vocoded in one batched
flow call (`Token2Wav.first_chunks`, pooled at the AcousticGate).

What the smaller first hop costs:
* At most one more chunk per sentence, so 20 more tokens through the flow (34 frames) and 20 more mel
  frames through HiFT. For a 10 s sentence (500 tokens) that is 600 instead of 580 flow tokens and 960
  instead of 940 vocoded frames, i.e. 2-4% more acoustic work.
* The first chunk carries little audio: 41 tokens -> 70 frames, minus 34 held for the cross-fade, minus
  20 held for the vocoder cache = 16 frames = 4096 samples = 0.19 s. The second chunk needs 100 more
  tokens, so it arrives about 2 s x RTF later (RTF = the engine's real-time factor). A client that
  starts playing at once hears a gap unless it buffers; the official schedule has the same kind of gap
  once RTF exceeds about 0.9.
* The look-ahead does not change. Every chunk still has 20 tokens of right context at the flow and
  20 mel frames at the vocoder. The flow encoder of the first chunk attends over 41 tokens instead of
  120, so the first 0.4 s are generated with less context.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.bundle import ModelConstants
from service.engine.dsp import StreamingStretch, fade_in_out, interpolate_linear
from service.engine.flow import FlowCache, FlowInput, FlowRunner
from service.engine.hift import HiFTNoise, HiFTRunner, draw_hift_noise
from service.engine.scheduler import Pacer
from service.engine.voice import FlowPrompt, as_flow_prompt


class NoiseSource(Protocol):
    """Where the acoustic half gets its randomness: flow's initial z and SineGen's phase and noise."""

    def flow_noise(self, n_mels: int, n_frames: int) -> np.ndarray:
        """Standard normal (n_mels, n_frames) float32."""
        ...

    def hift_noise(self, n_harmonics: int, n_samples: int) -> HiFTNoise:
        """Phases and per-sample noise for one SineGen call."""
        ...


class GeneratorNoise:
    """NoiseSource drawing from a numpy Generator (one per request, so requests never share state)."""

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def flow_noise(self, n_mels: int, n_frames: int) -> np.ndarray:
        return self.rng.standard_normal((n_mels, n_frames), dtype=np.float32)

    def hift_noise(self, n_harmonics: int, n_samples: int) -> HiFTNoise:
        return draw_hift_noise(self.rng, n_harmonics, n_samples)


class ReplayNoise:
    """NoiseSource that hands out recorded draws in call order (parity checks against the official code)."""

    def __init__(self, flow: Sequence[np.ndarray], hift: Sequence[HiFTNoise]) -> None:
        self._flow = list(flow)
        self._hift = list(hift)

    def flow_noise(self, n_mels: int, n_frames: int) -> np.ndarray:
        if not self._flow:
            raise ValueError("no recorded flow noise left")
        z = np.asarray(self._flow.pop(0), dtype=np.float32).reshape(n_mels, -1)
        if z.shape[1] != n_frames:
            raise ValueError(f"recorded flow noise has {z.shape[1]} frames, the call needs {n_frames}")
        return z

    def hift_noise(self, n_harmonics: int, n_samples: int) -> HiFTNoise:
        if not self._hift:
            raise ValueError("no recorded hift noise left")
        rec = self._hift.pop(0)
        if rec.sine_noise.shape != (n_harmonics, n_samples):
            raise ValueError(f"recorded hift noise is {rec.sine_noise.shape}, the call needs {(n_harmonics, n_samples)}")
        return rec


@dataclass(frozen=True)
class HiFTCache:
    """Vocoder state carried to the next chunk: last mel frames, their source samples and output samples."""

    mel: np.ndarray  # (n_mels, mel_cache_len)
    source: np.ndarray  # (source_cache_len,)
    speech: np.ndarray  # (source_cache_len,)


@dataclass
class SentenceState:
    """Per-sentence streaming caches; a fresh one per sentence, never shared between requests."""

    flow_cache: FlowCache
    mel_overlap: np.ndarray  # (n_mels, 0 or mel_overlap_len)
    hift: HiFTCache | None = None
    stretch: StreamingStretch | None = None  # tempo change of a streamed sentence (speed != 1)

    @property
    def fresh(self) -> bool:
        return self.hift is None and self.mel_overlap.shape[-1] == 0


@dataclass(frozen=True)
class WavChunk:
    """Audio (N,) float32 of one token2wav call and the seconds spent in flow and in HiFT."""

    audio: np.ndarray
    flow_s: float
    hift_s: float


@dataclass(frozen=True)
class SpeechChunk:
    """One yielded piece of a sentence with the time each stage spent on it."""

    audio: np.ndarray
    is_last: bool  # last chunk of its sentence
    llm_s: float
    flow_s: float
    hift_s: float


@dataclass(frozen=True)
class ChunkJob:
    """One non-final token2wav call as data, so another thread may run it (batched with others of equal length)."""

    tokens: tuple[int, ...]
    prompt: FlowPrompt
    state: SentenceState
    noise: NoiseSource
    n_timesteps: int | None


class Token2Wav:
    """Official v1 `token2wav`: flow with cache, mel cross-fade, HiFT with mel/source cache, speech cross-fade."""

    def __init__(self, flow: FlowRunner, hift: HiFTRunner, constants: ModelConstants) -> None:
        self.flow = flow
        self.hift = hift
        self.constants = constants
        self.mel_window = np.hamming(2 * constants.mel_overlap_len)
        self.speech_window = np.hamming(2 * constants.source_cache_len)

    def new_state(self, speed: float = 1.0) -> SentenceState:
        """Fresh caches for one sentence; `speed` != 1 streams with a tempo change (see StreamingStretch)."""
        n_mels = self.constants.n_mels
        return SentenceState(
            flow_cache=FlowCache.empty(n_mels),
            mel_overlap=np.zeros((n_mels, 0), dtype=np.float32),
            stretch=StreamingStretch(speed) if speed != 1.0 else None,
        )

    def __call__(
        self,
        tokens: Sequence[int] | np.ndarray,
        prompt: FlowPrompt | np.ndarray,
        state: SentenceState,
        noise: NoiseSource,
        *,
        finalize: bool,
        speed: float = 1.0,
        n_timesteps: int | None = None,
        between_steps: Callable[[], None] | None = None,
    ) -> WavChunk:
        """Audio for `tokens`, updating `state` in place. Non-final calls hold back the overlap tail.

        `speed` != 1 stretches the mel to max(1, int(frames / speed)) and needs a fresh state with finalize=True
        (the official code allows it only on the non-stream path). A streamed sentence changes its tempo
        through the state instead (`new_state(speed)`). `between_steps` is called between two Euler steps of
        the flow (the AcousticGate's step_aside).
        """
        if speed != 1.0 and not (finalize and state.fresh):
            raise ValueError("speed != 1 is only supported for a whole sentence in one finalize call")
        t0 = time.perf_counter()
        inp = self._prepare(tokens, as_flow_prompt(prompt), state, noise)
        (mel,) = self.flow.solve_inputs([inp], self.flow.steps(n_timesteps), between_steps)
        return self._after_flow(mel, state, noise, finalize, speed, time.perf_counter() - t0)

    def first_chunks(self, jobs: Sequence[ChunkJob]) -> Iterator[WavChunk]:
        """Non-final chunks of several requests with equal solver frames and steps (first chunks: fresh states).

        The flow solver runs once for all of them (`FlowRunner.solve_inputs`), then each is vocoded in
        turn and yielded at once, so the first request's audio is not held back by the others' HiFT.
        Each result equals its own `__call__(..., finalize=False)` up to float rounding. Requests with
        prompts pool only with requests of the same prompt frame count and token count (`pool_key`).
        """
        if not jobs:
            return
        t0 = time.perf_counter()
        steps = {self.flow.steps(job.n_timesteps) for job in jobs}
        if len(steps) != 1 or len({self.pool_key(job.tokens, job.prompt, job.n_timesteps) for job in jobs}) != 1:
            raise ValueError("first_chunks needs jobs with equal token counts, prompt frames and flow steps")
        prepared = [self._prepare(job.tokens, job.prompt, job.state, job.noise) for job in jobs]
        mels = self.flow.solve_inputs(prepared, steps.pop())
        flow_s = time.perf_counter() - t0
        for job, mel in zip(jobs, mels, strict=True):
            yield self._after_flow(mel, job.state, job.noise, False, 1.0, flow_s)

    def pool_limit(self, tokens: Sequence[int], prompt: FlowPrompt) -> int:
        """How many first chunks like this one one batched solve may take (>= 1): POOLED_SOLVER_FRAMES in all."""
        return max(1, POOLED_SOLVER_FRAMES // self.flow.solver_frames(len(tokens), prompt))

    def pool_key(self, tokens: Sequence[int], prompt: FlowPrompt, n_timesteps: int | None) -> tuple[int, int, int]:
        """Chunks with equal keys have solver inputs of one shape and may be solved in one batch."""
        return (len(tokens), prompt.frames, self.flow.steps(n_timesteps))

    def _prepare(
        self, tokens: Sequence[int] | np.ndarray, prompt: FlowPrompt, state: SentenceState, noise: NoiseSource
    ) -> FlowInput:
        """Draw z, run the flow's encoder half and move the flow cache forward; the solver's inputs."""
        z = noise.flow_noise(self.constants.n_mels, self.flow.solver_frames(len(tokens), prompt))
        inp, state.flow_cache = self.flow.prepare(np.asarray(tokens), prompt, z, state.flow_cache)
        return inp

    def _after_flow(
        self, mel: np.ndarray, state: SentenceState, noise: NoiseSource, finalize: bool, speed: float, flow_s: float
    ) -> WavChunk:
        """Mel cross-fade, HiFT with its caches and the speech cross-fade; non-final calls hold back the overlap tail."""
        t1 = time.perf_counter()
        c = self.constants
        if state.mel_overlap.shape[-1]:
            mel = fade_in_out(mel, state.mel_overlap, self.mel_window)
        whole = finalize and state.fresh  # the whole sentence in one call: the official path, speed included
        if state.stretch is not None:
            speed = state.stretch.speed
        if not finalize:
            state.mel_overlap = mel[:, -c.mel_overlap_len :]
            mel = mel[:, : -c.mel_overlap_len]
        if state.stretch is not None and not whole:  # streamed tempo change, before the vocoder's mel cache
            mel = state.stretch.push(mel, final=finalize)
        cache_source = np.zeros(0, dtype=np.float32)
        if state.hift is not None:
            mel = np.concatenate([state.hift.mel, mel], axis=-1)
            cache_source = state.hift.source
        if finalize:
            if whole and speed != 1.0:
                mel = interpolate_linear(mel, max(1, int(mel.shape[-1] / speed)))
            wav = self._vocode(mel, cache_source, state, noise)[0]
        else:
            wav, src = self._vocode(mel, cache_source, state, noise)
            n = c.source_cache_len
            state.hift = HiFTCache(mel=mel[:, -c.mel_cache_len :], source=src[-n:], speech=wav[-n:])
            wav = wav[:-n]
        return WavChunk(audio=wav, flow_s=flow_s, hift_s=time.perf_counter() - t1)

    def _vocode(
        self, mel: np.ndarray, cache_source: np.ndarray, state: SentenceState, noise: NoiseSource
    ) -> tuple[np.ndarray, np.ndarray]:
        hn = noise.hift_noise(self.hift.n_harmonics, self.hift.n_samples(mel.shape[-1]))
        wav, src = self.hift.inference(mel, cache_source, hn)
        if state.hift is not None:
            wav = fade_in_out(wav, state.hift.speech, self.speech_window)
        return wav, src


def default_first_hop(constants: ModelConstants) -> int:
    """Engine default for the first hop: the smallest that keeps the overlap frame-aligned (overlap + 1)."""
    return constants.token_overlap_len + 1


# Solver frames (rows x frames) of one pooled first-chunk solve. The estimator's attention grows with the square of
# the frames, so first chunks of a voice with a long prompt are solved alone (10 s prompt: ~930 frames; 8 of them
# pooled peaked at 2.6 GB), while built-in speakers' first chunks (~70 frames) still pool 14 at a time.
POOLED_SOLVER_FRAMES = 1024
MIN_FIRST_AUDIO_FRAMES = 8  # mel frames (93 ms) a streamed first chunk must yield after a tempo change


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


@dataclass
class _Stopwatch:
    """Seconds spent waiting for tokens since the last chunk."""

    spent: float = 0.0

    def take(self) -> float:
        s, self.spent = self.spent, 0.0
        return s


def _timed(tokens: Iterable[int], clock: _Stopwatch, cancel: threading.Event | None) -> Iterator[int]:
    """The tokens, adding the time spent waiting for each to `clock`; ends early once `cancel` is set."""
    it = iter(tokens)
    try:
        while True:
            t0 = time.perf_counter()
            tok = next(it, None)
            clock.spent += time.perf_counter() - t0
            if tok is None or _cancelled(cancel):
                return
            yield int(tok)
    finally:
        close = getattr(it, "close", None)
        if close is not None:  # release a generator's resources (the LLM's KV cache) right away
            close()


def _cancelled(cancel: threading.Event | None) -> bool:
    return cancel is not None and cancel.is_set()


def stream_sentence(
    tokens: Iterable[int],
    prompt: FlowPrompt | np.ndarray,
    t2w: Token2Wav,
    noise: NoiseSource,
    *,
    first_hop: int,
    speed: float = 1.0,
    n_timesteps: int | None = None,
    cancel: threading.Event | None = None,
    pace: Pacer | None = None,
) -> Iterator[SpeechChunk]:
    """Stream one sentence: pull tokens, vocode every `hop + overlap` of them, finalize with the rest.

    `speed` != 1 changes the tempo chunk by chunk (StreamingStretch between the flow and the vocoder's
    mel cache); pass a first hop from `first_hop_for_speed` so that the first chunk still carries audio.

    Stops silently (no final chunk) when `cancel` is set; it is checked after every token, so at most
    the chunk in progress finishes. `llm_s` of a chunk is the time spent waiting for its new tokens.
    With `pace`, every flow/HiFT call waits for the request's turn at the shared AcousticGate, and the
    first chunk is pooled: whichever request gets the slot vocodes every waiting first chunk with it.
    """
    c = t2w.constants
    check_first_hop(first_hop, c)
    prompt = as_flow_prompt(prompt)
    state, buf, hop, clock = t2w.new_state(speed), [], first_hop, _Stopwatch()
    for tok in _timed(tokens, clock, cancel):
        buf.append(tok)
        if len(buf) >= hop + c.token_overlap_len:
            chunk = tuple(buf[: hop + c.token_overlap_len])
            if pace is not None and state.fresh and pace.audio_s == 0.0:  # first audio: pooled with other requests'
                job = ChunkJob(chunk, prompt, state, noise, n_timesteps)
                key, limit = t2w.pool_key(chunk, prompt, n_timesteps), t2w.pool_limit(chunk, prompt)
                wav = pace.pooled(key, job, t2w.first_chunks, max_group=limit)
            else:
                with _turn(pace) as step_aside:
                    wav = t2w(chunk, prompt, state, noise, finalize=False, n_timesteps=n_timesteps, between_steps=step_aside)
            _delivered(pace, wav.audio)
            yield SpeechChunk(wav.audio, False, clock.take(), wav.flow_s, wav.hift_s)
            del buf[:hop]
            hop = _next_hop(hop, c)
    if not _cancelled(cancel):
        yield _finalize(buf, prompt, t2w, state, noise, clock.take(), 1.0, n_timesteps, pace)


def whole_sentence(
    tokens: Iterable[int],
    prompt: FlowPrompt | np.ndarray,
    t2w: Token2Wav,
    noise: NoiseSource,
    *,
    speed: float = 1.0,
    n_timesteps: int | None = None,
    cancel: threading.Event | None = None,
    pace: Pacer | None = None,
) -> Iterator[SpeechChunk]:
    """Non-stream path: collect every token, then one flow and one HiFT call (with `speed`). Yields 0 or 1 chunk."""
    clock = _Stopwatch()
    prompt = as_flow_prompt(prompt)
    buf = list(_timed(tokens, clock, cancel))
    if not _cancelled(cancel):
        yield _finalize(buf, prompt, t2w, t2w.new_state(), noise, clock.take(), speed, n_timesteps, pace)


def _finalize(
    buf: list[int],
    prompt: FlowPrompt,
    t2w: Token2Wav,
    state: SentenceState,
    noise: NoiseSource,
    llm_s: float,
    speed: float,
    n_timesteps: int | None,
    pace: Pacer | None,
) -> SpeechChunk:
    if not buf:  # nothing generated (e.g. max_tokens=0): an empty final chunk keeps the sentence boundary
        return SpeechChunk(np.zeros(0, dtype=np.float32), True, llm_s, 0.0, 0.0)
    with _turn(pace) as step_aside:
        wav = t2w(buf, prompt, state, noise, finalize=True, speed=speed, n_timesteps=n_timesteps, between_steps=step_aside)
    _delivered(pace, wav.audio)
    return SpeechChunk(wav.audio, True, llm_s, wav.flow_s, wav.hift_s)


def _turn(pace: Pacer | None) -> AbstractContextManager[Callable[[], None] | None]:
    return pace.turn() if pace is not None else nullcontext()


def _delivered(pace: Pacer | None, audio: np.ndarray) -> None:
    if pace is not None:
        pace.delivered(audio.size)


def _next_hop(hop: int, c: ModelConstants) -> int:
    """Official hop growth; a smaller first hop is lifted to token_hop_len before scaling."""
    return min(c.token_max_hop_len, int(max(hop, c.token_hop_len) * c.stream_scale_factor))
