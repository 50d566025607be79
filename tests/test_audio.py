"""Audio encoding: int16 conversion, WAV headers, streaming resampling, and every format decoded back with PyAV."""

from __future__ import annotations

import io
import struct
import subprocess
import sys
from pathlib import Path

import av
import numpy as np
import pytest
from audio_readers import flac_streaminfo, libsndfile_read_to_end, pcm_md5, pyav_read, soundfile_read
from scipy.signal import resample_poly as scipy_resample_poly

from service.audio.encode import (
    OPUS_SAMPLE_RATE_HZ,
    AudioFormat,
    StreamResampler,
    encode_complete,
    float_to_int16,
    make_encoder,
    media_type,
    output_sample_rate,
    parse_format,
    resample,
    resample_poly,
    wav_header,
)
from service.errors import UnsupportedFormatError

REPO = Path(__file__).resolve().parents[1]

MODEL_RATE = 22050


def tone(seconds: float, rate: int = MODEL_RATE, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def decode(data: bytes) -> tuple[np.ndarray, int, str]:
    """Decode a whole file with PyAV: (mono float samples, sample rate, codec name)."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]
        rate = stream.codec_context.sample_rate
        name = stream.codec_context.name
    samples = np.concatenate(frames) if frames else np.zeros(0)
    if samples.dtype.kind == "i":
        samples = samples / 32768.0
    return samples.astype(np.float32), rate, name


def dominant_hz(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples * np.hanning(len(samples))))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[np.argmax(spectrum)])


def test_float_to_int16_matches_the_official_conversion_and_clips() -> None:
    x = np.array([0.0, 0.5, -0.5, 0.99, -0.99, 1.5, -1.5, 1 / 32768 * 0.9], dtype=np.float32)
    y = float_to_int16(x)
    assert y.dtype == np.int16
    official = (x[:5] * 32768).astype(np.int16)  # runtime/python/fastapi/server.py
    assert np.array_equal(y[:5], official)
    assert y[5] == 32767 and y[6] == -32768 and y[7] == 0


def test_wav_header_fields() -> None:
    h = wav_header(22050, 1000)
    riff, size, wave, fmt, fmt_len, pcm, channels, rate, byte_rate, align, bits, data, data_size = struct.unpack(
        "<4sI4s4sIHHIIHH4sI", h
    )
    assert (riff, wave, fmt, data) == (b"RIFF", b"WAVE", b"fmt ", b"data")
    assert (size, fmt_len, pcm, channels, rate, byte_rate, align, bits, data_size) == (2036, 16, 1, 1, 22050, 44100, 2, 16, 2000)
    streaming = wav_header(22050, None)
    assert len(streaming) == 44 and streaming[4:8] == b"\xff\xff\xff\xff" and streaming[40:44] == b"\xff\xff\xff\xff"


@pytest.mark.parametrize("src,dst", [(22050, 24000), (24000, 22050), (22050, 48000), (16000, 22050)])
def test_stream_resampler_equals_one_shot_resample_poly(src: int, dst: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(30_000).astype(np.float32) * 0.3
    whole = resample(x, src, dst)
    g = np.gcd(src, dst)
    # our numpy resampler: scipy's filter and alignment, float rounding apart (scipy is a test dependency only)
    want = scipy_resample_poly(x, dst // g, src // g).astype(np.float32)
    assert whole.shape == want.shape and np.max(np.abs(whole - want)) < 2e-6
    r = StreamResampler(src, dst)
    cuts = np.cumsum(rng.integers(1, 4000, size=40))
    cuts = cuts[cuts < len(x)]
    parts = [r.push(piece) for piece in np.split(x, cuts)] + [r.flush()]
    streamed = np.concatenate(parts)
    assert np.array_equal(streamed, whole)


@pytest.mark.parametrize("n", [0, 1, 2, 147, 160, 1001])
@pytest.mark.parametrize("up,down", [(160, 147), (147, 160), (1, 2), (2, 1), (320, 441)])
def test_resample_poly_matches_scipy_at_every_length(n: int, up: int, down: int) -> None:
    x = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    got, want = resample_poly(x, up, down), scipy_resample_poly(x, up, down).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert not n or np.max(np.abs(got - want)) < 2e-6


def test_serving_does_not_import_scipy() -> None:
    """scipy.signal alone added 76 MB to the server's resident size; serving resamples with numpy."""
    code = "import sys, service.api.app, service.rpc.server; sys.exit('scipy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


def test_resampled_tone_keeps_its_pitch() -> None:
    y = resample(tone(1.0, hz=1000.0), 22050, 24000)
    assert len(y) == 24000
    assert dominant_hz(y, 24000) == pytest.approx(1000.0, abs=2.0)


def test_parse_format_names_the_field() -> None:
    assert parse_format("opus") is AudioFormat.OPUS
    with pytest.raises(UnsupportedFormatError) as info:
        parse_format("wma", "response_format")
    assert info.value.param == "response_format" and "mp3" in info.value.message


def test_output_rates_and_media_types() -> None:
    assert output_sample_rate(AudioFormat.OPUS, MODEL_RATE) == OPUS_SAMPLE_RATE_HZ
    assert output_sample_rate(AudioFormat.PCM, MODEL_RATE) == MODEL_RATE
    assert output_sample_rate(AudioFormat.PCM, MODEL_RATE, 24000) == 24000
    assert output_sample_rate(AudioFormat.MP3, MODEL_RATE, 24000) == MODEL_RATE
    assert "rate=22050" in media_type(AudioFormat.PCM, 22050)
    assert media_type(AudioFormat.MP3, 22050) == "audio/mpeg"


EXPECTED_CODEC = {
    AudioFormat.WAV: "pcm_s16le",
    AudioFormat.MP3: "mp3float",  # FFmpeg's MP3 decoder
    AudioFormat.OPUS: "opus",
    AudioFormat.FLAC: "flac",
    AudioFormat.AAC: "aac",
}
# Codec delay/padding: MP3 and AAC add up to ~2 frames of priming and padding.
DURATION_TOLERANCE_S = {AudioFormat.MP3: 0.12, AudioFormat.AAC: 0.12, AudioFormat.OPUS: 0.03}


@pytest.mark.parametrize("fmt", [f for f in AudioFormat if f is not AudioFormat.PCM], ids=str)
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_every_format_decodes_with_the_right_rate_duration_and_pitch(fmt: AudioFormat, streamed: bool) -> None:
    audio = tone(1.5, hz=440.0)
    rate = output_sample_rate(fmt, MODEL_RATE)
    if streamed:
        enc = make_encoder(fmt, MODEL_RATE, rate)
        data = b"".join(enc.encode(audio[i : i + 3000]) for i in range(0, len(audio), 3000)) + enc.finish()
    else:
        data = encode_complete(fmt, audio, MODEL_RATE, rate)
    samples, decoded_rate, codec = decode(data)
    assert codec == EXPECTED_CODEC[fmt]
    if fmt is not AudioFormat.OPUS:  # libopus decodes at 48 kHz whatever was encoded
        assert decoded_rate == rate
    assert len(samples) / decoded_rate == pytest.approx(1.5, abs=DURATION_TOLERANCE_S.get(fmt, 1e-3))
    middle = samples[len(samples) // 4 : 3 * len(samples) // 4]
    assert dominant_hz(middle, decoded_rate) == pytest.approx(440.0, abs=3.0)


def test_lossless_formats_round_trip_the_int16_samples() -> None:
    audio = tone(0.5)
    expected = float_to_int16(audio)
    for fmt in (AudioFormat.WAV, AudioFormat.FLAC):
        samples, _, _ = decode(encode_complete(fmt, audio, MODEL_RATE, MODEL_RATE))
        assert np.array_equal(np.round(samples * 32768).astype(np.int16), expected), fmt


def test_a_whole_flac_states_its_length_and_md5_and_soundfile_reads_it() -> None:
    """libsndfile sizes its read from STREAMINFO: without the total it raised `array is too big`."""
    audio = tone(1.3)
    expected = float_to_int16(audio)
    data = encode_complete(AudioFormat.FLAC, audio, MODEL_RATE, MODEL_RATE)
    assert flac_streaminfo(data) == (MODEL_RATE, expected.size, pcm_md5(expected))
    samples, rate = soundfile_read(data)
    assert rate == MODEL_RATE and np.array_equal(samples, expected)
    decoded, rate, declared = pyav_read(data)
    assert np.array_equal(decoded, expected) and declared == pytest.approx(expected.size / MODEL_RATE, abs=1e-3)


def test_a_streamed_flac_states_an_unknown_length_and_decodes_to_the_end() -> None:
    """The header leaves before the last sample exists: total 0 (unknown), as FLAC allows; libsndfile and FFmpeg
    still decode every sample, front to back."""
    audio = tone(1.3)
    expected = float_to_int16(audio)
    enc = make_encoder(AudioFormat.FLAC, MODEL_RATE, MODEL_RATE)
    first = enc.encode(audio[:5000])
    data = first + b"".join(enc.encode(audio[i : i + 5000]) for i in range(5000, audio.size, 5000)) + enc.finish()
    assert first[:4] == b"fLaC" and flac_streaminfo(data)[:2] == (MODEL_RATE, 0)
    assert np.array_equal(libsndfile_read_to_end(data), expected)
    assert np.array_equal(pyav_read(data)[0], expected)


def test_a_whole_mp3_states_its_length() -> None:
    """A whole MP3 gets its Xing/Info frame count, so readers know the duration without decoding it all."""
    audio = tone(2.0)
    data = encode_complete(AudioFormat.MP3, audio, MODEL_RATE, MODEL_RATE)
    assert b"Info" in data[:2000] or b"Xing" in data[:2000]
    samples, rate = soundfile_read(data)
    assert rate == MODEL_RATE and samples.size == pytest.approx(audio.size, abs=MODEL_RATE * 0.03)


def test_streamed_wav_starts_with_a_streaming_header_then_raw_samples() -> None:
    audio = tone(0.3)
    enc = make_encoder(AudioFormat.WAV, MODEL_RATE, MODEL_RATE)
    first = enc.encode(audio[:1000])
    rest = enc.encode(audio[1000:]) + enc.finish()
    assert first[:4] == b"RIFF" and first[40:44] == b"\xff\xff\xff\xff" and len(first) == 44 + 2000
    assert first[44:] + rest == float_to_int16(audio).tobytes()


def test_whole_wav_has_exact_sizes() -> None:
    data = encode_complete(AudioFormat.WAV, tone(0.25), MODEL_RATE, MODEL_RATE)
    n = int(0.25 * MODEL_RATE)
    assert struct.unpack("<I", data[4:8])[0] == 36 + 2 * n and struct.unpack("<I", data[40:44])[0] == 2 * n
    assert len(data) == 44 + 2 * n


def test_pcm_is_raw_little_endian_int16_at_the_asked_rate() -> None:
    audio = tone(1.0)
    native = encode_complete(AudioFormat.PCM, audio, MODEL_RATE, MODEL_RATE)
    assert native == float_to_int16(audio).astype("<i2").tobytes()
    enc = make_encoder(AudioFormat.PCM, MODEL_RATE, 24000)
    resampled = b"".join(enc.encode(audio[i : i + 777]) for i in range(0, len(audio), 777)) + enc.finish()
    samples = np.frombuffer(resampled, dtype="<i2")
    assert len(samples) == 24000
    assert dominant_hz(samples.astype(np.float32), 24000) == pytest.approx(440.0, abs=2.0)


def test_streamed_codec_output_arrives_progressively() -> None:
    """Chunk-by-chunk encoding hands out bytes before the end (needed for streaming playback)."""
    audio = tone(3.0)
    for fmt in (AudioFormat.MP3, AudioFormat.OPUS, AudioFormat.AAC, AudioFormat.FLAC):
        enc = make_encoder(fmt, MODEL_RATE, output_sample_rate(fmt, MODEL_RATE))
        sizes = [len(enc.encode(audio[i : i + 11025])) for i in range(0, len(audio), 11025)]
        tail = len(enc.finish())
        assert sum(sizes[:-1]) > tail, f"{fmt}: nothing streamed before finish: {sizes} + {tail}"


def noisy(seconds: float, rate: int = MODEL_RATE) -> np.ndarray:
    """A tone plus noise: enough entropy that a lossy encoder uses the bitrate it is given."""
    rng = np.random.default_rng(3)
    return (tone(seconds, rate) + 0.1 * rng.standard_normal(int(seconds * rate))).astype(np.float32)


@pytest.mark.parametrize("streamed", [False, True])
def test_mp3_bitrate_is_the_one_asked_for(streamed: bool) -> None:
    audio, sizes = noisy(3.0), {}
    for kbps in (32, 64, 128, 160):
        if streamed:
            encoder = make_encoder(AudioFormat.MP3, MODEL_RATE, MODEL_RATE, kbps)
            data = encoder.encode(audio[:30000]) + encoder.encode(audio[30000:]) + encoder.finish()
        else:
            data = encode_complete(AudioFormat.MP3, audio, MODEL_RATE, MODEL_RATE, kbps)
        with av.open(io.BytesIO(data)) as container:
            assert container.streams.audio[0].bit_rate == kbps * 1000
        sizes[kbps] = len(data)
    # CBR: the size is the bitrate times the duration (plus a little framing)
    assert sizes[160] / sizes[32] == pytest.approx(5.0, rel=0.05)


@pytest.mark.parametrize(("fmt", "out_rate"), [(AudioFormat.OPUS, OPUS_SAMPLE_RATE_HZ), (AudioFormat.AAC, MODEL_RATE)])
def test_opus_and_aac_grow_with_the_bitrate(fmt: AudioFormat, out_rate: int) -> None:
    audio = noisy(3.0)
    low, high = (encode_complete(fmt, audio, MODEL_RATE, out_rate, kbps) for kbps in (32, 96))
    assert len(high) > 2 * len(low)
    with av.open(io.BytesIO(high)) as container:
        measured = container.bit_rate  # the container's estimate: bytes over duration
    assert measured == pytest.approx(96_000, rel=0.2)


def test_flac_ignores_the_bitrate() -> None:
    audio = tone(1.0)
    assert encode_complete(AudioFormat.FLAC, audio, MODEL_RATE, MODEL_RATE, 16) == encode_complete(
        AudioFormat.FLAC, audio, MODEL_RATE, MODEL_RATE, 160
    )
