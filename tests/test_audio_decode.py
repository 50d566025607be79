"""Prompt-audio decoding: exact WAV, every container we accept (encoded here with PyAV), and refused inputs."""

from __future__ import annotations

import io
import struct
from pathlib import Path

import av
import numpy as np
import pytest
from scipy.io import wavfile
from scipy.signal import correlate

from service.audio.decode import container_format, decode_audio, pcm16_to_float
from service.errors import ErrorCode, PromptAudioError, PromptAudioProblem
from service.layers.features import resample

PROMPTS = ("zh_16k", "en_24k", "zh_44k", "en_48k_stereo")
TOL_RESAMPLE = 1e-6  # the resampler meets the fixtures within 2.4e-7


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """A 16-bit PCM WAV of int16 samples (N,) or (N, channels), written by scipy (not by the code under test)."""
    buf = io.BytesIO()
    wavfile.write(buf, rate, samples)
    return buf.getvalue()


def tone(seconds: float, rate: int, amplitude: float = 0.5, hz: float = 440.0) -> np.ndarray:
    t = np.arange(int(seconds * rate)) / rate
    return (amplitude * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def encode(x: np.ndarray, rate: int, container: str, codec: str) -> bytes:
    """Encode mono float32 `x` with PyAV into `container` bytes (the test's own encoder, not service code)."""
    buf = io.BytesIO()
    with av.open(buf, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        fmt = stream.codec_context.codec.audio_formats[0].name
        stream.format = fmt
        if fmt.startswith("s16"):
            data = np.round(x * 32767).astype(np.int16)[None]
        elif fmt.startswith("s32"):
            data = np.round(x * 32767).astype(np.int32)[None] << 16
        else:
            data = x.astype(np.float32)[None]
        size = stream.codec_context.frame_size or 1024
        for i in range(0, x.shape[0], size):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data[:, i : i + size]), format=fmt, layout="mono")
            frame.sample_rate, frame.pts = rate, i
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return buf.getvalue()


def best_correlation(a: np.ndarray, b: np.ndarray, max_lag: int) -> float:
    """Largest normalised cross-correlation of a and b over lags in [-max_lag, max_lag] (codec delay)."""
    n = min(a.size, b.size) - 2 * max_lag
    ref = b[max_lag : max_lag + n].astype(np.float64)
    dots = correlate(a[: n + 2 * max_lag].astype(np.float64), ref, mode="valid", method="fft")
    power = np.concatenate([[0.0], np.cumsum(a[: n + 2 * max_lag].astype(np.float64) ** 2)])
    energy = np.sqrt(power[n:] - power[:-n])
    return float(np.max(dots / (energy * np.linalg.norm(ref) + 1e-12)))


@pytest.fixture(scope="module")
def prompts(ref_dir: Path) -> dict[str, np.ndarray]:
    with np.load(ref_dir / "prompts.npz") as npz:
        return {k: npz[k] for k in npz.files}


# ---- accepted input ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", PROMPTS)
def test_wav_is_exact_int16_over_32768_with_channel_mean(ref_dir: Path, name: str) -> None:
    data = (ref_dir / "prompts" / f"{name}.wav").read_bytes()
    rate, raw = wavfile.read(io.BytesIO(data))
    assert raw.dtype == np.int16
    want = raw.astype(np.float32) / np.float32(32768)
    if want.ndim == 2:
        want = want.mean(axis=1, dtype=np.float32)
    audio, got_rate = decode_audio(data, max_seconds=30)
    assert got_rate == rate
    assert audio.dtype == np.float32 and audio.shape == want.shape
    np.testing.assert_array_equal(audio, want)


