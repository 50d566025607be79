"""400 messages say what the client sent wrong in the client's terms: no FFmpeg errno text, no pydantic or FastAPI type
names, no protocol class names, no framework locations (`body.`, `query.`). HTTP and the WebSocket, in process."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from service.api import create_app
from service.settings import Settings

# What leaked before: FFmpeg's errno text, FastAPI's UploadFile check, pydantic union members and class names.
INTERNALS = ("Errno", "<none>", "<class", "UploadFile", "Value error", "TextMessage", "ControlMessage", "VoiceRef", "body.",
             "query.", "voice.str", "Not Found", "Method Not Allowed")  # fmt: skip


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


def error(resp: Any, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err: dict[str, Any] = resp.json()["error"]
    leaked = [word for word in INTERNALS if word in err["message"] or word in str(err["param"])]
    assert not leaked, f"{leaked} in {err}"
    return err


def test_an_upload_that_is_not_audio(client: TestClient) -> None:
    """Was `prompt audio is not a readable audio file: [Errno 1094995529] Invalid data found ... '<none>'`."""
    files = {"audio": ("notes.wav", b"these are my notes, not a recording" * 20, "audio/wav")}
    err = error(client.post("/v1/voices", data={"name": "notes"}, files=files))
    assert err["param"] == "audio" and "not a recording in a format" in err["message"] and "WAV" in err["message"]


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/voices", "audio"), ("/tts/prompt", "prompt_wav"), ("/inference_zero_shot", "prompt_wav")]
)
def test_a_recording_sent_as_a_text_field(client: TestClient, path: str, field: str) -> None:
    """Was `Value error, Expected UploadFile, received: <class 'str'>`."""
    data = {"name": "x", "text": "你好。", "tts_text": "你好。", "prompt_text": "你好。", field: "voice.wav"}
    err = error(client.post(path, data=data))
    assert err["param"] == field and f"{field} must be a file upload" in err["message"], err


@pytest.mark.parametrize("voice", [{"name": "alloy"}, 3, ["alloy"]])
def test_a_voice_of_the_wrong_shape(client: TestClient, voice: object) -> None:
    """Was `body.voice.str: Input should be a valid string; body.voice.VoiceRef.id: Field required` (param voice.str)."""
    err = error(client.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "voice": voice}))
    assert (
        err["param"] == "voice"
        and err["message"] == 'invalid request: voice: expected a voice name or an object {"id": "<voice name>"}'
    )


@pytest.mark.parametrize(
    ("kwargs", "param", "message"),
    [
        ({"json": {"text": 5}}, "text", "invalid request: text: Input should be a valid string"),
        ({"json": ["hi"]}, None, "invalid request: the request body must be a JSON object"),
        ({"content": b"", "headers": {"content-type": "application/json"}}, None, "invalid request: the request body is empty"),
        ({"content": b'{"text": "hi", "speed": NaN}', "headers": {"content-type": "application/json"}}, "speed", "finite number"),
    ],
    ids=["text-type", "array", "empty", "nan-speed"],
)
def test_json_body_messages(client: TestClient, kwargs: dict[str, Any], param: str | None, message: str) -> None:
    err = error(client.post("/tts", **kwargs))
    assert err["param"] == param and message in err["message"], err


def test_a_missing_query_parameter(client: TestClient) -> None:
    err = error(client.get("/v1/normalize"))
    assert err == {
        "message": "invalid request: text: Field required",
        "type": "invalid_request_error",
        "param": "text",
        "code": "invalid_input",
    }


def test_unknown_paths_and_methods_say_what_was_asked(client: TestClient) -> None:
    assert "no /v1/speech" in error(client.get("/v1/speech"), 404)["message"]
    assert error(client.put("/tts"), 405)["message"] == "PUT is not allowed on /tts; use POST"


def test_a_malformed_multipart_body(client: TestClient) -> None:
    err = error(client.post("/tts/prompt", content=b"x", headers={"content-type": "multipart/form-data"}))
    assert err["message"].startswith("the multipart/form-data body is malformed"), err


def ws_error(client: TestClient, *messages: object) -> dict[str, Any]:
    """The error event a WebSocket session ends with, after a good config and `messages`."""
    with client.websocket_connect("/v1/audio/speech/stream") as ws:
        ws.send_text(json.dumps({"type": "config"}))
        assert ws.receive_json()["type"] == "ready"
        for m in messages:
            ws.send_text(m if isinstance(m, str) else json.dumps(m))
        event = ws.receive_json()
        with pytest.raises(WebSocketDisconnect) as closed:
            ws.receive_json()
    assert event["type"] == "error" and closed.value.code == 4400, event
    err: dict[str, Any] = event["error"]
    leaked = [word for word in INTERNALS if word in err["message"] or word in str(err["param"])]
    assert not leaked, f"{leaked} in {err}"
    return err


@pytest.mark.parametrize(
    ("message", "param", "text"),
    [
        (
            {"type": "speak", "text": "hi"},
            "type",
            "unknown message type 'speak'; this message must be one of: text, flush, close",
        ),
        ({"text": "hi"}, "type", 'the message has no "type"; this message must be one of: text, flush, close'),
        ({"type": "text"}, "text", "invalid text message: text: Field required"),
        ({"type": "flush", "text": "x"}, "text", "invalid flush message: text: Extra inputs are not permitted"),
        ("[1, 2]", "message", "the message must be a JSON object"),
        ("{oops", "message", "the message is not valid JSON"),
    ],
    ids=["unknown-type", "no-type", "no-text", "flush-with-text", "array", "not-json"],
)
def test_websocket_messages_name_the_protocol_fields(client: TestClient, message: object, param: str, text: str) -> None:
    """Was `invalid message: TextMessage.type: Input should be 'text'` with param `TextMessage.type`."""
    err = ws_error(client, message)
    assert err["param"] == param and err["message"].startswith(text), err
