"""Readers of our audio written without the service's code: FLAC's STREAMINFO by hand, libsndfile (soundfile), PyAV."""

from __future__ import annotations

import hashlib
import io

import av
import numpy as np
import soundfile as sf

FLAC_STREAMINFO = slice(8, 42)  # "fLaC", a 4-byte metadata block header, then the 34-byte STREAMINFO block


def flac_streaminfo(data: bytes) -> tuple[int, int, bytes]:
    """(sample rate Hz, total samples (0 = unknown), MD5 of the samples (16 zero bytes = not computed))."""
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "not a FLAC file starting with STREAMINFO"
    info = data[FLAC_STREAMINFO]
    packed = int.from_bytes(info[10:18], "big")  # 20 bits rate, 3 channels-1, 5 bits-1, 36 total samples
    return packed >> 44, packed & ((1 << 36) - 1), info[18:34]


def pcm_md5(samples: np.ndarray) -> bytes:
    """The MD5 FLAC stores: over the samples as little-endian signed 16-bit."""
    return hashlib.md5(np.asarray(samples, dtype="<i2").tobytes()).digest()


def soundfile_read(data: bytes) -> tuple[np.ndarray, int]:
    """`soundfile.read` of a whole file as int16 (it sizes its buffer from the header's length)."""
    samples, rate = sf.read(io.BytesIO(data), dtype="int16")
    return np.asarray(samples), int(rate)


def libsndfile_read_to_end(data: bytes) -> np.ndarray:
    """Every int16 sample libsndfile decodes, read front to back until it has no more, as a player reads a stream.

    soundfile's own `read` cannot do this for a stream of unknown length: it asks for the length from the header
    and seeks after each read (past the end of a stream that states none). So this calls libsndfile's
    `sf_readf_short` through soundfile's binding directly.
    """
    parts = []
    buffer = np.empty(4096, dtype=np.int16)
    with sf.SoundFile(io.BytesIO(data)) as f:
        pointer = sf._ffi.cast("short *", buffer.ctypes.data)
        while (n := sf._snd.sf_readf_short(f._file, pointer, buffer.size)) > 0:
            parts.append(buffer[:n].copy())
    return np.concatenate(parts) if parts else np.zeros(0, np.int16)


def pyav_read(data: bytes) -> tuple[np.ndarray, int, float | None]:
    """(int16 samples, sample rate, duration the container states in seconds or None) decoded by FFmpeg (PyAV)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        declared = float(container.duration) / av.time_base if container.duration is not None else None
        rate = stream.codec_context.sample_rate
    return np.concatenate(frames).astype(np.int16), rate, declared
