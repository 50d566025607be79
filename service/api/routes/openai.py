"""OpenAI-compatible routes: POST /v1/audio/speech, GET /v1/models, /v1/audio/models, /v1/audio/voices."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from service.api.deps import JSON_BODY, LISTING, SYNTHESIS_GUARDS, AppState, StateDep
from service.api.errors import ERROR_RESPONSES, wire_fields_of
from service.api.routes.common import (
    INSTRUCTIONS_WARNING,
    audio_headers,
    audio_responses,
    bundle_facts,
    job_headers,
    openai_max_chars,
    submit,
)
from service.api.schemas import (
    SPEAKER_DESCRIPTIONS,
    AudioModel,
    AudioModelList,
    ModelCard,
    ModelList,
    SpeechBody,
    Voice,
    VoiceList,
)
from service.api.streaming import chunked_response, sse_response, whole_response
from service.api.textfields import TextRoute
from service.audio.encode import AudioFormat, parse_format
from service.errors import InvalidInputError, NotFoundError
from service.families.model import InstructVoice, NamedVoice, VoiceReference
from service.served import OPENAI_MODEL_ALIASES, ServedModel
from service.speech.request import SpeechRequest

FIELDS = {"text": "input", "voice": "voice", "instruction": "instructions"}  # domain field -> OpenAI's, for errors
router = APIRouter(prefix="/v1", tags=["openai"], route_class=TextRoute, dependencies=[wire_fields_of(FIELDS)])
OWNER = "cosyvoice-lite"


def openai_voice(name: str, instructions: str | None, can_instruct: bool) -> VoiceReference:
    """On an Instruct bundle, `instructions` drive instruct mode (the voice's flow, the instructions before the
    text); elsewhere the voice is the name alone (the response then says the instructions were ignored)."""
    if not instructions or not can_instruct:
        return NamedVoice(name)
    text = instructions if "<|endofprompt|>" in instructions else instructions.rstrip() + "<|endofprompt|>"
    return InstructVoice(name, text)


# `model` of the voice listings: which served model's voices (built-in speakers, usable saved voices, aliases)
ListedModel = Annotated[str | None, Query(description="A served model's id (GET /v1/models); default the first served model.")]


# Formats whose header states the length only when the whole file is written before it is sent (WAV's sizes, FLAC's
# sample count): a file client (soundfile, `wave`) reads them by that length, so they are whole unless asked otherwise.
WHOLE_BY_DEFAULT = (AudioFormat.WAV, AudioFormat.FLAC)


def streamed(body: SpeechBody, fmt: AudioFormat) -> bool:
    """Chunked unless the caller says `stream: false`; WAV and FLAC default to the whole file (exact lengths)."""
    if body.stream_format == "sse":
        return True
    return body.stream if body.stream is not None else fmt not in WHOLE_BY_DEFAULT


@router.post(
    "/audio/speech",
    dependencies=[*SYNTHESIS_GUARDS, *JSON_BODY],
    response_class=Response,
    responses={**audio_responses(), **ERROR_RESPONSES},
    summary="OpenAI text-to-speech (streamed, except WAV and FLAC; `stream_format=sse` for events)",
)
async def speech(request: Request, body: SpeechBody, state: StateDep) -> Response:
    """OpenAI's contract; `model` chooses among the served models (an OpenAI model name means the first; another name
    is a 400 `unknown_model` naming the served ones). `pcm` is int16 mono at TTS_OPENAI_PCM_SAMPLE_RATE_HZ (24,000 Hz
    by default, as OpenAI clients assume: CosyVoice-300M's 22,050 Hz resampled, CosyVoice2's 24,000 Hz as it is);
    `voice` may name a saved voice; `instructions` drive instruct mode on an Instruct bundle and instruct2 on
    CosyVoice2, and are ignored (with a Warning header) elsewhere.
    Over-long `input` is a 400 `text_too_long`, as OpenAI answers."""
    served = state.runtime.model_for(body.model)
    service, voices = served.service, served.voices
    fmt = parse_format(body.response_format, "response_format")
    if body.timestamps and body.stream_format != "sse":
        raise InvalidInputError("timestamps need stream_format 'sse' (they are events beside the audio)", param="timestamps")
    chunked = streamed(body, fmt)
    instruct = bool(body.instructions) and voices.can_instruct
    wanted = SpeechRequest(
        text=body.input,
        # a speaker, a saved voice or an OpenAI name (an alias): the service resolves it
        voice=openai_voice(body.voice_name, body.instructions, voices.can_instruct),
        fmt=fmt,
        speed=body.speed,
        seed=body.seed,
        engine_stream=chunked,
        chunked=chunked,
        pcm_rate_hz=state.settings.openai_pcm_sample_rate_hz,
        bitrate_kbps=state.settings.audio_bitrate_kbps,
        max_chars=openai_max_chars(state),
        timestamps=body.timestamps,
    )
    job = await submit(service, wanted)
    warning = {"Warning": INSTRUCTIONS_WARNING} if body.instructions and not instruct else {}
    if body.stream_format == "sse":
        rate = served.bundle.constants.token_rate_hz  # the usage's speech tokens
        return await sse_response(request, job, state, job_headers(job) | warning, rate)
    respond = chunked_response if chunked else whole_response
    return await respond(request, job, state, audio_headers(job) | warning)


@router.get("/models", dependencies=LISTING, response_model=ModelList, summary="Models (our ids plus OpenAI aliases)")
async def list_models(state: StateDep) -> ModelList:
    """Readable without an API key while TTS_PUBLIC_MODEL_LIST is on. Every served model, then the OpenAI aliases
    (which mean the first); each entry carries its bundle's `random_weights` / `test_model` flags."""
    return ModelList(data=model_cards(state))


