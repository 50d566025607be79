"""Audio output: float -> int16, streaming WAV/PCM, MP3/Opus/FLAC/AAC via PyAV, 22,050 -> 24,000 Hz resampling."""

from __future__ import annotations

import functools
import io
import math
import struct
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import av
import numpy as np

from service.errors import UnsupportedFormatError

STREAM_SIZE_UNKNOWN = 0xFFFFFFFF  # RIFF/data size of a WAV whose length is not known yet (streaming)
OPUS_SAMPLE_RATE_HZ = 24_000  # libopus accepts 8/12/16/24/48 kHz only; 24 kHz is the nearest to 22,050
DEFAULT_BITRATE_KBPS = 64  # MP3/Opus/AAC when the caller names none
MP3_RATES_HZ = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG-1, 2 and 2.5 Layer III


class AudioFormat(StrEnum):
    """Output formats; the values are the request strings."""

    WAV = "wav"
    PCM = "pcm"
    MP3 = "mp3"
    OPUS = "opus"
    FLAC = "flac"
    AAC = "aac"


@dataclass(frozen=True)
class _Codec:
    container: str
    codec: str
    media_type: str
    options: tuple[tuple[str, str], ...] = ()
    lossy: bool = True  # takes a bitrate


_CODECS: dict[AudioFormat, _Codec] = {
    AudioFormat.MP3: _Codec("mp3", "libmp3lame", "audio/mpeg"),
    # short Ogg pages so that a streamed Opus response starts playing within ~0.1 s
    AudioFormat.OPUS: _Codec("ogg", "libopus", "audio/ogg; codecs=opus", (("page_duration", "100000"),)),
    AudioFormat.FLAC: _Codec("flac", "flac", "audio/flac", lossy=False),
    AudioFormat.AAC: _Codec("adts", "aac", "audio/aac"),
}


def parse_format(value: str, param: str = "format") -> AudioFormat:
    """The AudioFormat named by `value`; raises UnsupportedFormatError naming the accepted ones."""
    try:
        return AudioFormat(value)
    except ValueError as e:
        accepted = ", ".join(f.value for f in AudioFormat)
        raise UnsupportedFormatError(f"unsupported format {value!r}; use one of {accepted}", param=param) from e


def output_sample_rate(fmt: AudioFormat, model_rate_hz: int, pcm_rate_hz: int | None = None, rate_hz: int | None = None) -> int:
    """Sample rate of the encoded output: the model's, except Opus (24 kHz), and PCM or MP3 when a rate is asked for
    (`rate_hz`, a rate the client chose, over `pcm_rate_hz`, the operator's rate for PCM; MP3 takes MP3_RATES_HZ)."""
    if fmt is AudioFormat.OPUS:
        return OPUS_SAMPLE_RATE_HZ
    if rate_hz and fmt in (AudioFormat.PCM, AudioFormat.MP3):
        return rate_hz
    if fmt is AudioFormat.PCM and pcm_rate_hz:
        return pcm_rate_hz
    return model_rate_hz


def media_type(fmt: AudioFormat, sample_rate_hz: int) -> str:
    """Content-Type for `fmt`; raw PCM names its rate, width and byte order since nothing else does."""
    if fmt is AudioFormat.PCM:
        return f"audio/pcm;rate={sample_rate_hz};bits=16;channels=1;encoding=signed-int;endianness=little"
    if fmt is AudioFormat.WAV:
        return "audio/wav"
    return _CODECS[fmt].media_type


