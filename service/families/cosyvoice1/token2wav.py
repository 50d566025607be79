"""The v1 token-to-waveform state machine (spec §6): flow with caches, Hamming cross-fades, HiFT with its caches.

`Token2Wav` is the official `CosyVoiceModel.token2wav`: a chunk of tokens goes through the flow (its z and mu cache
shared with the next chunk over the overlap), the mel is cross-faded with the previous chunk's held tail, and HiFT
vocodes it with its mel/source caches and a speech cross-fade. Non-final calls hold back the overlap tail. How a
sentence is cut into chunks is not decided here (service.engine.chunking, service.engine.streaming).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from service.bundle import ModelConstants
from service.families.cosyvoice1.flow import CoresFree, FlowCache, FlowInput, FlowRunner
from service.families.cosyvoice1.voice import FlowPrompt, as_flow_prompt
from service.layers.dsp import StreamingStretch, fade_in_out, interpolate_linear
from service.layers.hift import HiFTNoise, HiFTRunner, draw_hift_noise


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
    """Audio (N,) float32 of one token2wav call, the seconds spent in flow and in HiFT, and the work they did:
    solver frames of this request (prompt frames included) and mel frames vocoded (carried cache included)."""

    audio: np.ndarray
    flow_s: float
    hift_s: float
    solver_frames: int = 0
    vocoded_frames: int = 0


@dataclass(frozen=True)
class ChunkJob:
    """One non-final token2wav call as data, so another thread may run it (batched with others of equal length)."""

    tokens: tuple[int, ...]
    prompt: FlowPrompt
    state: SentenceState
    noise: NoiseSource
    n_timesteps: int | None


class Token2Wav:
    """Official v1 `token2wav`: flow with cache, mel cross-fade, HiFT with mel/source cache, speech cross-fade.

    `wide_hift`: the same HiFT graphs with a decode session on both cores, for the vocoder calls whose chunk may take
    them (`wide_vocoder` of a call says when; the decode graph is most of a vocoder call's time).
    """

    def __init__(
        self, flow: FlowRunner, hift: HiFTRunner, constants: ModelConstants, wide_hift: HiFTRunner | None = None
    ) -> None:
        self.flow = flow
        self.hift = hift
        self.wide_hift = wide_hift
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
        lanes: CoresFree | None = None,
        wide_vocoder: CoresFree | None = None,
    ) -> WavChunk:
        """Audio for `tokens`, updating `state` in place. Non-final calls hold back the overlap tail.

        `speed` != 1 stretches the mel to max(1, int(frames / speed)) and needs a fresh state with finalize=True
        (the official code allows it only on the non-stream path). A streamed sentence changes its tempo
        through the state instead (`new_state(speed)`). `between_steps` is called between two Euler steps of
        the flow (the AcousticGate's step_aside). `lanes` is asked before each estimator call whether its guidance rows
        may run side by side (FlowRunner), `wide_vocoder` before the vocoder call whether it may take both cores.
        """
        if speed != 1.0 and not (finalize and state.fresh):
            raise ValueError("speed != 1 is only supported for a whole sentence in one finalize call")
        t0 = time.perf_counter()
        inp = self._prepare(tokens, as_flow_prompt(prompt), state, noise)
        (mel,) = self.flow.solve_inputs([inp], self.flow.steps(n_timesteps), between_steps, lanes)
        wide = wide_vocoder is not None and wide_vocoder()
        return self._after_flow(mel, state, noise, finalize, speed, time.perf_counter() - t0, inp.z.shape[-1], wide)

    def first_chunks(
        self, jobs: Sequence[ChunkJob], lanes: CoresFree | None = None, wide_vocoder: CoresFree | None = None
    ) -> Iterator[WavChunk]:
        """Non-final chunks of several requests with equal solver frames and steps (first chunks: fresh states).

        The flow solver runs once for all of them (`FlowRunner.solve_inputs`), then each is vocoded in
        turn and yielded at once, so the first request's audio is not held back by the others' HiFT.
        Each result equals its own `__call__(..., finalize=False)` up to float rounding. Requests with
        prompts pool only with requests of the same prompt frame count and token count (`pool_key`). `lanes` and
        `wide_vocoder` as in `__call__`.
        """
        if not jobs:
            return
        t0 = time.perf_counter()
        steps = {self.flow.steps(job.n_timesteps) for job in jobs}
        if len(steps) != 1 or len({self.pool_key(job.tokens, job.prompt, job.n_timesteps) for job in jobs}) != 1:
            raise ValueError("first_chunks needs jobs with equal token counts, prompt frames and flow steps")
        prepared = [self._prepare(job.tokens, job.prompt, job.state, job.noise) for job in jobs]
        mels = self.flow.solve_inputs(prepared, steps.pop(), lanes=lanes)
        flow_s = time.perf_counter() - t0
        for job, mel, inp in zip(jobs, mels, prepared, strict=True):
            wide = wide_vocoder is not None and wide_vocoder()
            yield self._after_flow(mel, job.state, job.noise, False, 1.0, flow_s, inp.z.shape[-1], wide)

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
        self,
        mel: np.ndarray,
        state: SentenceState,
        noise: NoiseSource,
        finalize: bool,
        speed: float,
        flow_s: float,
        solver_frames: int,
        wide: bool = False,
    ) -> WavChunk:
        """Mel cross-fade, HiFT with its caches and the speech cross-fade; non-final calls hold back the overlap tail.
        `wide`: the vocoder decodes on `wide_hift` (both cores) where there is one."""
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
            wav = self._vocode(mel, cache_source, state, noise, wide)[0]
        else:
            wav, src = self._vocode(mel, cache_source, state, noise, wide)
            n = c.source_cache_len
            state.hift = HiFTCache(mel=mel[:, -c.mel_cache_len :], source=src[-n:], speech=wav[-n:])
            wav = wav[:-n]
        hift_s = time.perf_counter() - t1
        return WavChunk(audio=wav, flow_s=flow_s, hift_s=hift_s, solver_frames=solver_frames, vocoded_frames=mel.shape[-1])

    def _vocode(
        self, mel: np.ndarray, cache_source: np.ndarray, state: SentenceState, noise: NoiseSource, wide: bool = False
    ) -> tuple[np.ndarray, np.ndarray]:
        hn = noise.hift_noise(self.hift.n_harmonics, self.hift.n_samples(mel.shape[-1]))
        hift = self.wide_hift if wide and self.wide_hift is not None else self.hift
        wav, src = hift.inference(mel, cache_source, hn)
        if state.hift is not None:
            wav = fade_in_out(wav, state.hift.speech, self.speech_window)
        return wav, src


# Solver frames (rows x frames) of one pooled first-chunk solve. The estimator's attention grows with the square of
# the frames, so first chunks of a voice with a long prompt are solved alone (10 s prompt: ~930 frames; 8 of them
# pooled peaked at 2.6 GB), while built-in speakers' first chunks (~70 frames) still pool 14 at a time.
POOLED_SOLVER_FRAMES = 1024