@router.get("/models/{model_id}", dependencies=LISTING, response_model=ModelCard, responses=ERROR_RESPONSES)
async def get_model(model_id: str, state: StateDep) -> ModelCard:
    for card in model_cards(state):
        if card.id == model_id:
            return card
    raise NotFoundError(f"the model {model_id!r} does not exist", param="model")


@router.get("/audio/models", dependencies=LISTING, response_model=AudioModelList, summary="TTS models (Open WebUI reads this)")
async def list_audio_models(state: StateDep) -> AudioModelList:
    """The same models as GET /v1/models, as `data` (OpenAI list) and as `models` (`[{"id", "name"}]`, Open WebUI)."""
    cards = model_cards(state)
    return AudioModelList(data=cards, models=[AudioModel(id=c.id, name=c.id) for c in cards])


@router.get(
    "/audio/voices",
    dependencies=LISTING,
    response_model=VoiceList,
    response_model_exclude_none=True,
    summary="Speakers (Open WebUI reads this)",
)
async def list_voices(state: StateDep, model: ListedModel = None) -> VoiceList:
    """Built-in speakers (named with their language and gender), saved voices this model (`model`, default the
    first served) can speak, then the OpenAI voice names with what each speaks as (`alias_of`: the defaults and
    TTS_VOICE_ALIASES)."""
    served = state.runtime.model_for(model)
    service, voices = served.service, served.voices
    saved = await anyio.to_thread.run_sync(voices.store.list)
    builtin = [Voice(id=s, name=f"{s} — {SPEAKER_DESCRIPTIONS[s]}" if s in SPEAKER_DESCRIPTIONS else s) for s in service.speakers]
    aliases = [Voice(id=a, name=f"{a} → {t}", alias_of=t) for a, t in service.aliases.items()]
    usable = [Voice(id=v.name, name=v.name) for v in saved if voices.usable(v)]  # not those another model analysed
    return VoiceList(voices=[*builtin, *usable, *aliases])


def model_cards(state: AppState) -> list[ModelCard]:
    """Every served model, then the OpenAI aliases with the first model's facts (only the aliases while loading)."""
    models = state.runtime.loaded_models
    cards = [_card(m.id, m) for m in models or ()]
    return cards + [_card(alias, models.first if models else None) for alias in OPENAI_MODEL_ALIASES]


def _card(model_id: str, served: ServedModel | None) -> ModelCard:
    """The model object of `model_id`, served by `served` (None: no model is loaded yet)."""
    facts = bundle_facts(served.bundle if served else None).model_dump()
    description = served.bundle.manifest.description if served else ""
    created = served.created if served else 0
    return ModelCard(id=model_id, created=created, owned_by=OWNER, description=description, **facts)