def float_to_int16(audio: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1] -> int16, as the official server does (x * 32768, truncated), clipped so it cannot wrap."""
    scaled = np.clip(np.asarray(audio, dtype=np.float32) * 32768.0, -32768.0, 32767.0)
    return np.asarray(scaled.astype(np.int16), dtype=np.int16)


def wav_header(sample_rate_hz: int, n_samples: int | None) -> bytes:
    """44-byte header of a mono 16-bit PCM WAV; `n_samples=None` writes 0xFFFFFFFF sizes for a stream."""
    if n_samples is None:
        riff_size = data_size = STREAM_SIZE_UNKNOWN
    else:
        data_size = 2 * n_samples
        riff_size = 36 + data_size
    fmt_chunk = struct.pack("<4sIHHIIHH", b"fmt ", 16, 1, 1, sample_rate_hz, 2 * sample_rate_hz, 2, 16)
    return struct.pack("<4sI4s", b"RIFF", riff_size, b"WAVE") + fmt_chunk + struct.pack("<4sI", b"data", data_size)


_KAISER_BETA = 5.0  # scipy.signal.resample_poly's default window, ('kaiser', 5.0)
_HALF_TAPS_PER_RATE = 10  # and its filter half-length, 10 * max(up, down) taps
_BLOCK = 8192  # output samples per vectorized block (bounds the gathered matrix to a few MB)


@functools.lru_cache(maxsize=8)
def _polyphase_taps(up: int, down: int) -> tuple[np.ndarray, int]:
    """The low-pass FIR that resample_poly designs by default, split into `up` phases: (taps (up, K), half).

    firwin(2 * half + 1, 1 / max(up, down), window=('kaiser', 5.0)) scaled to unit DC gain, times `up`;
    phase p holds h[p], h[p + up], h[p + 2 up], ... (zero past the end).
    """
    rate = max(up, down)
    half = _HALF_TAPS_PER_RATE * rate
    m = np.arange(2 * half + 1, dtype=np.float64) - half
    h = np.sinc(m / rate) / rate * np.kaiser(2 * half + 1, _KAISER_BETA)
    h *= up / h.sum()
    width = -(-h.size // up)
    padded = np.zeros(up * width, dtype=np.float64)
    padded[: h.size] = h
    return padded.reshape(width, up).T.copy(), half


def resample_poly(x: np.ndarray, up: int, down: int) -> np.ndarray:
    """Polyphase resampling by up/down (coprime) with resample_poly's default filter, in numpy.

    Output sample m is sum_k h[m * down + half - k * up] * x[k] (zero padding at both ends), the same
    alignment and length (ceil(len(x) * up / down)) as scipy.signal.resample_poly; each sample is a dot
    product of the same taps and inputs whatever the call's length, so resampling in blocks that overlap
    by the filter's reach gives exactly the one-shot result (StreamResampler relies on it).
    """
    x = np.asarray(x, dtype=np.float32).reshape(-1)
    n_out = -(-x.size * up // down)
    taps, half = _polyphase_taps(up, down)
    width = taps.shape[1]
    padded = np.concatenate([np.zeros(width, np.float32), x, np.zeros(width, np.float32)])
    out = np.empty(n_out, dtype=np.float32)
    lag = np.arange(width)
    for start in range(0, n_out, _BLOCK):
        t = np.arange(start, min(start + _BLOCK, n_out), dtype=np.int64) * down + half
        newest = t // up + width  # index in `padded` of the newest input each output sees
        window = padded[newest[:, None] - lag[None, :]]
        out[start : start + t.size] = np.einsum("ij,ij->i", window, taps[t % up], dtype=np.float64)
    return out


def resample(audio: np.ndarray, src_hz: int, dst_hz: int) -> np.ndarray:
    """One-shot polyphase resampling (`resample_poly`), float32 in and out."""
    if src_hz == dst_hz:
        return np.asarray(audio, dtype=np.float32)
    g = math.gcd(src_hz, dst_hz)
    resampled = resample_poly(np.asarray(audio, dtype=np.float32), dst_hz // g, src_hz // g)
    return np.asarray(resampled, dtype=np.float32)


class StreamResampler:
    """Chunk-by-chunk resample_poly whose concatenated output matches the one-shot `resample` of the whole signal.

    Each call re-filters the pending input plus `context` samples of history. Blocks always start on an
    input index that is a multiple of `down`, so their outputs land on whole output samples, and an output
    sample is only released once `context` input samples after it are known (the FIR reaches ~10 samples).
    """

    def __init__(self, src_hz: int, dst_hz: int) -> None:
        g = math.gcd(src_hz, dst_hz)
        self.up, self.down = dst_hz // g, src_hz // g
        self._context = self.down * max(1, math.ceil(16 / self.down))  # aligned and >= 16 input samples
        self._buf = np.zeros(0, dtype=np.float32)
        self._base = 0  # global input index of _buf[0] (a multiple of down)
        self._emitted = 0  # global output samples released so far

    def push(self, audio: np.ndarray) -> np.ndarray:
        """Add input samples; return the output samples that are now final."""
        self._buf = np.concatenate([self._buf, np.asarray(audio, dtype=np.float32)])
        end = self._base + len(self._buf) - self._context
        end -= end % self.down
        if end <= self._base:
            return np.zeros(0, dtype=np.float32)
        out = self._release(end * self.up // self.down)
        keep_from = max(0, end - self._context)
        self._buf = self._buf[keep_from - self._base :]
        self._base = keep_from
        return out

    def flush(self) -> np.ndarray:
        """Release the rest (the signal ended): the tail equals the one-shot result's tail."""
        total = math.ceil((self._base + len(self._buf)) * self.up / self.down)
        return self._release(total)

    def _release(self, out_end: int) -> np.ndarray:
        y = resample_poly(self._buf, self.up, self.down)
        offset = self._base * self.up // self.down
        out = y[self._emitted - offset : out_end - offset]
        self._emitted = out_end
        return np.asarray(out)


