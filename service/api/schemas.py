"""Request and response bodies of the HTTP API, and the documented OpenAI voice/model mapping."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator

from service.audio.encode import AudioFormat
from service.frontend.lexicon import MAX_WORD_CHARS
from service.served import OPENAI_MODEL_ALIASES
from service.settings import OPENAI_VOICES

FORMATS = [f.value for f in AudioFormat]
_FORMAT_ENUM: dict[str, JsonValue] = {"enum": list[JsonValue](FORMATS)}
MAX_SEED = 2**32 - 1
OPENAI_MAX_INPUT_CHARS = 4096
# What the released CosyVoice-300M speakers are (their names are Chinese: 中文女 = "Chinese woman"), for voice lists.
SPEAKER_DESCRIPTIONS = {
    "中文女": "Chinese, female",
    "中文男": "Chinese, male",
    "英文女": "English, female",
    "英文男": "English, male",
    "日语男": "Japanese, male",
    "粤语女": "Cantonese, female",
    "韩语女": "Korean, female",
}


class TTSBody(BaseModel):
    """POST /tts."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="Text to speak (Chinese, English, Japanese, Cantonese, Korean).")
    speaker: str | None = Field(None, description="Speaker or saved voice (GET /v1/audio/voices); default TTS_DEFAULT_SPEAKER.")
    format: str = Field("wav", description="Audio format.", json_schema_extra=_FORMAT_ENUM)
    speed: float = Field(1.0, ge=0.5, le=2.0, allow_inf_nan=False, description="Tempo factor.")
    stream: bool = Field(False, description="Chunked response that starts with the first audio chunk (streaming WAV header).")
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Same seed + same input = same audio.")


class VoiceRef(BaseModel):
    """OpenAI custom-voice object: `{"id": "..."}`."""

    id: str


