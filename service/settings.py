"""Service settings: one typed, bounded object read from TTS_* environment variables (and .env)."""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from service.levers import LEVERS, EngineProfile, parse_profile

ENV_PREFIX = "TTS_"
MiB = 1 << 20
MAX_VOICE_NAME_CHARS = 64

# OpenAI voice name -> the built-in speaker it speaks as unless TTS_VOICE_ALIASES says otherwise. CosyVoice-300M-SFT
# has one English woman and one English man, so the OpenAI voices map by their usual perceived gender.
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


def _split_csv(value: object) -> object:
    """Accept `a,b,c` from the environment (and plain lists from code)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


def parse_bytes(text: str) -> int | None:
    """`2G`, `512M`, `64K` or a plain number of bytes (binary multiples); empty: None. ValueError for anything else."""
    cleaned = text.strip().upper().removesuffix("B").removesuffix("I")
    if not cleaned:
        return None
    scale = 1 << (10 * "KMGT".index(cleaned[-1]) + 10) if cleaned[-1] in "KMGT" else 1
    number = cleaned[:-1] if scale > 1 else cleaned
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (bytes, or a number with K, M or G: 2G, 512M)") from None
    return int(value * scale)


def _split_pairs(value: object) -> object:
    """Accept `a=x,b=y` from the environment (and plain dicts from code); names are case-insensitive."""
    if not isinstance(value, str):
        return value
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, sep, target = (x.strip() for x in part.partition("="))
        if not sep or not name or not target:
            raise ValueError(f"{part!r} is not a name=voice pair (e.g. alloy=my-voice)")
        if name.lower() in pairs:
            raise ValueError(f"{name!r} is given twice")
        pairs[name.lower()] = target
    return pairs


class Settings(BaseSettings):
    """Everything the service can be configured with. Read only by the app factory and the entry point."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_file=".env", extra="ignore", frozen=True, populate_by_name=True)

    # server
    host: str = Field(default="127.0.0.1", description="Address `python -m service.api` binds to.")
    port: int = Field(default=8000, ge=1, le=65535, description="TCP port `python -m service.api` listens on.")
    grpc_port: int = Field(
        default=50000,
        ge=0,
        le=65535,
        description="TCP port of the gRPC service (the official CosyVoice proto, health and reflection), served by the "
        "same process and on the same address as HTTP; 50000 like the official server; 0 = off.",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(default="info", description="Log level of the service.")
    drain_timeout_s: int = Field(
        default=10,
        ge=1,
        le=600,
        description="After SIGTERM, seconds in-flight work gets to finish while new work is refused, one deadline for "
        "HTTP, gRPC and WebSocket sessions (which finish their sentence and close with 1001); what still runs then is "
        "ended (503 shutting_down) and the process exits. Keep the orchestrator's grace period (Kubernetes "
        "terminationGracePeriodSeconds, `docker stop -t`) above it plus any preStop delay and a few seconds.",
    )

    # model and engine
    engine_profile: Annotated[EngineProfile, NoDecode] = Field(
        default_factory=EngineProfile,
        description="The engine's levers (threads per stage, batching, chunk schedule, prompt window, cache budget, "
        "runtimes and kernels, flow steps): `lever=value` pairs, e.g. `first_hop_tokens=10,stream_schedule=official`, "
        "or `@/path/profile.toml`; empty = the defaults. docs/engine-profile.md lists every lever.",
    )
    model_dir: Path = Field(
        default=Path("models/tiny"),
        description="Model bundle directory (manifest.json, graphs, speakers), or several separated by commas "
        "(`models/a,models/b`: one server serves them all, each under its manifest's model id; the first is the default "
        "model, the one the official endpoints and requests that name no model use).",
    )
    verify_bundle_hashes: bool = Field(default=False, description="Check every bundle file's sha256 at start (slower start).")
    intra_op_threads: int = Field(
        default=2,
        ge=1,
        le=64,
        description="CPU threads of each ONNX Runtime session (set it to the cores you give the process); with the "
        "engine lever max_batch = 0 every concurrent request runs its own sessions: keep TTS_CONCURRENT_REQUESTS x this "
        "<= cores.",
    )
    default_speaker: str = Field(
        default="中文女",
        min_length=1,
        max_length=64,
        description="Voice used when a request names none: a built-in speaker, or a saved voice. A model with built-in "
        "speakers refuses to start on a name that is neither; one without (like CosyVoice2-0.5B) starts and refuses "
        "such requests until a voice of this name is saved.",
    )
    voice_aliases: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=dict,
        description="Comma-separated `openai-name=voice` pairs, e.g. `alloy=my-voice,nova=中文女`: the built-in speaker "
        "or saved voice an OpenAI voice name speaks as, on every transport (for clients that accept only OpenAI "
        "names); names not given keep their default where the model has that built-in speaker (alloy, coral, nova, "
        "sage, shimmer, marin → 英文女; ash, ballad, echo, fable, onyx, verse, cedar → 英文男: CosyVoice-300M-SFT) and "
        "have no voice elsewhere (CosyVoice2 has no built-in speakers: map them to saved voices). A target that is "
        "neither a built-in speaker nor a saved voice at start is logged as a warning (the voice may be saved later).",
    )
    warmup_text: str = Field(
        default="你好。", min_length=1, max_length=200, description="Text synthesized at start and by /readyz probes."
    )

    # concurrency and limits
    concurrent_requests: int = Field(
        default=8,
        ge=1,
        le=256,
        validation_alias=AliasChoices("TTS_CONCURRENT_REQUESTS", "TTS_WORKERS"),
        description="Requests synthesized at the same time (one thread each). With the engine lever max_batch > 0 (the default) "
        "their LLM steps are batched on one scheduler thread and their flow/HiFT calls take turns at "
        "the engine lever acoustic_slots, so this is not a thread budget: CPU threads are set by TTS_INTRA_OP_THREADS. "
        "TTS_WORKERS is the old name and still read.",
    )
    queue_max: int = Field(
        default=8, ge=0, le=1024, description="Requests allowed to wait for a synthesis slot; beyond this: 503 at once."
    )
    retry_after_s: int = Field(default=2, ge=1, le=3600, description="Retry-After sent with 503 when the queue is full.")
    admission: Literal["realtime", "count"] = Field(
        default="realtime",
        description="When a synthesis request starts: 'realtime' = only while the engine's measured speed (audio seconds "
        "it makes per second) covers every running stream and one more with a margin, so streams already playing never "
        "stall for a new one (the new one waits in the queue: its first audio comes later); before anything is measured "
        "as 'count'; 'count' = while fewer than TTS_CONCURRENT_REQUESTS run. Either way within the memory budget "
        "(TTS_MEMORY_LIMIT) and, when the queue is full, 503 overloaded with Retry-After.",
    )
    memory_limit: Annotated[int | None, NoDecode] = Field(
        default=None,
        ge=1,
        description="Memory the server may use, in bytes or with a K, M or G suffix (`2G`); empty = its cgroup's limit "
        "(a container's) or the machine's RAM, whichever is smaller. The server admits a request only while what it may "
        "hold (its worst case: docs/memory.md) fits in what this leaves after the loaded models and a headroom; the "
        "others wait in the queue or get 503 with Retry-After, never an out-of-memory kill. The start-up log states each "
        "model's per-stream worst case and how many streams fit.",
    )
    max_speech_s: float = Field(
        default=1200.0,
        ge=1.0,
        le=86_400.0,
        description="Seconds of speech one request may make (counted in the model's speech tokens, so at speed 1): "
        "each sentence's LLM stops at what is left. A text whose least speech (the model's 2 speech tokens per text "
        "token) is over it gets 413 text_too_long at once; one whose speech reaches it ends with that error (a stream "
        "is cut off). Bounds a request's work.",
    )
    max_sentence_speech_s: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        description="Seconds of speech one sentence may make, below the model's own bound (20 speech tokens per text "
        "token: 160 s for a 200-token sentence on CosyVoice2). A sentence that reaches it ends the request with 413 "
        "text_too_long (add punctuation). Bounds the memory of one stream: its flow caches and full-attention pass "
        "grow with the sentence (docs/architecture.md).",
    )
    max_upload_bytes: int = Field(
        default=10 * MiB,
        ge=64 * 1024,
        le=256 * MiB,
        description="Largest multipart upload (a voice prompt recording); beyond: 413 payload_too_large. Text bodies keep "
        "TTS_MAX_BODY_BYTES.",
    )
    max_chars: int = Field(
        default=4096, ge=1, le=100_000, description="Longest accepted text in characters (/v1 never exceeds 4096)."
    )
    max_body_bytes: int = Field(
        default=65_536,
        ge=1024,
        le=16 * MiB,
        description="Largest accepted request body; beyond: 413. Also the longest DashScope WebSocket message, in characters.",
    )
    body_timeout_s: float = Field(
        default=60.0,
        ge=0.1,
        le=3600.0,
        description="Seconds a request body may take to arrive in full (from when the app starts reading it); beyond: "
        "408 request_timeout and the connection is closed. A synthesis request takes its place of capacity only once "
        "its body is in, so slow senders never hold one.",
    )
    ws_idle_timeout_s: float = Field(
        default=120.0,
        ge=0.1,
        le=86_400.0,
        description="A WebSocket session (/v1/audio/speech/stream, DashScope) that sends no message for this long while "
        "none of its text is being spoken is closed with 4408 request_timeout; an idle session holds no place of capacity.",
    )
    ready_probe_interval_s: float = Field(
        default=30.0, ge=0.0, le=3600.0, description="/readyz re-runs a real inference when none succeeded for this long."
    )
    openai_pcm_sample_rate_hz: Literal[22050, 24000] = Field(
        default=24000,
        description="Rate of `pcm` on /v1/audio/speech (OpenAI clients assume 24 kHz; a 22,050 Hz v1 model is resampled, "
        "CosyVoice2 is 24 kHz already); /tts pcm stays at the model's rate.",
    )
    audio_bitrate_kbps: int = Field(
        default=64,
        ge=16,
        le=160,
        description="Bitrate of MP3, Opus and AAC output in kbit/s (part of the audio cache key). MP3 at 22,050 Hz "
        "tops out at 160; the AAC encoder caps mono 22,050 Hz near 100.",
    )

    # cache
    redis_url: SecretStr | None = Field(
        default=None, description="redis://… for the shared audio cache and rate-limit counters; empty = in-process."
    )
    cache_max_bytes: int = Field(
        default=64 * MiB, ge=0, le=16_384 * MiB, description="In-process audio cache size; 0 disables it."
    )
    cache_ttl_s: int = Field(default=86_400, ge=1, le=30 * 86_400, description="Lifetime of a Redis audio cache entry.")

    # voices
    cache_dir: Path | None = Field(
        default=Path("~/.cache/cosyvoice-lite"),
        description="Where compiled graphs are kept between starts (OpenVINO's model cache: faster starts, less "
        "memory); `~` is the user's home; empty = none. Unwritable: a warning at start, and no cache.",
    )
    openvino_shape_cache_entries: int = Field(
        default=256,
        ge=0,
        le=100_000,
        description="Executors OpenVINO keeps per acoustic graph for input shapes it has seen (least recently used "
        "dropped first); every chunk length is a shape, so OpenVINO's own default (5000) grew the process by gigabytes; "
        "0 = rebuild them at every new shape (less memory, slower chunks).",
    )
    voices_dir: Path = Field(
        default=Path("data/voices"),
        description="Directory of saved voices when TTS_REDIS_URL is empty (created if missing; survives restarts). "
        "With Redis, saved voices live there and every replica shares them.",
    )
    max_voices: int = Field(default=100, ge=1, le=10_000, description="Saved voices allowed in the store; beyond: 409.")

    # access control
    api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated API keys (8+ characters each); empty, with TTS_ADMIN_API_KEYS empty too = no "
        "authentication.",
    )
    admin_api_keys: Annotated[list[SecretStr], NoDecode] = Field(
        default_factory=list,
        description="Comma-separated admin keys (8+ characters each): accepted wherever a key is, and needed for saving "
        "and deleting voices and lexicon writes. Admin keys alone turn authentication on for every protected route.",
    )
    rate_limit_per_minute: int = Field(
        default=120, ge=0, le=1_000_000, description="Synthesis requests per minute per API key, else per client IP; 0 = off."
    )
    trusted_proxies: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated proxy IPs/CIDRs whose X-Forwarded-For is believed."
    )
    cors_allow_origins: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Comma-separated origins allowed by CORS; empty = same origin only."
    )
    public_model_list: bool = Field(
        default=True,
        description="GET /v1/models, /v1/models/{id}, /v1/audio/models and /v1/audio/voices answer without an API key "
        "(Open WebUI lists them without one), and GET /v1/voices lists saved voices' ids and names (their details, "
        "transcripts included, need a key); a wrong key still gets 401, and synthesis always needs a key.",
    )

    @model_validator(mode="before")
    @classmethod
    def _levers_from_code(cls, data: object) -> object:
        """Levers given by name (code and tests: `Settings(max_batch=0)`) go into the engine profile; the environment
        sets them only through TTS_ENGINE_PROFILE."""
        if not isinstance(data, dict) or not any(k in LEVERS for k in data):
            return data
        rest = {k: v for k, v in data.items() if k not in LEVERS}
        profile = parse_profile(rest.get("engine_profile", {}))
        levers = profile.model_dump() if isinstance(profile, EngineProfile) else dict(profile)  # type: ignore[call-overload]
        return rest | {"engine_profile": levers | {k: v for k, v in data.items() if k in LEVERS}}

    @field_validator("engine_profile", mode="before")
    @classmethod
    def _profile(cls, value: object) -> object:
        return parse_profile(value)

    @field_validator("api_keys", "admin_api_keys", "trusted_proxies", "cors_allow_origins", mode="before")
    @classmethod
    def _csv(cls, value: object) -> object:
        return _split_csv(value)

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _keys_not_blank(cls, value: list[SecretStr]) -> list[SecretStr]:
        if any(len(k.get_secret_value()) < 8 for k in value):
            raise ValueError("every API key needs at least 8 characters")
        return value

    @field_validator("voice_aliases", mode="before")
    @classmethod
    def _pairs(cls, value: object) -> object:
        return _split_pairs(value)

    @field_validator("voice_aliases")
    @classmethod
    def _openai_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name, target in value.items():
            if name.lower() not in OPENAI_VOICES:
                raise ValueError(f"{name!r} is not an OpenAI voice name (one of {', '.join(OPENAI_VOICES)})")
            if target.lower() in OPENAI_VOICES or len(target) > MAX_VOICE_NAME_CHARS:
                raise ValueError(f"{name}={target}: the target must be a built-in speaker or a saved voice's name")
        return {name.lower(): target for name, target in value.items()}

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, value: list[str]) -> list[str]:
        for item in value:
            ipaddress.ip_network(item, strict=False)  # raises ValueError with a clear message
        return value

    @field_validator("model_dir")
    @classmethod
    def _bundle_list(cls, value: Path) -> Path:
        if any(not part.strip() for part in str(value).split(",")):
            raise ValueError("an empty bundle directory in the comma-separated list")
        return value

    @property
    def model_dirs(self) -> tuple[Path, ...]:
        """The bundle directories TTS_MODEL_DIR names, in its order (the first is the default model)."""
        return tuple(Path(part.strip()) for part in str(self.model_dir).split(","))

    @field_validator("cache_dir", mode="before")
    @classmethod
    def _empty_dir_is_none(cls, value: object) -> object:
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("memory_limit", mode="before")
    @classmethod
    def _bytes(cls, value: object) -> object:
        return parse_bytes(value) if isinstance(value, str) else value

    @field_validator("redis_url", mode="before")
    @classmethod
    def _empty_is_none(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("openai_pcm_sample_rate_hz", mode="before")
    @classmethod
    def _rate_from_env(cls, value: object) -> object:
        return int(value) if isinstance(value, str) and value.strip().isdigit() else value


RENAMED = {"TTS_WORKERS": "TTS_CONCURRENT_REQUESTS"}  # old name -> new name; the old one is still read


def unknown_env_vars(environ: Mapping[str, str]) -> list[str]:
    """TTS_* variables that match no setting (typos); the entry point and app factory log them. A lever set as its own
    variable is not among them: `moved_levers` names those, and the entry point refuses them."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields} | set(RENAMED) | set(_LEVER_VARS)
    return sorted(k for k in environ if k.upper().startswith(ENV_PREFIX) and k.upper() not in known)


_LEVER_VARS = {ENV_PREFIX + name.upper(): name for name in LEVERS}


def moved_levers(environ: Mapping[str, str]) -> list[str]:
    """What to tell an operator who sets an engine lever as a variable of its own (TTS_FIRST_HOP_TOKENS=10): the lever
    is read from TTS_ENGINE_PROFILE only (`first_hop_tokens=10`)."""
    found = [(var, _LEVER_VARS[var.upper()]) for var in sorted(environ) if var.upper() in _LEVER_VARS]
    return [f"{var} is an engine lever: set TTS_ENGINE_PROFILE={lever}={environ[var]}" for var, lever in found]
