"""Typed domain errors with stable codes; the API maps codes to HTTP status in one table."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum


class ErrorCode(StrEnum):
    """Closed set of error codes. The string values are part of the public API."""

    INVALID_INPUT = "invalid_input"
    INVALID_AUDIO = "invalid_audio"
    TEXT_TOO_LONG = "text_too_long"
    EMPTY_TEXT = "empty_text"
    UNKNOWN_SPEAKER = "unknown_speaker"
    UNSUPPORTED_FORMAT = "unsupported_format"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UNKNOWN_MODEL = "unknown_model"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    NOT_READY = "not_ready"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    REQUEST_TIMEOUT = "request_timeout"
    UNSUPPORTED_CAPABILITY = "unsupported_capability"
    VOICE_EXISTS = "voice_exists"
    TOO_MANY_VOICES = "too_many_voices"
    STORE_UNAVAILABLE = "store_unavailable"
    STORAGE_FULL = "storage_full"
    BUNDLE_INVALID = "bundle_invalid"
    ENGINE_FAILURE = "engine_failure"


class TTSError(Exception):
    """Base class: every error the service raises on purpose carries a code and a message."""

    code: ErrorCode = ErrorCode.ENGINE_FAILURE

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@contextmanager
def wire_fields(names: Mapping[str, str]) -> Iterator[None]:
    """A TTSError raised inside names its field as the transport's wire does: `names` maps domain field names
    ("text", "voice", "prompt_audio", "prompt_text", "instruction") to the transport's; others pass unchanged."""
    try:
        yield
    except TTSError as e:
        e.param = wire_name(names, e.param)
        raise


def wire_name(names: Mapping[str, str], param: str | None) -> str | None:
    """`param` as the transport names it (`names`: domain field -> wire field)."""
    return names.get(param, param) if param is not None else None


class InvalidInputError(TTSError):
    code = ErrorCode.INVALID_INPUT


class EmptyTextError(TTSError):
    code = ErrorCode.EMPTY_TEXT


class TextTooLongError(TTSError):
    code = ErrorCode.TEXT_TOO_LONG


class UnknownSpeakerError(TTSError):
    code = ErrorCode.UNKNOWN_SPEAKER


class UnsupportedFormatError(TTSError):
    code = ErrorCode.UNSUPPORTED_FORMAT


class UnsupportedMediaTypeError(TTSError):
    """The request body is not in the media type the endpoint reads (e.g. a form body sent to a JSON endpoint)."""

    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class UnknownModelError(TTSError):
    code = ErrorCode.UNKNOWN_MODEL


class UnauthorizedError(TTSError):
    code = ErrorCode.UNAUTHORIZED


class ForbiddenError(TTSError):
    code = ErrorCode.FORBIDDEN


class NotFoundError(TTSError):
    code = ErrorCode.NOT_FOUND


class RateLimitedError(TTSError):
    code = ErrorCode.RATE_LIMITED

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class OverloadedError(TTSError):
    code = ErrorCode.OVERLOADED

    def __init__(self, message: str, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDownError(TTSError):
    code = ErrorCode.SHUTTING_DOWN


class NotReadyError(TTSError):
    code = ErrorCode.NOT_READY


class PayloadTooLargeError(TTSError):
    """An upload (prompt audio) larger than the upload limit."""

    code = ErrorCode.PAYLOAD_TOO_LARGE


class RequestTimeoutError(TTSError):
    """The client did not send in time: a request body that did not finish arriving (TTS_BODY_TIMEOUT_S), a WebSocket
    session with nothing to say for TTS_WS_IDLE_TIMEOUT_S."""

    code = ErrorCode.REQUEST_TIMEOUT


class UnsupportedCapabilityError(TTSError):
    """The served model cannot do this (e.g. voice cloning without its prompt models, instruct on a non-Instruct
    model); the message names the missing capability."""

    code = ErrorCode.UNSUPPORTED_CAPABILITY


class VoiceExistsError(TTSError):
    code = ErrorCode.VOICE_EXISTS


class TooManyVoicesError(TTSError):
    code = ErrorCode.TOO_MANY_VOICES


class StoreUnavailableError(TTSError):
    """A store (Redis, the voices directory) cannot be used now. `retry_after_s`: when a retry may succeed (Redis
    restarting); None for a fault that does not clear by itself (a directory the server may not write)."""

    code = ErrorCode.STORE_UNAVAILABLE

    def __init__(self, message: str, *, retry_after_s: int | None = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class StorageFullError(TTSError):
    """The server's storage for what a request saves (the voices directory's disk, Redis at its memory limit) is full:
    no retry helps until an operator frees space, so no retry hint is given."""

    code = ErrorCode.STORAGE_FULL


class SettingError(InvalidInputError):
    """A setting the loaded model's family cannot honour, found at start (never by a request): `param` names the
    setting's field (RuntimeOptions / Settings, e.g. "first_hop_tokens"); the entry point names the variable or the
    engine lever."""


class BundleError(TTSError):
    """The model bundle is missing, incomplete, or inconsistent."""

    code = ErrorCode.BUNDLE_INVALID


class EngineError(TTSError):
    """Inference failed for a reason that is not the caller's fault."""

    code = ErrorCode.ENGINE_FAILURE


class PromptAudioProblem(StrEnum):
    """Why a voice-cloning prompt recording was refused; the values are stable (`PromptAudioError.reason`)."""

    EMPTY = "empty"
    NOT_AUDIO = "not_audio"
    CORRUPT = "corrupt"
    TRUNCATED = "truncated"
    SILENT = "silent"
    TOO_SHORT = "too_short"
    TOO_LONG = "too_long"
    SAMPLE_RATE = "sample_rate"


class PromptAudioError(InvalidInputError):
    """Prompt audio that cannot be used (a format not accepted, undecodable, silent, too short or long, unusable
    sample rate): code `invalid_audio` (the caller's fault, HTTP 400); `reason` says which rule refused it.
    """

    code = ErrorCode.INVALID_AUDIO

    def __init__(self, message: str, *, reason: PromptAudioProblem, param: str | None = "prompt_audio") -> None:
        super().__init__(message, param=param)
        self.reason = reason
