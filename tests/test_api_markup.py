"""SSML and pinyin markup over HTTP: what cannot be honoured is a 400 naming the element, `<prosody rate>` over the
whole text is the request's speed, `<sub>` reads its alias (the frontend tests cover the readings themselves)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api import create_app
from service.settings import Settings

SPEECH = {"model": "tts-1", "voice": "alloy", "response_format": "pcm", "stream": False, "seed": 17}


@pytest.fixture(scope="module")
def client(tiny_bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    settings = Settings(
        _env_file=None,
        model_dir=tiny_bundle,
        intra_op_threads=1,
        rate_limit_per_minute=0,
        voices_dir=tmp_path_factory.mktemp("voices"),
    )
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('<phoneme alphabet="py" ph="chong2">重</phoneme>庆', "<phoneme>"),
        ('<prosody pitch="high">你好。</prosody>', "<prosody pitch>"),
        ('你好，<prosody rate="slow">世界</prosody>。', "<prosody rate> must cover all the text"),
        ("重庆[chong9]到了。", "chong9"),
    ],
)
def test_markup_that_cannot_be_honoured_is_a_400_naming_it(client: TestClient, text: str, named: str) -> None:
    for path, body in (("/v1/audio/speech", SPEECH | {"input": text}), ("/tts", {"text": text})):
        resp = client.post(path, json=body)
        error = resp.json()["error"]
        assert resp.status_code == 400 and error["code"] == "invalid_input" and named in error["message"], resp.text


def test_prosody_rate_over_the_whole_text_is_the_speed(client: TestClient) -> None:
    """x-fast (2x) over everything reads as speed 2: the same audio as the plain text at speed 2, shorter than at 1."""
    marked = client.post(
        "/v1/audio/speech", json=SPEECH | {"input": '<speak><prosody rate="x-fast">你好，世界。</prosody></speak>'}
    )
    fast = client.post("/v1/audio/speech", json=SPEECH | {"input": "你好，世界。", "speed": 2.0})
    normal = client.post("/v1/audio/speech", json=SPEECH | {"input": "你好，世界。"})
    assert marked.status_code == fast.status_code == normal.status_code == 200
    assert marked.content == fast.content
    assert len(marked.content) == pytest.approx(len(normal.content) / 2, rel=0.05)


def test_prosody_rate_times_speed_must_stay_in_range(client: TestClient) -> None:
    resp = client.post("/v1/audio/speech", json=SPEECH | {"input": '<prosody rate="x-fast">你好。</prosody>', "speed": 4.0})
    assert resp.status_code == 400 and "must be within 0.25..4" in resp.json()["error"]["message"]


def test_sub_reads_its_alias(client: TestClient) -> None:
    marked = client.post("/v1/audio/speech", json=SPEECH | {"input": '<sub alias="世界贸易组织">WTO</sub>成立了。'})
    plain = client.post("/v1/audio/speech", json=SPEECH | {"input": "世界贸易组织成立了。"})
    assert marked.status_code == 200 and marked.content == plain.content
