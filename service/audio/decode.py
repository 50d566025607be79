"""Prompt-audio input: decode uploaded files (PyAV) or raw int16 PCM to mono float32, refusing unusable audio."""

from __future__ import annotations

import io
import logging
import math
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import av
import numpy as np

from service.errors import PromptAudioError, PromptAudioProblem

log = logging.getLogger(__name__)

READABLE_FORMATS = "WAV, FLAC, MP3, Ogg Vorbis or Opus, M4A/AAC or WebM"
_NOT_ACCEPTED = f"prompt audio is not a recording in a format this server reads (send {READABLE_FORMATS})"
MIN_SAMPLE_RATE_HZ = 16_000  # the official load_wav asserts a file rate of at least 16 kHz
MAX_SAMPLE_RATE_HZ = 384_000  # highest rate any common recorder or codec produces
MIN_SECONDS = 1.0
SILENCE_PEAK = 1e-4  # peak below this (about 3 int16 steps, -80 dBFS) counts as silence
# A declared duration (container header) is exact for PCM/FLAC but only estimated for some MP3/AAC files:
# refuse before decoding only when it is clearly beyond the limit; the decode loop enforces the exact bound.
_DECLARED_SLACK = 1.05
_EXACT_LENGTH_CODECS = ("pcm_", "flac")  # codecs whose header states the exact sample count
_WAV_STREAMING_SIZE = 0xFFFFFFFF
_INT_SCALE = {np.dtype(np.int16): 2.0**15, np.dtype(np.int32): 2.0**31, np.dtype(np.int64): 2.0**63}


@dataclass(frozen=True)
class AcceptedFormat:
    """A container this server decodes: the FFmpeg demuxer it is opened with (never probed) and its audio codecs."""

    name: str
    demuxer: str
    codecs: frozenset[str]  # FFmpeg canonical codec names; a name ending in "_" admits the family ("pcm_")

    def admits(self, codec: str) -> bool:
        return any(codec == c or (c.endswith("_") and codec.startswith(c)) for c in self.codecs)


_WAV = AcceptedFormat("WAV", "wav", frozenset({"pcm_", "mp3"}))
_FLAC = AcceptedFormat("FLAC", "flac", frozenset({"flac"}))
_OGG = AcceptedFormat("Ogg", "ogg", frozenset({"vorbis", "opus", "flac"}))
_MP3 = AcceptedFormat("MP3", "mp3", frozenset({"mp3"}))
_AAC = AcceptedFormat("AAC", "aac", frozenset({"aac"}))
_M4A = AcceptedFormat("MP4/M4A", "mov", frozenset({"aac", "alac", "mp3", "flac", "opus"}))
_WEBM = AcceptedFormat("WebM/Matroska", "matroska", frozenset({"opus", "vorbis", "flac", "aac", "mp3", "pcm_"}))

# First bytes of the containers decode_audio reads (offset, magic, format); a raw int16 PCM stream starts with none.
# Nothing else reaches FFmpeg: its probing would also accept playlists (concat, HLS), SDP, image sequences and
# subtitles, formats that open further files or sockets.
_WAV_MAGIC = (b"RIFF", b"RF64", b"BW64")  # followed by "WAVE" at byte 8 (a RIFF AVI or WebP is no WAV)
_MAGIC: tuple[tuple[int, bytes, AcceptedFormat], ...] = (
    (0, b"fLaC", _FLAC), (0, b"OggS", _OGG), (4, b"ftyp", _M4A), (0, b"\x1aE\xdf\xa3", _WEBM),
)  # fmt: skip
# The only options FFmpeg gets: no protocol may be opened by name, and MP4 never follows external data references.
_DEMUX_OPTIONS = {"protocol_whitelist": "none", "enable_drefs": "0", "use_absolute_path": "0"}
_ID3_HEADER = 10
_MP3_KBPS = (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)  # MPEG-1 layer III
_MP3_KBPS_LSF = (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)  # MPEG-2/2.5 layer III
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def container_format(data: bytes) -> str | None:
    """The accepted audio file format `data` starts with ("WAV", "FLAC", "MP3", ...), or None when it starts like
    none of them, as raw PCM (or any other file) does. A bare MP3 or ADTS (AAC) stream counts when two frame headers
    chain; an ID3v2 tag is looked past."""
    found = accepted_format(data)
    return found.name if found is not None else None


