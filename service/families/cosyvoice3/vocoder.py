"""Fun-CosyVoice3's causal HiFT: the f0 graph (float64 inside), SineGen2's causal source in numpy over the official
uniform noise, the source and decode graphs; a stream over a bounded window of mel history, and the official stream
that re-runs over the whole history.

Every convolution of the causal HiFT reads only earlier frames (conv_pre and the f0 predictor's first conv also 4 and
3 later ones), so the samples of a frame depend on a bounded stretch of mel before it (CONTEXT_FRAMES covers it with a
margin: the deepest path, level 1's resblocks and upsampling, reaches about 21 frames back). The sine source does not:
its phase is a running sum from the sentence's first frame, which the stream carries (in float64, as torch's cumsum
accumulates) from chunk to chunk, and its noise is row n of the official buffer for sample n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from service.bundle import ModelConstants
from service.families.cosyvoice3.contract import CosyVoice3Constants
from service.families.cosyvoice3.noise import SineNoise
from service.layers.hift import HiFTRunner

CONTEXT_FRAMES = 24  # mel frames before the first new one each decode window starts at (the receptive field is ~21)
F0_CONTEXT_FRAMES = 8  # the f0 predictor's four causal k3 convolutions reach 8 frames back


def _f32(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


@dataclass
class SineSource:
    """SineGen2(causal=True) of one sentence: its harmonic stack from the frame-rate f0, continued chunk by chunk.

    Per frame j the cycles (f0[j] x h / rate) % 1 (float32) are summed from the sentence's first frame in float64 and
    rounded to float32 (torch's cumsum), times 2 pi, times the samples per frame; each frame's phase holds for all its
    samples (the causal SineGen2 upsamples it `nearest`). Voiced samples (f0 > threshold) get the sine plus
    noise_std x noise, unvoiced ones sine_amp / 3 x noise, the noise being the official uniform buffer's rows."""

    constants: ModelConstants
    noise: SineNoise
    carry: np.ndarray  # (H,) float64: the phase sum (in cycles) of the frames so far
    frames: int = 0  # frames whose source is made

    @classmethod
    def start(cls, constants: ModelConstants, noise: SineNoise) -> SineSource:
        return cls(constants, noise, np.zeros(constants.nb_harmonics + 1, dtype=np.float64))

    def stack(self, f0: np.ndarray) -> np.ndarray:
        """The harmonic stack (L, H) float32 of the next frames' f0 (T,) Hz, L = T x samples per frame."""
        c = self.constants
        up = math.prod(c.upsample_rates) * c.istft_hop
        harmonics = np.arange(1, c.nb_harmonics + 2, dtype=np.float32)
        f0 = _f32(f0)
        cycles = np.mod(_f32(_f32(f0[:, None] * harmonics[None, :]) / np.float32(c.sample_rate)), np.float32(1.0))
        total = np.cumsum(np.concatenate([self.carry[None, :], cycles.astype(np.float64)]), axis=0)[1:]
        self.carry = total[-1] if total.shape[0] else self.carry
        phase = _f32(_f32(_f32(total.astype(np.float32) * np.float32(2.0)) * np.float32(math.pi)) * np.float32(up))
        sines = _f32(np.sin(phase) * np.float32(c.sine_amp))
        voiced = (f0 > np.float32(c.voiced_threshold_hz)).astype(np.float32)[:, None]
        amp = _f32(voiced * np.float32(c.noise_std) + _f32((np.float32(1.0) - voiced) * np.float32(c.sine_amp)) / np.float32(3.0))
        rows = self.noise.rows(self.frames * up, (self.frames + f0.shape[0]) * up).reshape(f0.shape[0], up, -1)
        self.frames += f0.shape[0]
        return np.ascontiguousarray((sines * voiced)[:, None, :] + amp[:, None, :] * rows, dtype=np.float32).reshape(
            -1, rows.shape[2]
        )


class CausalVocoder:
    """The causal HiFT's graphs with the numpy parts: f0 (the graph computes in float64; the result is cast to float32
    as the official does), the sine source, the source graph, STFT, decode graph, iSTFT."""

    def __init__(self, runner: HiFTRunner, extra: CosyVoice3Constants, noise: SineNoise) -> None:
        self.runner = runner
        self.constants = runner.constants
        self.noise = noise
        self.samples_per_frame = runner.samples_per_frame
        self.f0_look_ahead = extra.f0_look_ahead
        # a non-final call holds back the f0 look-ahead, conv_pre's and one more frame the iSTFT edge spoils
        self.hold_back = extra.f0_look_ahead + extra.conv_pre_look_ahead + 1

    def source(self, mel: np.ndarray, first: int, count: int, sine: SineSource) -> np.ndarray:
        """Source samples of frames first..first+count-1 of `mel` (80, T), continuing `sine`: their f0 from the whole
        window (frames before `first` are left context; frames after, look-ahead; zeros follow the last)."""
        f0 = self.runner.predict_f0(mel)[first : first + count]
        return self.runner.source(sine.stack(f0))

    def decode(self, mel: np.ndarray, source: np.ndarray) -> np.ndarray:
        return self.runner.decode(mel, source)


@dataclass
class WindowedStream:
    """One sentence's vocoder over a bounded window (the default stream): each push solves the f0 and source of the new
    frames and decodes CONTEXT_FRAMES of mel before the frames it emits; the output equals the official re-run over
    the whole history (`OfficialStream`) to float rounding, for a cost linear in the sentence's length."""

    vocoder: CausalVocoder
    sine: SineSource
    mel: np.ndarray  # (80, frames) kept from `base` on
    source: np.ndarray  # (samples,) the source of frames base..sine.frames-1
    base: int = 0  # global index of mel[:, 0]
    emitted: int = 0  # frames whose audio is out

    @classmethod
    def start(cls, vocoder: CausalVocoder) -> WindowedStream:
        empty = np.zeros((vocoder.constants.n_mels, 0), dtype=np.float32)
        return cls(vocoder, SineSource.start(vocoder.constants, vocoder.noise), empty, np.zeros(0, dtype=np.float32))

    def push(self, mel: np.ndarray, *, final: bool, vocoder: CausalVocoder | None = None) -> np.ndarray:
        """Audio (N,) float32 for the next mel frames (80, T): every sample up to `hold_back` frames before the end,
        all of them when `final`. `vocoder`: the same graphs on other sessions for this call (the wide decode)."""
        v = vocoder or self.vocoder
        spf = v.samples_per_frame
        self.mel = np.concatenate([self.mel, _f32(mel)], axis=1)
        total = self.base + self.mel.shape[1]
        done = total if final else max(self.sine.frames, total - v.f0_look_ahead)
        if done > self.sine.frames:
            made = self.sine.frames
            lo = max(self.base, made - F0_CONTEXT_FRAMES)
            window = self.mel[:, lo - self.base :]
            self.source = np.concatenate([self.source, v.source(window, made - lo, done - made, self.sine)])
        end = total if final else max(self.emitted, total - v.hold_back)
        if end <= self.emitted:
            return np.zeros(0, dtype=np.float32)
        lo = max(self.base, self.emitted - CONTEXT_FRAMES)
        hi = total if final else done
        audio = v.decode(
            self.mel[:, lo - self.base : hi - self.base], self.source[(lo - self.base) * spf : (hi - self.base) * spf]
        )
        out = audio[(self.emitted - lo) * spf : (end - lo) * spf]
        self.emitted = end
        self._forget(max(self.base, end - CONTEXT_FRAMES - F0_CONTEXT_FRAMES))
        return out

    def _forget(self, keep_from: int) -> None:
        cut = keep_from - self.base
        if cut > 0:
            self.mel = self.mel[:, cut:]
            self.source = self.source[cut * self.vocoder.samples_per_frame :]
            self.base = keep_from


@dataclass
class OfficialStream:
    """CosyVoice3Model.token2wav's vocoder half (engine lever stream_schedule=official): every push appends the new mel to the
    sentence's whole history and re-runs f0, source and decode over all of it (finalize as the flow), yielding the
    samples after what was yielded before."""

    vocoder: CausalVocoder
    mel: np.ndarray
    offset: int = 0  # samples yielded

    @classmethod
    def start(cls, vocoder: CausalVocoder) -> OfficialStream:
        return cls(vocoder, np.zeros((vocoder.constants.n_mels, 0), dtype=np.float32))

    def push(self, mel: np.ndarray, *, final: bool, vocoder: CausalVocoder | None = None) -> np.ndarray:
        v = vocoder or self.vocoder
        spf = v.samples_per_frame
        self.mel = np.concatenate([self.mel, _f32(mel)], axis=1)
        total = self.mel.shape[1]
        frames = total if final else total - v.f0_look_ahead
        if frames <= 0:
            return np.zeros(0, dtype=np.float32)
        source = v.source(self.mel, 0, frames, SineSource.start(v.constants, v.noise))
        audio = v.decode(self.mel[:, :frames], source)
        end = total * spf if final else (total - v.hold_back) * spf
        out = audio[self.offset : max(self.offset, end)]
        self.offset = max(self.offset, end)
        return out