class SpeechBody(BaseModel):
    """POST /v1/audio/speech (OpenAI's request body)."""

    model_config = ConfigDict(extra="ignore")

    model: str = Field(
        description=f"A served model's id (GET /v1/models), or {', '.join(OPENAI_MODEL_ALIASES)}: the first served model."
    )
    input: str = Field(description=f"Text to speak, at most {OPENAI_MAX_INPUT_CHARS} characters.")
    voice: str | VoiceRef = Field(
        description="A speaker name, a saved voice, or an OpenAI voice name; by default "
        + ", ".join(f"{k}→{v}" for k, v in OPENAI_VOICES.items())
        + " (TTS_VOICE_ALIASES maps them to any speaker or saved voice; GET /v1/audio/voices lists them)."
    )
    response_format: str = Field("mp3", description="mp3, opus, aac, flac, wav or pcm.", json_schema_extra=_FORMAT_ENUM)
    speed: float = Field(1.0, ge=0.25, le=4.0, allow_inf_nan=False)
    instructions: str | None = Field(
        None,
        max_length=OPENAI_MAX_INPUT_CHARS,
        description="Instruct mode on a CosyVoice-300M-Instruct bundle; elsewhere ignored (with a Warning header).",
    )
    stream_format: Literal["audio", "sse"] = Field("audio", description="`sse`: speech.audio.delta / speech.audio.done events.")
    stream: bool | None = Field(
        None,
        description="Extension (not in OpenAI's API): `true` sends audio as it is synthesized (chunked; WAV gets a "
        "streaming header with unknown sizes, FLAC an unknown sample count), `false` sends the whole file with "
        "Content-Length, exact WAV sizes and FLAC's sample count and MD5. Default: WAV and FLAC whole, every other "
        "format streamed. `stream_format=sse` always streams.",
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Extension (not in OpenAI's API): same seed, same audio.")
    timestamps: bool = Field(
        False,
        description="Extension (not in OpenAI's API), with `stream_format=sse` only: a `speech.audio.sentence` event "
        "after each sentence's audio, `{sentence, text, start, end}` with times in seconds of the decoded audio. "
        "Such requests are never answered from the audio cache.",
    )

    @field_validator("voice", mode="before")
    @classmethod
    def _voice_shape(cls, value: object) -> object:
        """One clear error for a voice of the wrong shape (pydantic would report each member of the union)."""
        if isinstance(value, str) or (isinstance(value, dict) and isinstance(value.get("id"), str)):
            return value
        raise ValueError('expected a voice name or an object {"id": "<voice name>"}')

    @property
    def voice_name(self) -> str:
        return self.voice.id if isinstance(self.voice, VoiceRef) else self.voice


class ModelFacts(BaseModel):
    """What a served bundle says about itself (its manifest); an OpenAI alias has the first model's."""

    random_weights: bool = Field(default=False, description="The weights are random: the audio is noise, not speech.")
    test_model: bool = Field(default=False, description="A miniature model for tests and CI, not a released checkpoint.")
    warning: str | None = Field(default=None, description="Set when either flag is true: what that means for a listener.")


class ModelCard(ModelFacts):
    """OpenAI's model object, plus the served bundle's facts (extra fields are allowed in OpenAI's list)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    description: str = Field("", description="The bundle's own one-line description (manifest.json).")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class AudioModel(BaseModel):
    id: str
    name: str


class AudioModelList(BaseModel):
    """GET /v1/audio/models: the TTS models in two shapes at once. Open WebUI reads `models` (`[{"id", "name"}]`);
    OpenAI-style clients read `object` + `data` (model objects, as GET /v1/models)."""

    object: Literal["list"] = "list"
    data: list[ModelCard]
    models: list[AudioModel]


class Voice(BaseModel):
    id: str = Field(description="What to send as `voice` (or `speaker`).")
    name: str = Field(description="For people: a built-in speaker with its language and gender, an alias with its target.")
    alias_of: str | None = Field(default=None, description="OpenAI voice names only: the speaker or saved voice it speaks as.")


class VoiceList(BaseModel):
    voices: list[Voice]


class Health(BaseModel):
    status: Literal["ok"]


class ModelReadiness(BaseModel):
    model: str
    engine: str = Field(description="waiting, loading or loaded while the server loads; then ok or failed.")
    detail: str | None = None


class Readiness(BaseModel):
    status: Literal["ready", "degraded", "not_ready"]
    engine: str
    cache: str
    detail: str | None = None
    models: list[ModelReadiness] | None = Field(
        default=None, description="Each served model's state, when TTS_MODEL_DIR names several (absent otherwise)."
    )


class ModelInfo(ModelFacts):
    """One served model, as GET /info describes it."""

    model: str
    family: str = Field(description="The model family (the manifest's `family`).")
    sample_rate_hz: int
    speakers: list[str]
    openai_voices: dict[str, str]
    capabilities: dict[str, bool]
    instruct_presets: list[str] = Field(default_factory=list, description="Instructions the model was trained with.")
    description: str = ""


class ServiceInfo(ModelFacts):
    """The first (default) model's facts at the top level, every served model in `models`, the server's limits."""

    model: str
    sample_rate_hz: int
    speakers: list[str]
    default_speaker: str
    formats: list[str]
    openai_voices: dict[str, str]
    openai_pcm_sample_rate_hz: int
    max_chars: int
    openai_max_chars: int = Field(description="Longest `input` of /v1/audio/speech (at most 4096, and TTS_MAX_CHARS).")
    audio_bitrate_kbps: int = Field(description="Bitrate of MP3, Opus and AAC output.")
    normalizer: dict[str, str]
    capabilities: dict[str, bool] = Field(
        default_factory=dict,
        description="What the model can voice: `builtin_speakers`, `prompt_analysis` (voice cloning), `instruct`.",
    )
    max_upload_bytes: int = Field(default=0, description="Largest prompt recording upload (TTS_MAX_UPLOAD_BYTES).")
    instruct_presets: list[str] = Field(
        default_factory=list,
        description="Instructions the model was trained with (Fun-CosyVoice3: its 26); any text is taken where the model "
        "takes instructions (`instruct2`).",
    )
    models: list[ModelInfo] = Field(default_factory=list, description="Every served model, the default (first) first.")


MAX_LEXICON_PINYIN_CHARS = 8 * MAX_WORD_CHARS  # the longest syllable (`zhuang1`) plus a separator, per character


class LexiconEntry(BaseModel):
    """One effective pronunciation: a built-in default or an operator entry (which overrides a default)."""

    word: str = Field(description=f"1 to {MAX_WORD_CHARS} Chinese characters.")
    pinyin: str = Field(description="Tone-numbered pinyin (tones 1-5, 5 = neutral), one syllable per character.")
    source: Literal["default", "custom"] = Field(description="`default`: built in; `custom`: set with PUT /v1/lexicon/{word}.")


class LexiconList(BaseModel):
    """GET /v1/lexicon."""

    object: Literal["list"] = "list"
    version: str = Field(description="Opaque; changes on every write (it is part of the audio cache key).")
    data: list[LexiconEntry]


class LexiconWord(LexiconEntry):
    """GET or PUT /v1/lexicon/{word}."""

    object: Literal["lexicon.entry"] = "lexicon.entry"
    version: str = Field(description="The lexicon version after this request.")


class LexiconDeleted(BaseModel):
    """DELETE /v1/lexicon/{word}."""

    object: Literal["lexicon.entry.deleted"] = "lexicon.entry.deleted"
    word: str
    deleted: Literal[True] = True
    version: str = Field(description="The lexicon version after this request.")


class LexiconPut(BaseModel):
    """PUT /v1/lexicon/{word}."""

    model_config = ConfigDict(extra="forbid")

    pinyin: str = Field(
        min_length=1,
        max_length=MAX_LEXICON_PINYIN_CHARS,
        description="One syllable per character of the word, tone numbers 1-5 or tone marks: `chong2 qing4`, `chóng qìng`.",
        examples=["chong2 qing4"],
    )


class NormalizeBody(BaseModel):
    """POST /v1/normalize."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(min_length=1, description=f"Text to normalize, at most {OPENAI_MAX_INPUT_CHARS} characters.")


class NormalizedSentence(BaseModel):
    text: str = Field(description="The sentence as it will be spoken.")
    source: str = Field(description="The text it was read from, as written (markup removed): what its caption shows.")
    ids: list[int] = Field(description="Whisper BPE token ids sent to the engine.")
    tokens: int
    pause_after_s: float = Field(description="Silence inserted after the sentence (SSML breaks, `[pause …]`), seconds.")


class LexiconRewrite(BaseModel):
    word: str
    pinyin: str
    replacement: str = Field(description="Single-reading characters written in place of `word`.")
    start: int = Field(description="Character offset in `normalized`.")
    complete: bool = Field(description="False when some syllable has no single-reading common character.")


class NormalizeResult(BaseModel):
    """GET/POST /v1/normalize: what will be spoken for a text."""

    text: str
    language: str = Field(description="`zh`, `en` or `bypass`.")
    enhanced: bool
    normalized: str = Field(description="The whole normalized text, before sentence splitting.")
    sentences: list[NormalizedSentence]
    rules: list[str] = Field(description="Normalization rules that changed the text.")
    rewrites: list[LexiconRewrite]
    lexicon_version: str
    token_counts: list[int]
    total_tokens: int
    elapsed_ms: float = Field(description="Normalization time (0 when served from the frontend cache).")
    cache_hit: bool