def accepted_format(data: bytes) -> AcceptedFormat | None:
    """The accepted container `data` is, recognised from its bytes alone (see container_format), or None."""
    if data[:3] == b"ID3" and len(data) >= _ID3_HEADER:
        size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F)
        inner = _by_magic(data[_ID3_HEADER + size :])
        return inner if inner in (_AAC, _FLAC) else _MP3  # a tag before FLAC or AAC frames, else an MP3's
    return _by_magic(data)


def _by_magic(data: bytes) -> AcceptedFormat | None:
    if data[:4] in _WAV_MAGIC and data[8:12] == b"WAVE":
        return _WAV
    for offset, magic, found in _MAGIC:
        if data[offset : offset + len(magic)] == magic:
            return found
    for found, frame_length in ((_MP3, _mp3_frame_length), (_AAC, _adts_frame_length)):
        first = frame_length(data, 0)
        if first and frame_length(data, first):
            return found
    return None


def _refuse_nested_open(url: str, flags: int, options: dict[str, str]) -> Any:
    """FFmpeg asked to open another file or URL while reading an upload: never allowed."""
    raise PermissionError(f"an uploaded recording may not open {url!r}")


def _mp3_frame_length(data: bytes, at: int) -> int:
    """Length in bytes of the MPEG layer III frame whose header starts at `at`, or 0 when there is none there."""
    if len(data) < at + 4 or data[at] != 0xFF or data[at + 1] & 0xE0 != 0xE0:
        return 0
    version, layer = (data[at + 1] >> 3) & 3, (data[at + 1] >> 1) & 3
    bitrate_index, rate_index, padding = data[at + 2] >> 4, (data[at + 2] >> 2) & 3, (data[at + 2] >> 1) & 1
    if layer != 1 or version == 1 or bitrate_index in (0, 15) or rate_index == 3:
        return 0
    kbps = (_MP3_KBPS if version == 3 else _MP3_KBPS_LSF)[bitrate_index]
    return (144 if version == 3 else 72) * kbps * 1000 // _MP3_RATES[version][rate_index] + padding


def _adts_frame_length(data: bytes, at: int) -> int:
    """Length in bytes of the ADTS (AAC) frame whose header starts at `at`, or 0 when there is none there."""
    if len(data) < at + 7 or data[at] != 0xFF or data[at + 1] & 0xF6 != 0xF0 or (data[at + 2] >> 2) & 0xF > 12:
        return 0
    length = (data[at + 3] & 3) << 11 | data[at + 4] << 3 | data[at + 5] >> 5
    return length if length >= 7 else 0


def decode_audio(
    data: bytes,
    *,
    max_seconds: float,
    min_seconds: float = MIN_SECONDS,
    min_sample_rate: int = MIN_SAMPLE_RATE_HZ,
    silence_peak: float = SILENCE_PEAK,
) -> tuple[np.ndarray, int]:
    """Decode a WAV/FLAC/MP3/Ogg (Vorbis, Opus)/M4A (AAC) file to (mono float32 (N,), sample rate in Hz).

    Channels are averaged (the official load_wav's mean); 16-bit PCM becomes int16 / 32768 exactly, other
    integer PCM is scaled by its full range. The file's own rate is kept (no resampling). Raises
    PromptAudioError (reason: empty, not_audio, corrupt, truncated, sample_rate, too_long, too_short, silent).
    Length is checked against the header before decoding when the header states it, and decoding stops
    as soon as `max_seconds` is exceeded.
    """
    if not data:
        raise PromptAudioError("prompt audio is empty (0 bytes)", reason=PromptAudioProblem.EMPTY)
    found = accepted_format(data)
    if found is None:
        raise PromptAudioError(_NOT_ACCEPTED, reason=PromptAudioProblem.NOT_AUDIO)
    _check_wav_header(data, max_seconds, min_sample_rate)
    container = _open(data, found)
    with container:
        stream = _audio_stream(container, found)
        rate = int(stream.codec_context.sample_rate or 0)
        _check_rate(rate, min_sample_rate)
        declared = _declared_seconds(container, stream)
        if declared is not None and declared > max_seconds * _DECLARED_SLACK:
            raise PromptAudioError(
                f"prompt audio is {declared:.1f} s, longer than {max_seconds:g} s", reason=PromptAudioProblem.TOO_LONG
            )
        pieces = list(_decode_mono(container, stream, rate, max_seconds))
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    if audio.size == 0:
        raise PromptAudioError("no audio could be decoded from the prompt file", reason=PromptAudioProblem.CORRUPT)
    codec = stream.codec_context.codec.canonical_name
    if declared is not None and codec.startswith(_EXACT_LENGTH_CODECS) and audio.size < math.floor(declared * rate) - 1:
        raise PromptAudioError(
            f"prompt file is truncated: {audio.size / rate:.3f} s decoded of {declared:.3f} s declared",
            reason=PromptAudioProblem.TRUNCATED,
        )
    _check_samples(audio, rate, max_seconds=max_seconds, min_seconds=min_seconds, silence_peak=silence_peak)
    return audio, rate