@pytest.mark.parametrize("name", PROMPTS)
def test_decoded_fixture_resamples_to_the_official_16k_speech(ref_dir: Path, prompts: dict[str, np.ndarray], name: str) -> None:
    audio, rate = decode_audio((ref_dir / "prompts" / f"{name}.wav").read_bytes(), max_seconds=30)
    want = prompts[f"{name}_speech_16k"][0]
    got = resample(audio, rate, 16_000)
    assert got.shape == want.shape
    assert float(np.max(np.abs(got - want))) <= TOL_RESAMPLE


def test_stereo_mix_differs_from_both_channels(ref_dir: Path) -> None:
    data = (ref_dir / "prompts" / "en_48k_stereo.wav").read_bytes()
    _, raw = wavfile.read(io.BytesIO(data))
    audio, _ = decode_audio(data, max_seconds=30)
    for channel in range(2):
        assert float(np.max(np.abs(audio - raw[:, channel] / 32768))) > 0.05


def test_24_bit_and_float_wav(ref_dir: Path) -> None:
    rate, raw = wavfile.read(ref_dir / "prompts" / "zh_16k.wav")
    x = raw.astype(np.float32) / 32768
    buf = io.BytesIO()
    wavfile.write(buf, rate, x)  # 32-bit float WAV
    audio, _ = decode_audio(buf.getvalue(), max_seconds=30)
    np.testing.assert_array_equal(audio, x)
    audio, _ = decode_audio(wav_bytes((raw.astype(np.int32) << 16), rate), max_seconds=30)  # 32-bit int
    np.testing.assert_array_equal(audio, x)


@pytest.mark.parametrize(
    ("container", "codec", "rate", "decoded_rate", "exact"),
    [
        ("flac", "flac", 24_000, 24_000, True),
        ("mp3", "libmp3lame", 24_000, 24_000, False),
        ("ogg", "libopus", 24_000, 48_000, False),  # Opus always decodes at 48 kHz
        ("ipod", "aac", 24_000, 24_000, False),  # .m4a
        ("adts", "aac", 24_000, 24_000, False),  # raw .aac
    ],
)
def test_compressed_formats(ref_dir: Path, container: str, codec: str, rate: int, decoded_rate: int, exact: bool) -> None:
    src_rate, raw = wavfile.read(ref_dir / "prompts" / "en_24k.wav")
    x = raw.astype(np.float32) / 32768
    assert src_rate == rate
    audio, got_rate = decode_audio(encode(x, rate, container, codec), max_seconds=30)
    assert got_rate == decoded_rate and audio.dtype == np.float32
    back = resample(audio, got_rate, rate)
    if exact:  # lossless: int16 round trip of the encoder input
        np.testing.assert_allclose(back, np.round(x * 32767) / 32768, atol=1e-7)
        return
    assert abs(back.size - x.size) <= 0.1 * rate  # encoder priming/padding only
    assert best_correlation(back, x, max_lag=2048) > 0.9


def test_pcm16_is_exact() -> None:
    samples = np.array([0, 1, -1, 32767, -32768, 1234] * 4000, dtype="<i2")
    audio, rate = pcm16_to_float(samples.tobytes(), max_seconds=30)
    assert rate == 16_000 and audio.dtype == np.float32
    np.testing.assert_array_equal(audio, samples.astype(np.float32) / 32768)


def _without_id3(data: bytes) -> bytes:
    """An MP3 without its ID3v2 tag (as some encoders write it): the bare frames."""
    assert data[:3] == b"ID3"
    size = (data[6] & 0x7F) << 21 | (data[7] & 0x7F) << 14 | (data[8] & 0x7F) << 7 | (data[9] & 0x7F)
    return data[10 + size :]


