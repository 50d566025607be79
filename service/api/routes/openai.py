"""OpenAI-compatible routes: POST /v1/audio/speech, GET /v1/models, GET /v1/audio/voices."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from service.api.deps import AUTHENTICATED, SYNTHESIS_GUARDS, AppState, ServiceDep, StateDep
from service.api.errors import ERROR_RESPONSES
from service.api.routes.common import INSTRUCTIONS_WARNING, audio_responses, job_headers, submit
from service.api.schemas import (
    OPENAI_MAX_INPUT_CHARS,
    OPENAI_MODEL_ALIASES,
    OPENAI_VOICES,
    ModelCard,
    ModelList,
    SpeechBody,
    Voice,
    VoiceList,
)
from service.api.streaming import chunked_response, sse_response
from service.audio import parse_format
from service.errors import UnknownModelError, UnknownSpeakerError
from service.tts import SpeechRequest

router = APIRouter(prefix="/v1", tags=["openai"])
OWNER = "cosyvoice-lite"


def resolve_voice(voice: str, speakers: list[str]) -> str:
    """Our speaker for `voice`: a speaker name as is, else the documented OpenAI voice mapping."""
    if voice in speakers:
        return voice
    mapped = OPENAI_VOICES.get(voice.lower())
    if mapped in speakers:
        return mapped  # type: ignore[return-value]
    known = ", ".join(speakers + [v for v, s in OPENAI_VOICES.items() if s in speakers])
    raise UnknownSpeakerError(f"unknown voice {voice!r}; use one of {known}", param="voice")


def model_ids(state: AppState) -> list[str]:
    return [state.model_id, *OPENAI_MODEL_ALIASES]


@router.post(
    "/audio/speech",
    dependencies=SYNTHESIS_GUARDS,
    response_class=Response,
    responses={**audio_responses(), **ERROR_RESPONSES},
    summary="OpenAI text-to-speech (always streamed; `stream_format=sse` for events)",
)
async def speech(request: Request, body: SpeechBody, service: ServiceDep, state: StateDep) -> Response:
    """OpenAI's contract. `pcm` is int16 mono at TTS_OPENAI_PCM_SAMPLE_RATE_HZ (24,000 Hz by default,
    resampled from the model's 22,050 Hz, as OpenAI clients assume); `instructions` is ignored."""
    if body.model not in model_ids(state):
        raise UnknownModelError(
            f"the model {body.model!r} does not exist; use one of {', '.join(model_ids(state))}", param="model"
        )
    wanted = SpeechRequest(
        text=body.input,
        speaker=resolve_voice(body.voice_name, service.speakers),
        fmt=parse_format(body.response_format, "response_format"),
        speed=body.speed,
        seed=body.seed,
        engine_stream=True,
        chunked=True,
        pcm_rate_hz=state.settings.openai_pcm_sample_rate_hz,
        max_chars=min(OPENAI_MAX_INPUT_CHARS, state.settings.max_chars),
        text_param="input",
        speaker_param="voice",
    )
    job = await submit(service, wanted)
    headers = job_headers(job) | ({"Warning": INSTRUCTIONS_WARNING} if body.instructions else {})
    if body.stream_format == "sse":
        return await sse_response(request, job, state, headers)
    return await chunked_response(request, job, state, headers)


@router.get("/models", dependencies=AUTHENTICATED, response_model=ModelList, summary="Models (our id plus OpenAI aliases)")
async def list_models(state: StateDep) -> ModelList:
    created = _created(state)
    return ModelList(data=[ModelCard(id=m, created=created, owned_by=OWNER) for m in model_ids(state) if m])


@router.get("/models/{model_id}", dependencies=AUTHENTICATED, response_model=ModelCard, responses=ERROR_RESPONSES)
async def get_model(model_id: str, state: StateDep) -> ModelCard:
    if model_id not in model_ids(state):
        raise UnknownModelError(f"the model {model_id!r} does not exist", param="model")
    return ModelCard(id=model_id, created=_created(state), owned_by=OWNER)


@router.get("/audio/voices", dependencies=AUTHENTICATED, response_model=VoiceList, summary="Speakers (Open WebUI reads this)")
async def list_voices(service: ServiceDep) -> VoiceList:
    return VoiceList(voices=[Voice(id=s, name=s) for s in service.speakers])


def _created(state: AppState) -> int:
    """Unix time the bundle's manifest was written (OpenAI's `created`)."""
    if state.bundle is None:
        return 0
    return int((state.bundle.root / "manifest.json").stat().st_mtime)