class AudioEncoder(Protocol):
    """Stream encoder: feed float32 model-rate chunks, collect bytes; `finish` returns the tail."""

    media_type: str
    sample_rate_hz: int

    def encode(self, audio: np.ndarray) -> bytes: ...

    def finish(self) -> bytes: ...


class _Rated:
    """Shared part of the encoders: optional resampling from the model rate to the output rate."""

    def __init__(self, in_rate_hz: int, out_rate_hz: int) -> None:
        self.sample_rate_hz = out_rate_hz
        self._resampler = StreamResampler(in_rate_hz, out_rate_hz) if in_rate_hz != out_rate_hz else None

    def _rate(self, audio: np.ndarray) -> np.ndarray:
        audio = np.asarray(audio, dtype=np.float32).reshape(-1)
        return self._resampler.push(audio) if self._resampler else audio

    def _tail(self) -> np.ndarray:
        return self._resampler.flush() if self._resampler else np.zeros(0, dtype=np.float32)


class PcmEncoder(_Rated):
    """Raw little-endian int16 mono."""

    def __init__(self, in_rate_hz: int, out_rate_hz: int) -> None:
        super().__init__(in_rate_hz, out_rate_hz)
        self.media_type = media_type(AudioFormat.PCM, out_rate_hz)

    def encode(self, audio: np.ndarray) -> bytes:
        return float_to_int16(self._rate(audio)).astype("<i2").tobytes()

    def finish(self) -> bytes:
        return float_to_int16(self._tail()).astype("<i2").tobytes()


class WavStreamEncoder(PcmEncoder):
    """WAV for a stream: a header with unknown (0xFFFFFFFF) sizes goes out with the first samples."""

    def __init__(self, in_rate_hz: int, out_rate_hz: int) -> None:
        super().__init__(in_rate_hz, out_rate_hz)
        self.media_type = media_type(AudioFormat.WAV, out_rate_hz)
        self._header_sent = False

    def encode(self, audio: np.ndarray) -> bytes:
        return self._with_header(super().encode(audio))

    def finish(self) -> bytes:
        return self._with_header(super().finish())

    def _with_header(self, body: bytes) -> bytes:
        if self._header_sent:
            return body
        self._header_sent = True
        return wav_header(self.sample_rate_hz, None) + body