@pytest.mark.parametrize(
    ("container", "codec", "name"),
    [
        ("wav", "pcm_s16le", "WAV"),
        ("flac", "flac", "FLAC"),
        ("mp3", "libmp3lame", "MP3"),
        ("ogg", "libopus", "Ogg"),
        ("ipod", "aac", "MP4/M4A"),
        ("adts", "aac", "AAC"),
        ("webm", "libopus", "WebM/Matroska"),
    ],
)
def test_container_format_names_every_file_we_decode(ref_dir: Path, container: str, codec: str, name: str) -> None:
    _, raw = wavfile.read(ref_dir / "prompts" / "en_24k.wav")
    data = encode(raw.astype(np.float32) / 32768, 24_000, container, codec)
    assert container_format(data) == name
    if name == "MP3":
        assert container_format(_without_id3(data)) == "MP3"


def test_raw_pcm_is_no_container(ref_dir: Path) -> None:
    """What the official gRPC client sends (16 kHz int16 samples), silence, tiny and loud noise: never a file."""
    _, raw = wavfile.read(ref_dir / "prompts" / "zh_16k.wav")
    rng = np.random.default_rng(5)
    pcm = [
        raw.astype("<i2").tobytes(),
        bytes(32_000),
        np.full(16_000, -1, "<i2").tobytes(),
        rng.integers(-3, 4, 16_000).astype("<i2").tobytes(),
        rng.integers(-32768, 32768, 16_000).astype("<i2").tobytes(),
    ]
    for data in pcm:
        assert container_format(data) is None
    starts = sum(container_format(rng.integers(-32768, 32768, 2048).astype("<i2").tobytes()) is not None for _ in range(500))
    assert starts == 0


# ---- refused input ----------------------------------------------------------------------------


def refused(data: bytes, reason: PromptAudioProblem, **kw: float) -> PromptAudioError:
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data, max_seconds=kw.pop("max_seconds", 30), **kw)  # type: ignore[arg-type]
    assert info.value.reason == reason, info.value.message
    assert info.value.code == ErrorCode.INVALID_AUDIO
    return info.value


def test_empty_bytes() -> None:
    refused(b"", PromptAudioProblem.EMPTY)


@pytest.mark.parametrize(
    "data",
    [
        b"hello, this is plain text and certainly not audio" * 20,
        np.random.RandomState(0).bytes(50_000),
        b"\x89PNG\r\n\x1a\n" + bytes(200),
        b"RIFF",
        b"\x00",
    ],
    ids=["text", "random", "png-header", "riff-stub", "one-byte"],
)
def test_not_audio(data: bytes) -> None:
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data, max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.NOT_AUDIO, PromptAudioProblem.CORRUPT)


