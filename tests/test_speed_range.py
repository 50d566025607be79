"""Every speed the APIs accept works on both families, streamed and whole, in every output path: the lowest, the
highest and values between (issue 40: CosyVoice2 streamed at 2.6-4.0 answered 500 from the vocoder's cross-fade)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from audio_readers import pyav_read
from fastapi.testclient import TestClient

from service.api import create_app
from service.api.schemas import SpeechBody, TTSBody
from service.engine.options import RuntimeOptions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.layers.vocoder import VocoderStream
from service.settings import Settings

REPO = Path(__file__).resolve().parent.parent
V2_PROMPT = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"
V2_VOICE = "speed-voice"
TEXT = "你好，世界。"


def speed_bounds(body: type[SpeechBody] | type[TTSBody]) -> tuple[float, float]:
    """(lowest, highest) `speed` a request body accepts, read from its schema (not restated here)."""
    field = body.model_fields["speed"]
    low = next(m.ge for m in field.metadata if getattr(m, "ge", None) is not None)
    high = next(m.le for m in field.metadata if getattr(m, "le", None) is not None)
    return float(low), float(high)


OPENAI_LOW, OPENAI_HIGH = speed_bounds(SpeechBody)
TTS_LOW, TTS_HIGH = speed_bounds(TTSBody)
# the bounds, the reported 2.6-4.0 range, and values between
OPENAI_SPEEDS = sorted({OPENAI_LOW, 0.5, 1.0, 2.0, 2.6, 3.3, OPENAI_HIGH})
TTS_SPEEDS = sorted({TTS_LOW, 1.0, 1.3, TTS_HIGH})


# ---- the vocoder stream alone ----------------------------------------------------------------------
class _Recorder:
    """A stand-in Vocoder: audio of `samples_per_frame` samples per mel frame, counting the frames it was given."""

    samples_per_frame = 480

    def __init__(self, keep_frames: int) -> None:
        self.constants = type("C", (), {"mel_cache_len": keep_frames, "nb_harmonics": 8})()
        self.frames: list[int] = []

    def noise_shape(self, frames: int) -> tuple[int, int]:
        return frames * self.samples_per_frame, 9

    def inference(self, mel: np.ndarray, cache_source: np.ndarray, noise: np.ndarray | None, source: None = None, *,
                  wide: bool = False) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        self.frames.append(mel.shape[1])
        wav = np.ones(mel.shape[1] * self.samples_per_frame, dtype=np.float32)
        return wav, wav.copy()


@pytest.mark.parametrize("pieces", [[5, 2, 1, 30], [3, 3, 3], [7], [1, 1, 1, 1, 1, 1, 1, 1, 9], [8, 1, 6]])
def test_pieces_shorter_than_the_vocoder_cache_are_vocoded_with_the_next(pieces: list[int]) -> None:
    """Non-final mel pieces of any size (a streamed tempo change makes them as small as one frame) give the sentence's
    whole audio: every frame vocoded once more than the caches re-vocode, no failing cross-fade."""
    keep = 8
    vocoder = _Recorder(keep)
    stream = VocoderStream(vocoder, np.random.default_rng(0))  # type: ignore[arg-type]
    out = [stream.push(np.zeros((80, n), dtype=np.float32), final=i == len(pieces) - 1) for i, n in enumerate(pieces)]
    assert sum(p.size for p in out) == sum(pieces) * vocoder.samples_per_frame
    assert all(n >= keep for n in vocoder.frames[:-1]), "a non-final call had less than the cache to hand on"


# ---- the CosyVoice2 engine ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_v2_bundle: Path) -> Iterator[CosyVoice2Engine]:
    engine = CosyVoice2Engine.load(tiny_v2_bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    yield engine
    engine.close()


def random_voice(seed: int) -> Voice2:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 6561, 30))
    mel = rng.standard_normal((60, 80)).astype(np.float32) - 5
    return Voice2.cloned("v", rng.standard_normal(192).astype(np.float32), tokens, mel, (5, 6, 7))


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("speed", OPENAI_SPEEDS)
def test_cosyvoice2_speaks_at_every_speed(engine: CosyVoice2Engine, speed: float, stream: bool) -> None:
    """Sentences of 1, 13 and 80 speech tokens (a lone token, one short chunk, several chunks): the official
    int(frames / speed) frames (at least one), streamed within a frame of the whole-sentence resize."""
    voice = random_voice(6)
    for n in (1, 13, 80):
        tokens = np.random.default_rng(n).integers(0, 6561, n).tolist()
        options = SynthesisOptions(stream=stream, speed=speed, seed=1)
        audio = np.concatenate(list(engine.synthesize_tokens(tokens, voice, options)))
        frames = max(1, int(2 * n / speed))
        assert abs(audio.size - frames * 480) <= 480, (n, audio.size, frames)
        assert np.isfinite(audio).all()


# ---- through the APIs, on both tiny bundles -----------------------------------------------------------
@pytest.fixture(scope="module", params=["v1", "v2"])
def client(request: pytest.FixtureRequest, tiny_bundle: Path, tiny_v2_bundle: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, str]]:  # fmt: skip
    """(client, voice) of the committed tiny v1 bundle (a built-in speaker) or the tiny CosyVoice2 one (a saved voice)."""
    v2 = request.param == "v2"
    settings = Settings(  # type: ignore[call-arg]
        _env_file=None, model_dir=tiny_v2_bundle if v2 else tiny_bundle, intra_op_threads=1, rate_limit_per_minute=0,
        cache_max_bytes=0, grpc_port=0, voices_dir=tmp_path_factory.mktemp("speed-voices"), n_timesteps=2,
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        if not v2:
            yield c, "中文女"
            return
        files = {"audio": (V2_PROMPT.name, V2_PROMPT.read_bytes(), "audio/wav")}
        saved = c.post("/v1/voices", data={"name": V2_VOICE, "transcript": "希望你以后能够做的比我还好呦。"}, files=files)
        assert saved.status_code == 201, saved.text
        yield c, V2_VOICE


def assert_audio(fmt: str, data: bytes) -> None:
    if fmt == "pcm":
        assert len(data) > 0 and len(data) % 2 == 0
        return
    samples, _, _ = pyav_read(data)
    assert samples.size > 0


@pytest.mark.parametrize(("fmt", "stream"), [("mp3", True), ("wav", False), ("pcm", True)])
@pytest.mark.parametrize("speed", OPENAI_SPEEDS)
def test_openai_speech_at_every_speed(client: tuple[TestClient, str], speed: float, fmt: str, stream: bool) -> None:
    """/v1/audio/speech from its lowest to its highest speed: mp3 streamed (OpenAI's default, the reported case),
    wav whole and pcm streamed: 200 with audio."""
    c, voice = client
    body = {"model": "tts-1", "input": TEXT, "voice": voice, "speed": speed, "response_format": fmt, "stream": stream}
    response = c.post("/v1/audio/speech", json=body | {"seed": 3})
    assert response.status_code == 200, response.text
    assert_audio(fmt, response.content)


@pytest.mark.parametrize("fmt", ["opus", "aac", "flac"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_other_formats_at_the_highest_speed(client: tuple[TestClient, str], fmt: str, stream: bool) -> None:
    c, voice = client
    body = {"model": "tts-1", "input": TEXT, "voice": voice, "speed": OPENAI_HIGH, "response_format": fmt, "stream": stream}
    response = c.post("/v1/audio/speech", json=body | {"seed": 5})
    assert response.status_code == 200, response.text
    assert_audio(fmt, response.content)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("speed", TTS_SPEEDS)
def test_tts_at_every_speed(client: tuple[TestClient, str], speed: float, stream: bool) -> None:
    c, voice = client
    body = {"text": TEXT, "speaker": voice, "speed": speed, "format": "mp3", "stream": stream, "seed": 7}
    response = c.post("/tts", json=body)
    assert response.status_code == 200, response.text
    assert_audio("mp3", response.content)
