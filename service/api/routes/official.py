"""The official CosyVoice servers' endpoints (sft, zero-shot, cross-lingual, instruct, instruct2), wire-compatible: GET
or POST with form fields and a multipart `prompt_wav`, raw int16 mono PCM at the model's rate out (22,050 Hz for v1,
24,000 Hz for CosyVoice2), one piece per sentence."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response

from service.api.deps import SYNTHESIS_GUARDS, ServiceDep, StateDep
from service.api.errors import ERROR_RESPONSES, wire_fields_of
from service.api.routes.common import audio_headers, audio_responses, read_upload, submit
from service.api.streaming import chunked_response
from service.api.textfields import TextRoute
from service.audio.encode import AudioFormat
from service.errors import UnsupportedCapabilityError
from service.families.model import InstructVoice, NamedVoice, PromptAudio, PromptVoice, VoiceReference
from service.speech.request import SpeechRequest

# domain field -> the official API's form field, for errors (the official server's names)
FIELDS = {"text": "tts_text", "voice": "spk_id", "prompt_audio": "prompt_wav", "instruction": "instruct_text"}
router = APIRouter(tags=["official CosyVoice API"], route_class=TextRoute, dependencies=[wire_fields_of(FIELDS)])

_ROUTE = {
    "dependencies": SYNTHESIS_GUARDS,
    "response_class": Response,
    "responses": {**audio_responses(), **ERROR_RESPONSES},
}
TtsText = Annotated[str, Form(description="Text to speak.")]
PromptWav = Annotated[UploadFile, File(description="Prompt recording (wav, flac, mp3, ogg/opus, m4a; 1-30 s).")]


async def _pcm_response(request: Request, service: ServiceDep, state: StateDep, text: str, voice: VoiceReference) -> Response:
    """Raw int16 mono PCM at the model's rate, one piece per sentence (the official servers' reply). The voice is
    resolved with the text, in a worker thread (saved voices, prompt analysis and instructions are blocking work)."""
    wanted = SpeechRequest(text, voice, fmt=AudioFormat.PCM, chunked=True, max_chars=state.settings.max_chars)
    job = await submit(service, wanted)
    return await chunked_response(request, job, state, audio_headers(job))


@router.get("/inference_sft", operation_id="inference_sft_get", **_ROUTE)  # type: ignore[arg-type]
@router.post("/inference_sft", operation_id="inference_sft_post", **_ROUTE)  # type: ignore[arg-type]
async def inference_sft(
    tts_text: TtsText,
    spk_id: Annotated[str, Form(description="A built-in speaker or a saved voice (GET /v1/audio/voices).")],
    request: Request,
    service: ServiceDep,
    state: StateDep,
) -> Response:
    """Like the official `runtime/python/fastapi/server.py`: GET or POST with a form body (the official
    `client.py` sends GET with `data=`), audio sent sentence by sentence as raw int16 mono PCM."""
    return await _pcm_response(request, service, state, tts_text, NamedVoice(spk_id))


@router.get("/inference_zero_shot", operation_id="inference_zero_shot_get", **_ROUTE)  # type: ignore[arg-type]
@router.post("/inference_zero_shot", operation_id="inference_zero_shot_post", **_ROUTE)  # type: ignore[arg-type]
async def inference_zero_shot(
    tts_text: TtsText,
    prompt_text: Annotated[str, Form(description="The words spoken in the prompt recording.")],
    prompt_wav: PromptWav,
    request: Request,
    service: ServiceDep,
    state: StateDep,
) -> Response:
    """Clone the prompt's voice (official `inference_zero_shot`): the LLM sees the prompt text and prompt tokens."""
    prompt = PromptAudio(await read_upload(prompt_wav, state.settings.max_upload_bytes))
    return await _pcm_response(request, service, state, tts_text, PromptVoice(prompt, prompt_text, "zero-shot prompt"))


@router.get("/inference_cross_lingual", operation_id="inference_cross_lingual_get", **_ROUTE)  # type: ignore[arg-type]
@router.post("/inference_cross_lingual", operation_id="inference_cross_lingual_post", **_ROUTE)  # type: ignore[arg-type]
async def inference_cross_lingual(
    tts_text: TtsText, prompt_wav: PromptWav, request: Request, service: ServiceDep, state: StateDep
) -> Response:
    """Speak `tts_text` (often in another language, e.g. `<|en|>Hello.`) in the prompt's voice (official
    `inference_cross_lingual`): the LLM sees only the speaker vector, the flow the prompt tokens and mel."""
    prompt = PromptAudio(await read_upload(prompt_wav, state.settings.max_upload_bytes))
    return await _pcm_response(request, service, state, tts_text, PromptVoice(prompt, "", "cross-lingual prompt"))


@router.get("/inference_instruct", operation_id="inference_instruct_get", **_ROUTE)  # type: ignore[arg-type]
@router.post("/inference_instruct", operation_id="inference_instruct_post", **_ROUTE)  # type: ignore[arg-type]
async def inference_instruct(
    tts_text: TtsText,
    spk_id: Annotated[str, Form(description="Built-in speaker (CosyVoice-300M-Instruct) or saved voice (CosyVoice2).")],
    instruct_text: Annotated[str, Form(description="How to speak, e.g. `A calm narrator.<|endofprompt|>`.")],
    request: Request,
    service: ServiceDep,
    state: StateDep,
) -> Response:
    """CosyVoice-300M-Instruct (official `inference_instruct`): a built-in speaker, styled by `instruct_text`."""
    return await _pcm_response(request, service, state, tts_text, InstructVoice(spk_id, instruct_text))


@router.get("/inference_instruct2", operation_id="inference_instruct2_get", **_ROUTE)  # type: ignore[arg-type]
@router.post("/inference_instruct2", operation_id="inference_instruct2_post", **_ROUTE)  # type: ignore[arg-type]
async def inference_instruct2(
    tts_text: TtsText,
    instruct_text: Annotated[str, Form(description="How to speak, e.g. `用四川话说这句话<|endofprompt|>`.")],
    prompt_wav: PromptWav,
    request: Request,
    service: ServiceDep,
    state: StateDep,
) -> Response:
    """CosyVoice2 (official `inference_instruct2`): the prompt's voice, styled by `instruct_text` (the recording
    conditions the flow; the LLM sees the instruction, not the prompt's tokens). `<|endofprompt|>` is added to an
    instruction that does not end with it. A model without the instruct2 capability answers 400."""
    if not state.capabilities.instruct2:
        raise UnsupportedCapabilityError(
            f"inference_instruct2 needs a CosyVoice2 model with prompt models; the served model {state.model_id} has "
            "no instruct2 capability (on CosyVoice-300M-Instruct use /inference_instruct)",
            param="instruction",
        )
    prompt = PromptAudio(await read_upload(prompt_wav, state.settings.max_upload_bytes))
    voice = InstructVoice(PromptVoice(prompt, "", "instruct2 prompt"), instruct_text)
    return await _pcm_response(request, service, state, tts_text, voice)
