"""Sample counts of streamed audio against an independent decoder (PyAV), and each format's decoder priming."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest

from service.audio.encode import AudioFormat, make_encoder
from service.audio.timeline import DECODER_DELAY_SAMPLES, decoder_delay_s, sample_counter

MODEL_RATE = 22050


def encoded(fmt: AudioFormat, audio: np.ndarray, rate: int, piece: int = 3000) -> bytes:
    """`audio` (model rate) streamed through our encoder in pieces, as a job encodes it."""
    encoder = make_encoder(fmt, MODEL_RATE, rate, 64)
    return b"".join(encoder.encode(audio[i : i + piece]) for i in range(0, audio.size, piece)) + encoder.finish()


def decoded(data: bytes, rate: int) -> np.ndarray:
    """What PyAV decodes from `data`, at `rate` (Opus decodes at 48 kHz: every other sample is taken)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = np.concatenate([f.to_ndarray().reshape(-1) for f in container.decode(stream)])
        step = stream.codec_context.sample_rate // rate
    return samples[::step]


@pytest.mark.parametrize(
    ("fmt", "rate"),
    [(AudioFormat.MP3, r) for r in (8000, 16000, 22050, 24000, 44100, 48000)]
    + [(AudioFormat.OPUS, r) for r in (8000, 16000, 24000, 48000)],
)
@pytest.mark.parametrize("n", [1000, 5000, 22050, 40001])
def test_counted_samples_equal_what_a_decoder_yields_however_the_bytes_are_split(fmt: AudioFormat, rate: int, n: int) -> None:
    audio = (np.random.default_rng(n).standard_normal(n) * 0.1).astype(np.float32)
    data = encoded(fmt, audio, rate)
    counter = sample_counter(fmt, rate)
    cuts = np.random.default_rng(rate).integers(1, 700, size=len(data))
    pos = 0
    for size in cuts:  # pages, frames and even headers split across pieces
        counter.feed(data[pos : pos + size])
        pos += int(size)
        if pos >= len(data):
            break
    assert counter.samples == decoded(data, rate).size


def test_pcm_counts_two_bytes_a_sample() -> None:
    counter = sample_counter(AudioFormat.PCM, 24000)
    counter.feed(b"\x00" * 10)
    counter.feed(b"\x00" * 4)
    assert counter.samples == 7


@pytest.mark.parametrize(
    ("fmt", "rate"), [(AudioFormat.MP3, 22050), (AudioFormat.MP3, 48000), (AudioFormat.AAC, 24000), (AudioFormat.OPUS, 24000)]
)
def test_decoder_delay_is_where_an_impulse_comes_out(fmt: AudioFormat, rate: int) -> None:
    audio = np.zeros(rate, dtype=np.float32)
    audio[5000], audio[5001] = 0.9, -0.9
    encoder = make_encoder(fmt, rate, rate, 64)
    out = decoded(encoder.encode(audio) + encoder.finish(), rate)
    peak = int(np.argmax(np.abs(out)))
    assert abs(peak - 5000 - DECODER_DELAY_SAMPLES.get(fmt, 0)) <= 1
    assert decoder_delay_s(fmt, rate) == DECODER_DELAY_SAMPLES.get(fmt, 0) / rate


def test_only_the_streamed_formats_have_a_counter() -> None:
    with pytest.raises(ValueError, match="flac"):
        sample_counter(AudioFormat.FLAC, MODEL_RATE)