def _open(data: bytes, found: AcceptedFormat) -> Any:
    """`data` opened with `found`'s demuxer alone, every nested open refused."""
    try:
        return av.open(
            io.BytesIO(data), mode="r", format=found.demuxer, options=dict(_DEMUX_OPTIONS),
            metadata_errors="ignore", io_open=_refuse_nested_open,
        )  # fmt: skip
    except (av.FFmpegError, ValueError, OSError) as e:
        log.info("prompt audio not opened as %s: %s", found.name, e)  # FFmpeg's words are for the operator
        raise PromptAudioError(
            f"prompt audio is not a readable {found.name} file (send {READABLE_FORMATS})",
            reason=PromptAudioProblem.NOT_AUDIO,
        ) from e


def _audio_stream(container: Any, found: AcceptedFormat) -> Any:
    """The container's first audio stream, when its codec is one `found` admits and FFmpeg can decode."""
    if not container.streams.audio:
        raise PromptAudioError(f"prompt file has no audio stream (send {READABLE_FORMATS})", reason=PromptAudioProblem.NOT_AUDIO)
    stream = container.streams.audio[0]
    context = stream.codec_context
    codec = context.codec.canonical_name if context is not None else "unknown"
    if context is None or not found.admits(codec):
        raise PromptAudioError(
            f"prompt audio's codec ({codec}) is not one this server decodes in {found.name} (send {READABLE_FORMATS})",
            reason=PromptAudioProblem.NOT_AUDIO,
        )
    return stream


def pcm16_to_float(
    data: bytes,
    *,
    sample_rate: int = 16_000,
    max_seconds: float,
    min_seconds: float = MIN_SECONDS,
    silence_peak: float = SILENCE_PEAK,
) -> tuple[np.ndarray, int]:
    """Raw little-endian int16 mono PCM (the official gRPC `prompt_audio`, 16 kHz) -> (float32 x / 32768, rate).

    Raises PromptAudioError for empty input, an odd byte count (corrupt), an unusable rate, or audio that
    is too long, too short or silent.
    """
    if not data:
        raise PromptAudioError("prompt audio is empty (0 bytes)", reason=PromptAudioProblem.EMPTY)
    if len(data) % 2:
        raise PromptAudioError(f"int16 PCM needs an even byte count, got {len(data)}", reason=PromptAudioProblem.CORRUPT)
    _check_rate(sample_rate, MIN_SAMPLE_RATE_HZ)
    if len(data) // 2 > max_seconds * sample_rate:
        raise PromptAudioError(
            f"prompt audio is {len(data) / 2 / sample_rate:.1f} s, longer than {max_seconds:g} s",
            reason=PromptAudioProblem.TOO_LONG,
        )
    audio = np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(2**15)
    _check_samples(audio, sample_rate, max_seconds=max_seconds, min_seconds=min_seconds, silence_peak=silence_peak)
    return audio, sample_rate


def _check_rate(rate: int, min_rate: int) -> None:
    if not min_rate <= rate <= MAX_SAMPLE_RATE_HZ:
        raise PromptAudioError(
            f"prompt audio sample rate {rate} Hz is outside {min_rate}..{MAX_SAMPLE_RATE_HZ} Hz",
            reason=PromptAudioProblem.SAMPLE_RATE,
        )


