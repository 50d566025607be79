"""Native synthesis routes: POST /tts (JSON) and POST /tts/prompt (a one-off prompt recording, multipart)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from service.api.deps import JSON_BODY, SYNTHESIS_GUARDS, ServiceDep, StateDep
from service.api.errors import ERROR_RESPONSES, wire_fields_of
from service.api.routes.common import audio_headers, audio_responses, read_upload, submit
from service.api.schemas import MAX_SEED, TTSBody
from service.api.streaming import chunked_response, whole_response
from service.api.textfields import TextRoute
from service.audio.encode import parse_format
from service.families.model import NamedVoice, PromptAudio, PromptVoice
from service.speech.request import SpeechRequest

FIELDS = {"voice": "speaker", "prompt_audio": "prompt_wav"}  # domain field -> this API's, for errors
router = APIRouter(tags=["synthesis"], route_class=TextRoute, dependencies=[wire_fields_of(FIELDS)])


@router.post(
    "/tts",
    dependencies=[*SYNTHESIS_GUARDS, *JSON_BODY],
    response_class=Response,
    responses={**audio_responses(), **ERROR_RESPONSES},
    summary="Synthesize speech (whole file, or a chunked stream with `stream: true`)",
)
async def tts(request: Request, body: TTSBody, service: ServiceDep, state: StateDep) -> Response:
    """`stream=false`: the whole file with Content-Length. `stream=true`: chunked, starting with the first audio chunk.

    `pcm` is raw little-endian int16 mono at the model's rate (22,050 Hz for CosyVoice-300M, 24,000 Hz for
    CosyVoice2; X-Sample-Rate states it); `opus` is Ogg/Opus at 24 kHz.
    Over-long text is a 413 `text_too_long` here (400 on /v1/audio/speech, as OpenAI answers).
    """
    wanted = SpeechRequest(
        text=body.text,
        voice=NamedVoice(body.speaker or state.settings.default_speaker),
        fmt=parse_format(body.format, "format"),
        speed=body.speed,
        seed=body.seed,
        engine_stream=body.stream,
        chunked=body.stream,
        bitrate_kbps=state.settings.audio_bitrate_kbps,
        max_chars=state.settings.max_chars,
    )
    job = await submit(service, wanted)
    respond = chunked_response if body.stream else whole_response
    return await respond(request, job, state, audio_headers(job))


@router.post(
    "/tts/prompt",
    dependencies=SYNTHESIS_GUARDS,
    response_class=Response,
    responses={**audio_responses(), **ERROR_RESPONSES},
    summary="Synthesize in the voice of a one-off prompt recording (also: POST /tts with a multipart body)",
)
async def tts_with_prompt(
    request: Request,
    service: ServiceDep,
    state: StateDep,
    text: Annotated[str, Form(description="Text to speak.")],
    prompt_wav: Annotated[UploadFile, File(description="Prompt recording, 1-30 s (wav, flac, mp3, ogg/opus, m4a).")],
    prompt_text: Annotated[str, Form(description="Words spoken in the prompt; empty = cross-lingual cloning.")] = "",
    format: Annotated[str, Form(description="Audio format.")] = "wav",
    speed: Annotated[float, Form(ge=0.5, le=2.0, allow_inf_nan=False, description="Tempo factor.")] = 1.0,
    stream: Annotated[bool, Form(description="Chunked response from the first audio chunk.")] = False,
    seed: Annotated[int | None, Form(ge=0, le=MAX_SEED, description="Same seed + same input = same audio.")] = None,
) -> Response:
    """`/tts` with a voice cloned from an uploaded recording for this request only (nothing is stored; the
    analysis is cached by the recording's hash). Save a voice with POST /v1/voices to reuse it by name."""
    prompt = PromptAudio(await read_upload(prompt_wav, state.settings.max_upload_bytes))
    wanted = SpeechRequest(
        text=text,
        voice=PromptVoice(prompt, prompt_text),  # analysed (or its analysis read from the cache) in `submit`
        fmt=parse_format(format, "format"),
        speed=speed,
        seed=seed,
        engine_stream=stream,
        chunked=stream,
        bitrate_kbps=state.settings.audio_bitrate_kbps,
        max_chars=state.settings.max_chars,
    )
    job = await submit(service, wanted)
    respond = chunked_response if stream else whole_response
    return await respond(request, job, state, audio_headers(job))
