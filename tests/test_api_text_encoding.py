"""Request text that is not UTF-8 is a 400 `invalid_input` naming the field, on every HTTP text field (multipart and
urlencoded forms, JSON bodies, query strings); nothing is stored or spoken from mojibake. gRPC and the WebSocket are
tested with their real servers (tests/test_grpc.py, tests/test_ws_stream.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from service.api import create_app
from service.api.textfields import TextRoute, json_encoding_error, parse_urlencoded
from service.errors import InvalidInputError
from service.settings import Settings

TRANSCRIPT = "希望你以后能够做的比我还好呦。"
GBK = TRANSCRIPT.encode("gbk")  # b"\xcf\xa3\xcd\xfb...": "希" happens to be valid UTF-8 ("ϣ"), "望" is not
FORM = {"content-type": "application/x-www-form-urlencoded"}


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


@pytest.fixture(scope="module")
def prompt_wav(ref_dir: Path) -> bytes:
    return (ref_dir / "prompts" / "zh_16k.wav").read_bytes()


def invalid_input(resp: Any, param: str | None) -> str:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_input" and error["param"] == param, error
    assert "UTF-8" in error["message"] and "0xCD at offset 2" in error["message"], error
    return str(error["message"])


def test_a_gbk_transcript_saves_no_voice(client: TestClient, prompt_wav: bytes) -> None:
    """It was saved with the transcript 'Ï£ÍûÄã...' (201)."""
    files = {"audio": ("prompt.wav", prompt_wav, "audio/wav"), "transcript": (None, GBK)}
    message = invalid_input(client.post("/v1/voices", data={"name": "gbk"}, files=files), "transcript")
    assert "form field 'transcript'" in message
    assert client.get("/v1/voices").json()["data"] == []


@pytest.mark.parametrize(
    ("path", "text_field", "prompt_field"),
    [
        ("/tts/prompt", "text", "prompt_text"),
        ("/tts", "text", "prompt_text"),
        ("/inference_zero_shot", "tts_text", "prompt_text"),
    ],
)
def test_a_gbk_prompt_text_is_refused(
    client: TestClient, prompt_wav: bytes, path: str, text_field: str, prompt_field: str
) -> None:
    files = {"prompt_wav": ("p.wav", prompt_wav, "audio/wav"), text_field: (None, "你好。".encode()), prompt_field: (None, GBK)}
    invalid_input(client.post(path, files=files), prompt_field)


def test_a_gbk_text_field_is_refused(client: TestClient, prompt_wav: bytes) -> None:
    files = {"prompt_wav": ("p.wav", prompt_wav, "audio/wav"), "tts_text": (None, GBK)}
    invalid_input(client.post("/inference_cross_lingual", files=files), "tts_text")


def test_a_declared_charset_is_honoured_and_an_unknown_one_refused(client: TestClient, prompt_wav: bytes) -> None:
    """A multipart body may say its text is GBK (Content-Type: ...; charset=gbk): then it is read as GBK."""
    boundary = "b0undary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="text"\r\n\r\n'.encode() + "你好。".encode("gbk"),
        f'--{boundary}\r\nContent-Disposition: form-data; name="prompt_text"\r\n\r\n'.encode() + GBK,
        f'--{boundary}\r\nContent-Disposition: form-data; name="format"\r\n\r\npcm'.encode(),
        f'--{boundary}\r\nContent-Disposition: form-data; name="prompt_wav"; filename="p.wav"\r\n'
        f"Content-Type: audio/wav\r\n\r\n".encode()
        + prompt_wav,
    ]
    body = b"\r\n".join(parts) + f"\r\n--{boundary}--\r\n".encode()
    declared = client.post(
        "/tts/prompt", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}; charset=gbk"}
    )
    assert declared.status_code == 200, declared.text
    unknown = client.post(
        "/tts/prompt", content=body, headers={"content-type": f"multipart/form-data; boundary={boundary}; charset=klingon"}
    )
    assert unknown.status_code == 400 and "klingon" in unknown.json()["error"]["message"]


def test_urlencoded_forms_are_strict_utf8_and_take_raw_utf8(client: TestClient) -> None:
    """The official client urlencodes (%XX); curl -d sends UTF-8 unescaped, which was read as Latin-1 mojibake."""
    escaped = b"tts_text=%CF%A3%CD%FB&spk_id=%E4%B8%AD%E6%96%87%E5%A5%B3"
    invalid_input(client.post("/inference_sft", content=escaped, headers=FORM), "tts_text")
    raw_gbk = b"spk_id=" + "中文女".encode() + b"&tts_text=" + GBK
    invalid_input(client.post("/inference_sft", content=raw_gbk, headers=FORM), "tts_text")
    raw_utf8 = "tts_text=你好。&spk_id=中文女".encode()
    resp = client.post("/inference_sft", content=raw_utf8, headers=FORM)
    assert resp.status_code == 200 and len(resp.content) > 1000, resp.text


def test_query_strings_are_strict_utf8(client: TestClient) -> None:
    """Query values were read with U+FFFD in place of the bad bytes."""
    message = invalid_input(client.get("/v1/normalize?text=%CF%A3%CD%FB"), "text")
    assert "query parameter 'text'" in message
    assert client.get("/v1/normalize?text=%E4%BD%A0%E5%A5%BD").json()["text"] == "你好"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tts", b'{"speaker": "x", "text": "\xcf\xa3\xcd\xfb"}', "text"),
        ("/v1/audio/speech", b'{"model": "tts-1", "voice": "alloy", "input": "\xcf\xa3\xcd\xfb"}', "input"),
        ("/v1/normalize", b'{"text": "\xcf\xa3\xcd\xfb"}', "text"),
    ],
)
def test_json_bodies_that_are_not_utf8_name_the_field(client: TestClient, path: str, body: bytes, param: str) -> None:
    """Was a 400 'There was an error parsing the body' that said neither what nor where."""
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == "invalid_input", error
    assert "not valid UTF-8" in error["message"] and f"in the value of '{param}'" in error["message"], error


def test_every_http_route_reads_text_strictly(client: TestClient) -> None:
    routes = [r for r in client.app.routes if isinstance(r, APIRoute)]  # type: ignore[attr-defined]
    assert routes and all(isinstance(r, TextRoute) for r in routes), [r.path for r in routes if not isinstance(r, TextRoute)]


def test_parse_urlencoded() -> None:
    assert parse_urlencoded(b"a=1&b=%E4%BD%A0+x&&c") == [("a", "1"), ("b", "你 x"), ("c", "")]
    with pytest.raises(InvalidInputError) as info:
        parse_urlencoded(b"ok=1&t=%FF", "query parameter")
    assert info.value.param == "t" and "query parameter 't'" in info.value.message and "0xFF at offset 0" in info.value.message
    with pytest.raises(InvalidInputError):
        parse_urlencoded(b"a=1&b=2&c=3", max_fields=2)


def test_naming_the_json_field_stays_linear_on_adversarial_bodies() -> None:
    """The key search looks at most 4 KiB back, with a pattern of bounded repetition: a 1 MB body of near-keys costs
    the same as a short one (budget as in tests/test_frontend_redos.py)."""
    for seed in (b'"a', b'"' + b"a" * 63, b'"a":', b'"\\', b'":"'):
        body = (seed * (1_000_000 // len(seed) + 1))[:1_000_000] + b"\xff"
        start = time.perf_counter()
        error = json_encoding_error(body, len(body) - 1)
        assert time.perf_counter() - start < 1.5 and "offset 1000000" in error.message


SURROGATE_CASES = [
    ("/tts", b'{"text": "hi", "speaker": "\\ud800"}', "speaker"),
    ("/tts", b'{"text": "\\ud800hi"}', "text"),
    ("/v1/audio/speech", b'{"model": "tts-1", "input": "hi", "voice": "a\\uDC00"}', "voice"),
    ("/v1/audio/speech", b'{"model": "tts-1", "input": "hi", "voice": {"id": "\\ud800"}}', "voice"),
    ("/v1/audio/speech", b'{"model": "tts-1", "input": "hi", "voice": "alloy", "instructions": "\\ud800"}', "instructions"),
    ("/v1/normalize", b'{"text": "x\\ud800"}', "text"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES, ids=[f"{p}:{f}" for p, _, f in SURROGATE_CASES])
def test_a_lone_surrogate_in_a_json_field_is_a_400_naming_it(client: TestClient, path: str, body: bytes, param: str) -> None:
    """`"\\ud800"` is valid JSON that json.loads keeps as half a character: as a speaker or voice it reached the voice
    store's file name and was a 500 (UnicodeEncodeError); now every JSON route refuses it where the body is read."""
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_input" and error["param"] == param, error
    assert "lone surrogate" in error["message"] and "UTF-8" in error["message"], error


def test_a_surrogate_pair_is_one_character_and_passes(client: TestClient) -> None:
    """The check is for halves only: an escaped pair (an emoji as JSON writers escape it) is one character."""
    body = b'{"text": "\\u4f60\\u597d\\ud83d\\ude00"}'
    resp = client.post("/v1/normalize", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == 200 and resp.json()["text"] == "你好\U0001f600", resp.text


def test_a_lone_surrogate_in_a_form_or_query_is_a_400(client: TestClient) -> None:
    """Form fields and query strings are strict UTF-8 (a surrogate's bytes, ED A0 80, are not UTF-8)."""
    form = client.post("/inference_sft", content=b"tts_text=hi&spk_id=%ED%A0%80", headers=FORM)
    assert form.status_code == 400 and form.json()["error"]["param"] == "spk_id", form.text
    query = client.get("/v1/normalize?text=%ED%A0%80")
    assert query.status_code == 400 and query.json()["error"]["param"] == "text", query.text
