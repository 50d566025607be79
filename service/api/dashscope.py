"""The DashScope tts_v2 WebSocket protocol (Alibaba Cloud Model Studio's CosyVoice API, as the `dashscope` SDK speaks
it): client messages, server events, error codes, and the run-task parameters read into our speech options.
Protocol description: docs/dashscope.md."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from service.api.textfields import lone_surrogate
from service.audio.encode import AudioFormat
from service.errors import ErrorCode, InvalidInputError, TTSError, UnknownModelError, UnsupportedCapabilityError, wire_name
from service.frontend.incremental import LANGUAGES
from service.served import ServedModel, ServedModels

PATH = "/api-ws/v1/inference"  # the SDK connects to dashscope.base_websocket_api_url itself, which ends so
CLOUD_MODEL = re.compile(r"cosyvoice-v(\d+)(?:\.\d+)?(?:-[a-z0-9]+)*")  # cosyvoice-v1, -v2, -v3-flash, -v3-plus, ...
RATES_HZ = (8000, 16000, 22050, 24000, 44100, 48000)  # pcm, wav and mp3, as the SDK's AudioFormat offers them
OPUS_RATES_HZ = (8000, 16000, 24000, 48000)  # libopus takes no 22,050 or 44,100 Hz
DEFAULT_RATE_HZ = 22050  # the cloud's default (Opus: 24 kHz)
MAX_SDK_SEED = 65535
# domain field -> the protocol's, for errors: `text`, `voice` and `instruction` (run-task parameters) are the domain's
FIELDS: dict[str, str] = {}

# Our error codes as the cloud names them (DashScope's status codes); `header.attributes` carries ours besides.
CLOUD_CODES: dict[ErrorCode, str] = {
    ErrorCode.UNAUTHORIZED: "InvalidApiKey",
    ErrorCode.FORBIDDEN: "AccessDenied",
    ErrorCode.RATE_LIMITED: "Throttling.RateQuota",
    ErrorCode.OVERLOADED: "Throttling",
    ErrorCode.NOT_READY: "Throttling",
    ErrorCode.SHUTTING_DOWN: "Throttling",
    ErrorCode.STORE_UNAVAILABLE: "Throttling",
    ErrorCode.STORAGE_FULL: "InternalError",
    ErrorCode.TEXT_TOO_LONG: "BadRequest.TooLarge",
    ErrorCode.PAYLOAD_TOO_LARGE: "BadRequest.TooLarge",
    ErrorCode.ENGINE_FAILURE: "InternalError",
    ErrorCode.BUNDLE_INVALID: "InternalError",
}
INVALID_PARAMETER = "InvalidParameter"  # every other code: the caller's input


class Header(BaseModel):
    model_config = ConfigDict(extra="allow")
    action: Literal["run-task", "continue-task", "finish-task"]
    task_id: str = Field(min_length=1, max_length=128)
    streaming: str = "duplex"


class Parameters(BaseModel):
    """run-task `payload.parameters`. Unknown keys are allowed (the cloud adds some); these are read."""

    model_config = ConfigDict(extra="allow")
    voice: str = Field(min_length=1, max_length=64)
    format: str = "mp3"
    sample_rate: int = Field(0, ge=0)
    volume: int = Field(50, ge=0, le=100)
    rate: float = Field(1.0, ge=0.5, le=2.0)
    pitch: float = Field(1.0, ge=0.5, le=2.0)
    bit_rate: int | None = Field(None, ge=6, le=510)
    seed: int = Field(0, ge=0, le=MAX_SDK_SEED)
    type: int = 0
    instruction: str | None = Field(None, max_length=512)
    language_hints: list[str] | None = None
    hot_fix: dict[str, Any] | None = None
    word_timestamp_enabled: bool = False
    phoneme_timestamp_enabled: bool = False
    enable_ssml: bool = False
    text_type: str = "PlainText"


class Input(BaseModel):
    model_config = ConfigDict(extra="allow")
    text: str | None = None
    flush: bool = False
    directive: str | None = None


class Payload(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    parameters: Parameters | None = None
    input: Input = Field(default_factory=Input)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    header: Header
    payload: Payload = Field(default_factory=Payload)

    @property
    def task_id(self) -> str:
        return self.header.task_id


MESSAGE: TypeAdapter[Message] = TypeAdapter(Message)


class MessageError(InvalidInputError):
    """A client message that cannot be read; `task_id` is the task it names, when that much could be read."""

    def __init__(self, message: str, *, param: str, task_id: str | None) -> None:
        super().__init__(message, param=param)
        self.task_id = task_id


def parse_message(raw: str | None, max_chars: int) -> Message:
    """One client message (a JSON text frame of at most `max_chars` characters); MessageError naming the field that is
    wrong. Nesting is bounded by pydantic's parser: deeper than 200 levels is a MessageError, never a recursion."""
    if raw is None:
        raise MessageError("messages must be JSON text frames, not binary", param="message", task_id=None)
    if len(raw) > max_chars:
        too_long = f"the message has {len(raw)} characters; the limit is {max_chars} (TTS_MAX_BODY_BYTES)"
        raise MessageError(too_long, param="message", task_id=None)
    try:
        message = MESSAGE.validate_json(raw)
    except ValidationError as e:
        document = _read(raw)
        task_id = _task_id(document)
        surrogate = lone_surrogate(document)  # what pydantic's parser calls "unexpected end of hex escape"
        if surrogate is not None:
            raise MessageError(surrogate.message, param=surrogate.param or "message", task_id=task_id) from e
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "message"
        raise MessageError(f"invalid message: {where}: {first['msg']}", param=where, task_id=task_id) from e
    if message.header.action == "run-task" and message.payload.parameters is None:
        raise MessageError(
            "run-task needs payload.parameters (at least voice)", param="payload.parameters", task_id=message.task_id
        )
    return message