def _check_samples(audio: np.ndarray, rate: int, *, max_seconds: float, min_seconds: float, silence_peak: float) -> None:
    seconds = audio.size / rate
    if seconds > max_seconds:
        raise PromptAudioError(f"prompt audio is longer than {max_seconds:g} s", reason=PromptAudioProblem.TOO_LONG)
    if seconds < min_seconds:
        raise PromptAudioError(
            f"prompt audio is {seconds:.2f} s, shorter than {min_seconds:g} s", reason=PromptAudioProblem.TOO_SHORT
        )
    if not np.all(np.isfinite(audio)):
        raise PromptAudioError("prompt audio contains NaN or infinite samples", reason=PromptAudioProblem.CORRUPT)
    if float(np.max(np.abs(audio))) < silence_peak:
        raise PromptAudioError("prompt audio is silent", reason=PromptAudioProblem.SILENT)


def _check_wav_header(data: bytes, max_seconds: float, min_sample_rate: int) -> None:
    """For RIFF/WAVE input, refuse from the header alone a bad rate, or a length beyond the limit or the bytes sent.

    FFmpeg clamps a WAV's duration to the bytes present, so a cut file would otherwise pass unnoticed.
    Chunks are walked up to `data`; a streaming size (0xFFFFFFFF or 0) declares nothing.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return
    offset, byte_rate = 12, 0
    while offset + 8 <= len(data):
        chunk, size = data[offset : offset + 4], struct.unpack_from("<I", data, offset + 4)[0]
        if chunk == b"fmt " and size >= 16 and offset + 24 <= len(data):
            _check_rate(struct.unpack_from("<I", data, offset + 12)[0], min_sample_rate)
            byte_rate = struct.unpack_from("<I", data, offset + 16)[0]
        if chunk == b"data":
            if size in (0, _WAV_STREAMING_SIZE) or byte_rate == 0:
                return
            if size / byte_rate > max_seconds * _DECLARED_SLACK:
                raise PromptAudioError(
                    f"prompt audio is {size / byte_rate:.1f} s, longer than {max_seconds:g} s", reason=PromptAudioProblem.TOO_LONG
                )
            available = len(data) - offset - 8
            if size > available:
                raise PromptAudioError(
                    f"prompt WAV is truncated: {available} of {size} data bytes", reason=PromptAudioProblem.TRUNCATED
                )
            return
        offset += 8 + size + (size & 1)


def _declared_seconds(container: Any, stream: Any) -> float | None:
    """Duration the headers state (stream first, then container), or None when they state none."""
    if stream.duration is not None and stream.time_base is not None:
        return float(stream.duration * stream.time_base)
    if container.duration is not None:
        return float(container.duration) / av.time_base
    return None


def _decode_mono(container: Any, stream: Any, rate: int, max_seconds: float) -> Iterator[np.ndarray]:
    """Decoded frames as mono float32 pieces; stops with TOO_LONG once more than `max_seconds` arrived."""
    limit = max_seconds * rate
    total = 0
    try:
        for frame in container.decode(stream):
            if frame.sample_rate != rate:
                raise PromptAudioError("prompt audio changes sample rate mid-stream", reason=PromptAudioProblem.CORRUPT)
            piece = _frame_to_mono(frame)
            total += piece.size
            if total > limit:
                raise PromptAudioError(f"prompt audio is longer than {max_seconds:g} s", reason=PromptAudioProblem.TOO_LONG)
            yield piece
    except (av.FFmpegError, ValueError) as e:
        log.info("prompt audio not decoded: %s", e)
        raise PromptAudioError(
            "prompt audio is damaged: its audio data cannot be decoded", reason=PromptAudioProblem.CORRUPT
        ) from e


def _frame_to_mono(frame: Any) -> np.ndarray:
    """One decoded frame -> the mean of its channels as float32 (n,), integer samples scaled to [-1, 1)."""
    channels = frame.layout.nb_channels
    samples = frame.to_ndarray()
    if not frame.format.is_planar:  # packed: (1, n * channels), interleaved
        samples = samples.reshape(-1, channels).T
    if samples.dtype == np.uint8:
        values = (samples.astype(np.float64) - 128.0) / 128.0
    elif samples.dtype in _INT_SCALE:
        values = samples.astype(np.float64) / _INT_SCALE[samples.dtype]
    else:
        values = samples.astype(np.float64)
    # float64 sum of float32 values then one rounding: equals torch's float32 channel mean for 1-2 channels
    return np.asarray(values.mean(axis=0).astype(np.float32), dtype=np.float32)
