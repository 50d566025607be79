"""Where streamed audio lands on a listener's timeline: the samples a decoder yields for PCM, Ogg Opus and MP3 bytes
as they stream past, and the silence a decoder puts before the signal (MP3 and AAC priming)."""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from typing import Protocol

from service.audio.encode import AudioFormat

# Samples a decoder outputs before the first input sample when the stream carries no gapless information (a streamed
# MP3 has no LAME/Xing tag; ADTS has no edit list): LAME's encoder delay 576 + the MP3 decoder's 529, and the AAC
# encoder's 1024 priming samples. Opus is exact: every Ogg Opus decoder drops the header's pre-skip and trims the
# end to the last page's granule position. tests/test_audio_timeline.py measures both by decoding an impulse.
DECODER_DELAY_SAMPLES = {AudioFormat.MP3: 1105, AudioFormat.AAC: 1024}

OPUS_GRANULE_RATE_HZ = 48_000  # Ogg Opus granule positions always count 48 kHz samples
_OGG_HEADER = struct.Struct("<4sBBqIIIB")  # capture, version, flags, granule, serial, page no, crc, segments
_ID3_HEADER_BYTES = 10
_MP3_MIN_HEADER = 4
# Layer III bit rates (kbit/s) by bit-rate index: MPEG-1, then MPEG-2 and 2.5
_MP3_KBPS = (
    (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
)
_MP3_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}  # by version bits


def decoder_delay_s(fmt: AudioFormat, sample_rate_hz: int) -> float:
    """Seconds of priming a decoder outputs before the encoded signal starts (0 for PCM, WAV, FLAC, Opus)."""
    return DECODER_DELAY_SAMPLES.get(fmt, 0) / sample_rate_hz


class SampleCounter(Protocol):
    """Fed the bytes of one encoded stream in order (any split); `samples` is what a decoder yields for them so far."""

    @property
    def samples(self) -> int: ...

    def feed(self, data: bytes) -> None: ...


class PcmCounter:
    """Raw int16 mono: two bytes a sample."""

    def __init__(self) -> None:
        self._bytes = 0

    @property
    def samples(self) -> int:
        return self._bytes // 2

    def feed(self, data: bytes) -> None:
        self._bytes += len(data)


class _Framed(ABC):
    """Walks a byte stream of self-delimiting units (pages, frames) that may be split across `feed` calls."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> None:
        self._buf += data
        pos = 0
        while (used := self._unit(self._buf, pos)) is not None:
            pos += used
        self._buf = self._buf[pos:]

    @abstractmethod
    def _unit(self, buf: bytes, pos: int) -> int | None:
        """Account the unit starting at `pos`; its length, or None until it is complete in `buf`."""


class OggOpusCounter(_Framed):
    """Ogg Opus: the last granule position minus the pre-skip of the OpusHead, at `sample_rate_hz`."""

    def __init__(self, sample_rate_hz: int) -> None:
        super().__init__()
        self.sample_rate_hz = sample_rate_hz
        self._pre_skip: int | None = None
        self._granule = 0

    @property
    def samples(self) -> int:
        decoded = max(0, self._granule - (self._pre_skip or 0))
        return decoded * self.sample_rate_hz // OPUS_GRANULE_RATE_HZ

    def _unit(self, buf: bytes, pos: int) -> int | None:
        if len(buf) - pos < _OGG_HEADER.size:
            return None
        capture, _, _, granule, _, _, _, segments = _OGG_HEADER.unpack_from(buf, pos)
        n_segments, granule = int(segments), int(granule)
        if capture != b"OggS":
            raise ValueError("not an Ogg page")
        body = pos + _OGG_HEADER.size + n_segments
        if len(buf) < body:
            return None
        end = body + sum(buf[pos + _OGG_HEADER.size : body])
        if len(buf) < end:
            return None
        if self._pre_skip is None and buf[body : body + 8] == b"OpusHead":
            self._pre_skip = int(struct.unpack_from("<H", buf, body + 10)[0])
        if granule >= 0:  # -1: no packet ends on this page
            self._granule = granule
        return end - pos


class Mp3Counter(_Framed):
    """MP3: frames times samples per frame, after any ID3v2 tag; a Xing/Info frame (metadata) counts nothing."""

    def __init__(self) -> None:
        super().__init__()
        self._samples = 0

    @property
    def samples(self) -> int:
        return self._samples

    def _unit(self, buf: bytes, pos: int) -> int | None:
        if len(buf) - pos < max(_MP3_MIN_HEADER, 3):
            return None
        if buf[pos : pos + 3] == b"ID3":
            return _id3_length(buf, pos)
        frame = _mp3_frame(buf, pos)
        if frame is None:
            return 1  # not a frame header: step over one byte and look again (what decoders do)
        length, per_frame, side_info = frame
        if len(buf) - pos < length:
            return None
        tag = buf[pos + 4 + side_info : pos + 8 + side_info]
        if tag not in (b"Xing", b"Info"):
            self._samples += per_frame
        return length


def _id3_length(buf: bytes, pos: int) -> int | None:
    """Bytes of the ID3v2 tag at `pos` (its size is a 28-bit "syncsafe" integer), or None until the header is in."""
    if len(buf) - pos < _ID3_HEADER_BYTES:
        return None
    flags, size = buf[pos + 5], 0
    for b in buf[pos + 6 : pos + 10]:
        size = (size << 7) | (b & 0x7F)
    footer = _ID3_HEADER_BYTES if flags & 0x10 else 0
    return _ID3_HEADER_BYTES + size + footer


def _mp3_frame(buf: bytes, pos: int) -> tuple[int, int, int] | None:
    """(frame bytes, samples per frame, side-info bytes) of the Layer III frame header at `pos`, else None."""
    b1, b2 = buf[pos + 1], buf[pos + 2]
    version, layer, kbps_index, rate_index = (b1 >> 3) & 3, (b1 >> 1) & 3, b2 >> 4, (b2 >> 2) & 3
    if buf[pos] != 0xFF or b1 & 0xE0 != 0xE0 or version == 1 or layer != 1 or kbps_index in (0, 15) or rate_index == 3:
        return None
    mpeg1 = version == 3
    kbps = _MP3_KBPS[0 if mpeg1 else 1][kbps_index]
    rate = _MP3_RATES[version][rate_index]
    padding = (b2 >> 1) & 1
    mono = (buf[pos + 3] >> 6) == 3
    side_info = (17 if mono else 32) if mpeg1 else (9 if mono else 17)
    coefficient = 144_000 if mpeg1 else 72_000
    return coefficient * kbps // rate + padding, 1152 if mpeg1 else 576, side_info


def sample_counter(fmt: AudioFormat, sample_rate_hz: int) -> SampleCounter:
    """A counter for one stream of `fmt` at `sample_rate_hz` (PCM, Opus or MP3: the WebSocket's per-sentence formats)."""
    if fmt is AudioFormat.PCM:
        return PcmCounter()
    if fmt is AudioFormat.OPUS:
        return OggOpusCounter(sample_rate_hz)
    if fmt is AudioFormat.MP3:
        return Mp3Counter()
    raise ValueError(f"no sample counter for {fmt.value}")
