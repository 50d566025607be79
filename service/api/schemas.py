"""Request and response bodies of the HTTP API, and the documented OpenAI voice/model mapping."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from service.audio import AudioFormat

FORMATS = [f.value for f in AudioFormat]
_FORMAT_ENUM: dict[str, JsonValue] = {"enum": list[JsonValue](FORMATS)}
MAX_SEED = 2**32 - 1
OPENAI_MAX_INPUT_CHARS = 4096
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")

# OpenAI voice name -> our speaker. CosyVoice-300M-SFT has one English woman and one English man, so the
# OpenAI voices map by their usual perceived gender; our own speaker names are accepted as they are.
OPENAI_VOICES: dict[str, str] = {
    "alloy": "英文女",
    "coral": "英文女",
    "nova": "英文女",
    "sage": "英文女",
    "shimmer": "英文女",
    "marin": "英文女",
    "ash": "英文男",
    "ballad": "英文男",
    "echo": "英文男",
    "fable": "英文男",
    "onyx": "英文男",
    "verse": "英文男",
    "cedar": "英文男",
}


class TTSBody(BaseModel):
    """POST /tts."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="Text to speak (Chinese, English, Japanese, Cantonese, Korean).")
    speaker: str | None = Field(None, description="Speaker name (GET /v1/audio/voices); default 中文女 (TTS_DEFAULT_SPEAKER).")
    format: str = Field("wav", description="Audio format.", json_schema_extra=_FORMAT_ENUM)
    speed: float = Field(1.0, ge=0.5, le=2.0, description="Tempo factor.")
    stream: bool = Field(False, description="Chunked response that starts with the first audio chunk (streaming WAV header).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed + same input = same audio.")


class VoiceRef(BaseModel):
    """OpenAI custom-voice object: `{"id": "..."}`."""

    id: str


class SpeechBody(BaseModel):
    """POST /v1/audio/speech (OpenAI's request body)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(description=f"{', '.join(OPENAI_MODEL_ALIASES)}, or this server's model id (GET /v1/models).")
    input: str = Field(description=f"Text to speak, at most {OPENAI_MAX_INPUT_CHARS} characters.")
    voice: str | VoiceRef = Field(
        description="A speaker name, or an OpenAI voice: " + ", ".join(f"{k}→{v}" for k, v in OPENAI_VOICES.items()) + "."
    )
    response_format: str = Field("mp3", description="mp3, opus, aac, flac, wav or pcm.", json_schema_extra=_FORMAT_ENUM)
    speed: float = Field(1.0, ge=0.25, le=4.0)
    instructions: str | None = Field(
        None, max_length=OPENAI_MAX_INPUT_CHARS, description="Accepted and ignored: this model has no instruction control."
    )
    stream_format: Literal["audio", "sse"] = Field("audio", description="`sse`: speech.audio.delta / speech.audio.done events.")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Extension (not in OpenAI's API): same seed, same audio.")

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Voice(BaseModel):
    id: str
    name: str


class VoiceList(BaseModel):
    voices: list[Voice]


class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ready", "degraded", "not_ready"]
    engine: str
    cache: str
    detail: str | None = None


class ServiceInfo(BaseModel):
    model: str
    sample_rate_hz: int
    speakers: list[str]
    default_speaker: str
    formats: list[str]
    openai_voices: dict[str, str]
    openai_pcm_sample_rate_hz: int
    max_chars: int
    normalizer: dict[str, str]
