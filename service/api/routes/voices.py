"""Saved voices: POST /v1/voices analyses a prompt recording once and stores it under a name; list, get, delete."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, File, Form, Query, Request, UploadFile

from service.api.auth import caller_of
from service.api.deps import ADMIN, AUTHENTICATED, LISTING, StateDep, VoicesDep
from service.api.errors import ERROR_RESPONSES, wire_fields_of
from service.api.routes.common import read_upload
from service.api.textfields import TextRoute
from service.families.model import PromptAudio

FIELDS = {"prompt_audio": "audio"}  # domain field -> this API's, for errors (a transcript error stays prompt_text)
router = APIRouter(prefix="/v1/voices", tags=["voices"], route_class=TextRoute, dependencies=[wire_fields_of(FIELDS)])


# `model` of the listings: whose prompt models `usable` is about
UsableFor = Annotated[str | None, Query(description="A served model's id (GET /v1/models); default the first.")]
SAVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    507: {"description": "The server's storage for saved voices is full", "content": {"application/json": {}}},
}


@router.post("", dependencies=ADMIN, status_code=201, responses=SAVE_RESPONSES, summary="Save a cloned voice")
async def create_voice(
    state: StateDep,
    name: Annotated[str, Form(description="Voice name: 1-64 letters, digits, '-', '_', '.'; used as `speaker` / `voice`.")],
    audio: Annotated[UploadFile, File(description="Prompt recording, 1-30 s (wav, flac, mp3, ogg/opus, m4a).")],
    transcript: Annotated[str, Form(description="Words spoken in the recording; empty = cross-lingual cloning.")] = "",
    model: Annotated[str | None, Form(description="The served model it is for (its prompt models analyse it).")] = None,
) -> dict[str, Any]:
    """Analyse the recording once with `model`'s prompt models (default the first served model; the voice is usable
    by every served model whose prompt models are the same) and store it: in Redis when TTS_REDIS_URL is set (every
    replica sees it), else in TTS_VOICES_DIR. Needs an admin key when keys are on."""
    voices = state.runtime.model_for(model).voices
    prompt = PromptAudio(await read_upload(audio, state.settings.max_upload_bytes, param="audio"))
    saved = await anyio.to_thread.run_sync(lambda: voices.save(name, prompt, transcript))
    return saved.info() | {"usable": True}  # analysed by this model's prompt models just now


@router.get("", dependencies=LISTING, responses=ERROR_RESPONSES, summary="List saved voices")
async def list_voices(request: Request, state: StateDep, model: UsableFor = None) -> dict[str, Any]:
    """Every saved voice with its details (transcript, length, kind; `usable` is false for a voice the prompt models of
    `model` (default the first served) did not analyse, e.g. one saved for a CosyVoice v1 model into a store shared
    with CosyVoice2, and `made_for` names the model it was saved for, empty for voices saved before that was
    recorded). With API keys on, a request without a key (let through while TTS_PUBLIC_MODEL_LIST is on) gets ids,
    names and `usable` only: transcripts are personal data. `can_manage` says whether this caller may save and delete
    voices (an admin key, or no keys configured)."""
    voices = state.runtime.model_for(model).voices
    caller = caller_of(request)
    details = not state.keys.enabled or caller.key is not None  # a key that is sent was checked by LISTING
    found = await anyio.to_thread.run_sync(voices.store.list)
    data = [(v.info() if details else {"id": v.name, "name": v.name}) | {"usable": voices.usable(v)} for v in found]
    return {"object": "list", "data": data, "max_voices": voices.max_voices, "can_manage": state.keys.is_admin(caller)}


@router.get("/{voice_id}", dependencies=AUTHENTICATED, responses=ERROR_RESPONSES, summary="One saved voice")
async def get_voice(voice_id: str, state: StateDep, model: UsableFor = None) -> dict[str, Any]:
    """A voice's details, transcript included (`usable` by `model`, default the first served): needs an API key when
    keys are on."""
    voices = state.runtime.model_for(model).voices
    saved = await anyio.to_thread.run_sync(voices.saved, voice_id)
    return saved.info() | {"usable": voices.usable(saved)}


@router.delete("/{voice_id}", dependencies=ADMIN, status_code=204, responses=ERROR_RESPONSES, summary="Delete a voice")
async def delete_voice(voice_id: str, voices: VoicesDep) -> None:
    await anyio.to_thread.run_sync(voices.delete, voice_id)