def test_truncated_wav(ref_dir: Path) -> None:
    data = (ref_dir / "prompts" / "zh_44k.wav").read_bytes()
    refused(data[: len(data) // 2], PromptAudioProblem.TRUNCATED)


def test_wav_header_without_samples(ref_dir: Path) -> None:
    data = (ref_dir / "prompts" / "zh_16k.wav").read_bytes()
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data[:44], max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.CORRUPT, PromptAudioProblem.TRUNCATED)


def test_truncated_flac(ref_dir: Path) -> None:
    _, raw = wavfile.read(ref_dir / "prompts" / "en_24k.wav")
    data = encode(raw.astype(np.float32) / 32768, 24_000, "flac", "flac")
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data[: len(data) * 3 // 4], max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.CORRUPT, PromptAudioProblem.TRUNCATED)


def test_garbled_aac(ref_dir: Path) -> None:
    _, raw = wavfile.read(ref_dir / "prompts" / "en_24k.wav")
    data = bytearray(encode(raw.astype(np.float32) / 32768, 24_000, "adts", "aac"))
    data[len(data) // 3 : len(data) // 3 + 2000] = np.random.RandomState(1).bytes(2000)
    refused(bytes(data), PromptAudioProblem.CORRUPT)


def test_silent() -> None:
    refused(wav_bytes(np.zeros(32_000, np.int16), 16_000), PromptAudioProblem.SILENT)
    refused(wav_bytes(np.full(32_000, 3, np.int16), 16_000), PromptAudioProblem.SILENT)  # 3 / 32768 < 1e-4
    audio, _ = decode_audio(wav_bytes(np.full(32_000, 4, np.int16), 16_000), max_seconds=30)  # just above
    assert audio.max() > 1e-4


@pytest.mark.parametrize("rate", [8_000, 11_025, 15_999])
def test_rates_below_16k_are_refused(rate: int) -> None:
    samples = np.round(tone(2.0, rate) * 32767).astype(np.int16)
    refused(wav_bytes(samples, rate), PromptAudioProblem.SAMPLE_RATE)


def _with_rate(data: bytes, rate: int) -> bytes:
    """The same WAV with the header's sample rate (and byte rate) replaced."""
    out = bytearray(data)
    channels, bits = struct.unpack_from("<H", out, 22)[0], struct.unpack_from("<H", out, 34)[0]
    struct.pack_into("<II", out, 24, rate, rate * channels * bits // 8)
    return bytes(out)


@pytest.mark.parametrize("rate", [1, 400_000, 2_000_000_000])
def test_absurd_sample_rates(rate: int) -> None:
    data = _with_rate(wav_bytes(np.round(tone(2.0, 16_000) * 32767).astype(np.int16), 16_000), rate)
    with pytest.raises(PromptAudioError) as info:
        decode_audio(data, max_seconds=30)
    assert info.value.reason in (PromptAudioProblem.SAMPLE_RATE, PromptAudioProblem.NOT_AUDIO)


def test_too_long_is_refused_from_the_header() -> None:
    # 2 s of samples, but the header declares 2 hours: the declared length refuses it before decoding
    data = bytearray(wav_bytes(np.round(tone(2.0, 16_000) * 32767).astype(np.int16), 16_000))
    declared = 2 * 3600 * 16_000 * 2
    struct.pack_into("<I", data, 40, declared)
    struct.pack_into("<I", data, 4, declared + 36)
    refused(bytes(data), PromptAudioProblem.TOO_LONG)


def test_too_long_by_decoding() -> None:
    samples = np.round(tone(31.0, 16_000) * 32767).astype(np.int16)
    refused(wav_bytes(samples, 16_000), PromptAudioProblem.TOO_LONG)
    refused(encode(tone(6.0, 16_000), 16_000, "mp3", "libmp3lame"), PromptAudioProblem.TOO_LONG, max_seconds=5)
    audio, _ = decode_audio(wav_bytes(samples[: 30 * 16_000], 16_000), max_seconds=30)  # exactly 30 s is fine
    assert audio.size == 30 * 16_000


def test_too_short() -> None:
    refused(wav_bytes(np.round(tone(0.5, 16_000) * 32767).astype(np.int16), 16_000), PromptAudioProblem.TOO_SHORT)


def test_no_audio_stream() -> None:
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for i in range(5):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), i * 40, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    refused(buf.getvalue(), PromptAudioProblem.NOT_AUDIO)


@pytest.mark.parametrize(
    ("data", "kw", "reason"),
    [
        (b"", {}, PromptAudioProblem.EMPTY),
        (b"\x00\x01\x02", {}, PromptAudioProblem.CORRUPT),
        (bytes(64_000), {}, PromptAudioProblem.SILENT),
        (np.full(8_000, 1000, "<i2").tobytes(), {}, PromptAudioProblem.TOO_SHORT),
        (np.full(16_000 * 31, 1000, "<i2").tobytes(), {}, PromptAudioProblem.TOO_LONG),
        (np.full(16_000, 1000, "<i2").tobytes(), {"sample_rate": 8_000}, PromptAudioProblem.SAMPLE_RATE),
    ],
    ids=["empty", "odd", "silent", "short", "long", "rate"],
)
def test_pcm16_refusals(data: bytes, kw: dict[str, int], reason: PromptAudioProblem) -> None:
    with pytest.raises(PromptAudioError) as info:
        pcm16_to_float(data, max_seconds=30, **kw)
    assert info.value.reason == reason