class _ByteSink:
    """Write-only file object PyAV muxes into; not seekable, so muxers write streamable output."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def write(self, data: bytes) -> int:
        self._buf += data
        return len(data)

    def drain(self) -> bytes:
        out = bytes(self._buf)
        self._buf.clear()
        return out


class CodecEncoder(_Rated):
    """MP3 / Opus (Ogg) / FLAC / AAC (ADTS) through PyAV, encoded chunk by chunk.

    `bitrate_kbps` applies to MP3, Opus and AAC (FLAC is lossless); encoders clamp it to what the codec allows
    at the output rate (MP3 at 22,050 Hz: 160 kbit/s at most).
    `whole_file`: the muxer writes into a seekable buffer, so at the end it goes back and completes the headers
    (FLAC's STREAMINFO gets the total sample count and the MD5 of the samples, MP3 its Xing/Info frame count);
    nothing comes out before `finish`. Without it the output is streamable and a FLAC header states an unknown
    length, as it must when the first bytes leave before the last sample exists.
    """

    def __init__(
        self,
        fmt: AudioFormat,
        in_rate_hz: int,
        out_rate_hz: int,
        bitrate_kbps: int = DEFAULT_BITRATE_KBPS,
        *,
        whole_file: bool = False,
    ) -> None:
        super().__init__(in_rate_hz, out_rate_hz)
        spec = _CODECS[fmt]
        self.media_type = spec.media_type
        self._sink: _ByteSink | io.BytesIO = io.BytesIO() if whole_file else _ByteSink()
        self._container = av.open(self._sink, mode="w", format=spec.container, options=dict(spec.options))
        stream = self._container.add_stream(spec.codec, rate=out_rate_hz, layout="mono")
        assert isinstance(stream, av.AudioStream)
        if spec.lossy:
            stream.bit_rate = bitrate_kbps * 1000
        self._stream = stream
        self._pts = 0

    def encode(self, audio: np.ndarray) -> bytes:
        self._encode_frame(self._rate(audio))
        return self._sink.drain() if isinstance(self._sink, _ByteSink) else b""

    def finish(self) -> bytes:
        self._encode_frame(self._tail())
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        return self._sink.drain() if isinstance(self._sink, _ByteSink) else self._sink.getvalue()

    def _encode_frame(self, audio: np.ndarray) -> None:
        if audio.size == 0:
            return
        # int16 first, with the same conversion as WAV/PCM, so FLAC is bit-identical to them
        samples = float_to_int16(audio)[None, :]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate_hz
        frame.pts = self._pts
        self._pts += audio.size
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


def make_encoder(fmt: AudioFormat, in_rate_hz: int, out_rate_hz: int, bitrate_kbps: int = DEFAULT_BITRATE_KBPS) -> AudioEncoder:
    """A fresh stream encoder for one response; `bitrate_kbps` is used by MP3, Opus and AAC only."""
    if fmt is AudioFormat.PCM:
        return PcmEncoder(in_rate_hz, out_rate_hz)
    if fmt is AudioFormat.WAV:
        return WavStreamEncoder(in_rate_hz, out_rate_hz)
    return CodecEncoder(fmt, in_rate_hz, out_rate_hz, bitrate_kbps)


def encode_complete(
    fmt: AudioFormat, audio: np.ndarray, in_rate_hz: int, out_rate_hz: int, bitrate_kbps: int = DEFAULT_BITRATE_KBPS
) -> bytes:
    """Encode a whole signal as a file whose headers state its length: WAV with exact size fields, FLAC with the
    total sample count and MD5 in STREAMINFO, MP3 with an Xing/Info frame; PCM is the raw samples."""
    if fmt is AudioFormat.WAV:
        pcm = float_to_int16(resample(audio, in_rate_hz, out_rate_hz)).astype("<i2").tobytes()
        return wav_header(out_rate_hz, len(pcm) // 2) + pcm
    encoder: AudioEncoder
    if fmt is AudioFormat.PCM:
        encoder = PcmEncoder(in_rate_hz, out_rate_hz)
    else:
        encoder = CodecEncoder(fmt, in_rate_hz, out_rate_hz, bitrate_kbps, whole_file=True)
    return encoder.encode(audio) + encoder.finish()


class Pcm16Transcoder:
    """int16 little-endian PCM at `in_rate_hz` in, one stream of `fmt` at `out_rate_hz` out (a single header or
    container for everything fed), after a linear `gain` (clipped at full scale)."""

    def __init__(
        self, fmt: AudioFormat, in_rate_hz: int, out_rate_hz: int, bitrate_kbps: int = DEFAULT_BITRATE_KBPS, gain: float = 1.0
    ) -> None:
        self.gain = gain
        self._encoder = make_encoder(fmt, in_rate_hz, out_rate_hz, bitrate_kbps)

    def encode(self, pcm: bytes) -> bytes:
        samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
        return self._encoder.encode(samples * self.gain if self.gain != 1.0 else samples)

    def finish(self) -> bytes:
        return self._encoder.finish()
