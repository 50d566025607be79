"""Saved voices: POST /v1/voices analyses a prompt recording once and stores it under a name; list, get, delete."""

from __future__ import annotations

from typing import Annotated, Any

import anyio
from fastapi import APIRouter, File, Form, Request, UploadFile

from service.api.auth import caller_of
from service.api.deps import ADMIN, AUTHENTICATED, LISTING, StateDep, VoicesDep
from service.api.errors import ERROR_RESPONSES, wire_fields_of
from service.api.routes.common import read_upload
from service.api.textfields import TextRoute
from service.families.model import PromptAudio

FIELDS = {"prompt_audio": "audio"}  # domain field -> this API's, for errors (a transcript error stays prompt_text)
router = APIRouter(prefix="/v1/voices", tags=["voices"], route_class=TextRoute, dependencies=[wire_fields_of(FIELDS)])


SAVE_RESPONSES: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    507: {"description": "The server's storage for saved voices is full", "content": {"application/json": {}}},
}


@router.post("", dependencies=ADMIN, status_code=201, responses=SAVE_RESPONSES, summary="Save a cloned voice")
async def create_voice(
    state: StateDep,
    voices: VoicesDep,
    name: Annotated[str, Form(description="Voice name: 1-64 letters, digits, '-', '_', '.'; used as `speaker` / `voice`.")],
    audio: Annotated[UploadFile, File(description="Prompt recording, 1-30 s (wav, flac, mp3, ogg/opus, m4a).")],
    transcript: Annotated[str, Form(description="Words spoken in the recording; empty = cross-lingual cloning.")] = "",
) -> dict[str, Any]:
    """Analyse the recording once (speaker vector, speech tokens, prompt mel) and store it: in Redis when
    TTS_REDIS_URL is set (every replica sees it), else in TTS_VOICES_DIR. Needs an admin key when keys are on."""
    prompt = PromptAudio(await read_upload(audio, state.settings.max_upload_bytes, param="audio"))
    saved = await anyio.to_thread.run_sync(lambda: voices.save(name, prompt, transcript))
    return saved.info() | {"usable": True}  # analysed by this model's prompt models just now


@router.get("", dependencies=LISTING, responses=ERROR_RESPONSES, summary="List saved voices")
async def list_voices(request: Request, state: StateDep, voices: VoicesDep) -> dict[str, Any]:
    """Every saved voice with its details (transcript, length, kind; `usable` is false for a voice the served model's
    prompt models did not analyse, e.g. one a CosyVoice v1 server saved into a store shared with CosyVoice2, and
    `made_for` names the model it was saved for, empty for voices saved before that was recorded). With API
    keys on, a request without a key (let through while TTS_PUBLIC_MODEL_LIST is on) gets ids, names and `usable`
    only: transcripts are personal data. `can_manage` says whether this caller may save and delete voices (an admin key, or
    no keys configured)."""
    caller = caller_of(request)
    details = not state.keys.enabled or caller.key is not None  # a key that is sent was checked by LISTING
    found = await anyio.to_thread.run_sync(voices.store.list)
    data = [(v.info() if details else {"id": v.name, "name": v.name}) | {"usable": voices.usable(v)} for v in found]
    return {"object": "list", "data": data, "max_voices": voices.max_voices, "can_manage": state.keys.is_admin(caller)}


@router.get("/{voice_id}", dependencies=AUTHENTICATED, responses=ERROR_RESPONSES, summary="One saved voice")
async def get_voice(voice_id: str, voices: VoicesDep) -> dict[str, Any]:
    """A voice's details, transcript included: needs an API key when keys are on."""
    saved = await anyio.to_thread.run_sync(voices.saved, voice_id)
    return saved.info() | {"usable": voices.usable(saved)}


@router.delete("/{voice_id}", dependencies=ADMIN, status_code=204, responses=ERROR_RESPONSES, summary="Delete a voice")
async def delete_voice(voice_id: str, voices: VoicesDep) -> None:
    await anyio.to_thread.run_sync(voices.delete, voice_id)