def _read(raw: str) -> Any:
    """A message pydantic refused, read by json.loads, which takes what pydantic's parser does not (a lone surrogate),
    so the failure can be told to its task and said plainly; None when it is no JSON, or nested deeper than json.loads
    recurses (1,000 levels: that was a RecursionError and a 1011 close)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


def _task_id(document: Any) -> str | None:
    """header.task_id of a message that failed validation, if it has one."""
    try:
        value = document["header"]["task_id"]
    except (KeyError, TypeError, IndexError):
        return None
    return value if isinstance(value, str) and 0 < len(value) <= 128 else None


@dataclass(frozen=True)
class TaskOptions:
    """What a run-task asks for, in our terms."""

    fmt: AudioFormat
    sample_rate_hz: int
    bitrate_kbps: int | None  # None: TTS_AUDIO_BITRATE_KBPS
    gain: float  # volume / 50
    speed: float
    seed: int | None
    language: str  # a sentence-end hint for the segmenter
    instruction: str | None


def task_model(model: str | None, served: ServedModels) -> ServedModel:
    """The served model a run-task's `model` names: one of our ids exactly; a cloud name (cosyvoice-vN...) the first
    served model of the family cosyvoiceN, else the first served model; UnknownModelError for anything else."""
    if model is not None:
        chosen = next((m for m in served if m.id == model), None)
        cloud = CLOUD_MODEL.fullmatch(model)
        if chosen is None and cloud is not None:
            chosen = served.of_family(f"cosyvoice{cloud.group(1)}") or served.first
        if chosen is not None:
            return chosen
    ids = ", ".join(repr(i) for i in served.ids)
    raise UnknownModelError(f"Model not exist: {model!r}; use a cosyvoice-v* name or one of {ids}", param="model")


def task_options(p: Parameters) -> TaskOptions:
    """Check a run-task's parameters; raise the TTSError the client gets for the first that cannot be served."""
    if p.pitch != 1.0:
        raise UnsupportedCapabilityError(
            "pitch is not supported by this server (CosyVoice has no pitch control); send 1.0", param="pitch"
        )
    refused = {"hot_fix": p.hot_fix is not None, "word_timestamp_enabled": p.word_timestamp_enabled}
    refused |= {"phoneme_timestamp_enabled": p.phoneme_timestamp_enabled, "type": p.type != 0}
    for name, wanted in refused.items():
        if wanted:
            raise UnsupportedCapabilityError(f"{name} is not supported by this server{_WHY.get(name, '')}", param=name)
    fmt, rate = _format(p.format, p.sample_rate)
    if p.bit_rate is not None and fmt not in (AudioFormat.MP3, AudioFormat.OPUS):
        raise InvalidInputError("bit_rate applies to mp3 and opus only", param="bit_rate")
    hint = (p.language_hints or ["auto"])[0]
    return TaskOptions(
        fmt=fmt,
        sample_rate_hz=rate,
        bitrate_kbps=p.bit_rate,
        gain=p.volume / 50,
        speed=p.rate,
        seed=p.seed or None,  # the SDK sends 0 unless told otherwise: our default sampling
        language=hint if hint in LANGUAGES else "auto",
        instruction=p.instruction,
    )


_WHY = {
    "word_timestamp_enabled": " (sentence times are on every sentence-end: begin_time/end_time)",
    "phoneme_timestamp_enabled": " (sentence times are on every sentence-end: begin_time/end_time)",
    "hot_fix": " (use the pronunciation lexicon: /v1/lexicon)",
}


def _format(name: str, rate: int) -> tuple[AudioFormat, int]:
    """The audio format and rate of a run-task: "Default" (the SDK's unset format) is mp3; rate 0 the default."""
    value = "mp3" if name.lower() == "default" else name.lower()
    if value not in ("pcm", "wav", "mp3", "opus"):
        raise InvalidInputError(f"unsupported format {name!r}; use pcm, wav, mp3 or opus", param="format")
    fmt = AudioFormat(value)
    allowed = OPUS_RATES_HZ if fmt is AudioFormat.OPUS else RATES_HZ
    rate = rate or (24000 if fmt is AudioFormat.OPUS else DEFAULT_RATE_HZ)
    if rate not in allowed:
        raise InvalidInputError(f"sample_rate {rate} is not offered for {value}; use one of {allowed}", param="sample_rate")
    return fmt, rate


# ---- server events ------------------------------------------------------------------------------
def event(task_id: str, name: str, payload: dict[str, Any] | None = None, **header: Any) -> dict[str, Any]:
    return {"header": {"task_id": task_id, "event": name, "attributes": {}, **header}, "payload": payload or {}}


def task_failed(task_id: str, error: TTSError) -> dict[str, Any]:
    """task-failed: the cloud's error code and our message; `attributes` holds our code and the field at fault."""
    failed = event(task_id, "task-failed", error_code=CLOUD_CODES.get(error.code, INVALID_PARAMETER), error_message=error.message)
    failed["header"]["attributes"] = {"code": error.code.value, "param": wire_name(FIELDS, error.param)}
    return failed


def sentence_event(
    task_id: str, kind: str, index: int, text: str, times_ms: dict[str, int], characters: int | None
) -> dict[str, Any]:
    """result-generated with a sentence-begin / sentence-end output (word lists are empty: see docs/dashscope.md)."""
    output = {"sentence": {"index": index, "words": [], **times_ms}, "type": kind, "original_text": text}
    payload: dict[str, Any] = {"output": output}
    if characters is not None:
        payload["usage"] = {"characters": characters}
    return event(task_id, "result-generated", payload)
