"""Helpers shared by the routes: submit off the event loop, response headers, model facts, audio response docs."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import UploadFile

from service.api.deps import AppState
from service.api.schemas import OPENAI_MAX_INPUT_CHARS, ModelFacts
from service.audio.encode import AudioFormat, media_type
from service.bundle import ModelBundle
from service.errors import PayloadTooLargeError, PromptAudioError, PromptAudioProblem
from service.speech.job import SpeechJob
from service.speech.request import SpeechRequest
from service.speech.service import TTSService

INSTRUCTIONS_WARNING = '299 cosyvoice-lite "instructions are ignored: this model has no instruct capability"'


async def read_upload(upload: UploadFile, max_bytes: int, *, param: str = "prompt_wav") -> bytes:
    """The uploaded file's bytes (the body limit already bounds them; this names the field when it is empty)."""
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise PayloadTooLargeError(f"{param} is larger than {max_bytes} bytes (TTS_MAX_UPLOAD_BYTES)", param=param)
    if not data:
        raise PromptAudioError(f"{param} is empty", reason=PromptAudioProblem.EMPTY, param=param)
    return data


async def submit(service: TTSService, request: SpeechRequest) -> SpeechJob:
    """Validate, run the text frontend and look up the cache in a worker thread; start synthesis on a miss."""
    return await anyio.to_thread.run_sync(service.submit, request)


def job_headers(job: SpeechJob) -> dict[str, str]:
    """X-Cache (hit/miss) and X-Sample-Rate (Hz of the audio in the body)."""
    return {"X-Cache": "hit" if job.cache_hit else "miss", "X-Sample-Rate": str(job.prepared.sample_rate_hz)}


def audio_headers(job: SpeechJob) -> dict[str, str]:
    """job_headers plus a file name. `inline`: a browser opening the URL plays the audio (the web page's player
    too), while "save as" and `curl -OJ` still get `speech.<format>`."""
    filename = f"speech.{job.prepared.request.fmt.value}"
    return job_headers(job) | {"Content-Disposition": f'inline; filename="{filename}"'}


def openai_max_chars(state: AppState) -> int:
    """Longest `input` of /v1/audio/speech: OpenAI's 4096, or TTS_MAX_CHARS when that is lower."""
    return min(OPENAI_MAX_INPUT_CHARS, state.settings.max_chars)


def model_facts(state: AppState) -> ModelFacts:
    """The first served bundle's random-weight / test-model flags, with its manifest's warning sentence."""
    return bundle_facts(state.bundle)


def bundle_facts(bundle: ModelBundle | None) -> ModelFacts:
    """A bundle's random-weight / test-model flags, with the manifest's warning sentence when either is set."""
    manifest = bundle.manifest if bundle else None
    if manifest is None or manifest.warning is None:
        return ModelFacts()
    return ModelFacts(random_weights=manifest.random_weights, test_model=manifest.test_model, warning=manifest.warning)


def audio_responses() -> dict[int | str, dict[str, Any]]:
    """OpenAPI description of a 200 audio body in every format. Raw PCM's media type names its rate, which is the
    served model's (routes are declared before a model is loaded): the description says so, the key has no rate."""
    content: dict[str, Any] = {media_type(f, 0).split(";")[0]: {} for f in AudioFormat}
    rates = "PCM and WAV at the model's rate (22,050 Hz CosyVoice v1, 24,000 Hz CosyVoice2) unless the request names one"
    return {200: {"description": f"Audio (X-Cache: hit|miss, X-Sample-Rate: Hz; {rates})", "content": content}}
