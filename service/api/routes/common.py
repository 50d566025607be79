"""Helpers shared by the synthesis routes: submit off the event loop, response headers, audio response docs."""

from __future__ import annotations

from typing import Any

import anyio

from service.audio import AudioFormat, media_type
from service.tts import SpeechJob, SpeechRequest, TTSService

INSTRUCTIONS_WARNING = '299 cosyvoice-lite "instructions are ignored: CosyVoice-300M-SFT has no instruction control"'


async def submit(service: TTSService, request: SpeechRequest) -> SpeechJob:
    """Validate, run the text frontend and look up the cache in a worker thread; start synthesis on a miss."""
    return await anyio.to_thread.run_sync(service.submit, request)


def job_headers(job: SpeechJob) -> dict[str, str]:
    """X-Cache (hit/miss) and X-Sample-Rate (Hz of the audio in the body)."""
    return {"X-Cache": "hit" if job.cache_hit else "miss", "X-Sample-Rate": str(job.prepared.sample_rate_hz)}


def audio_responses(model_rate_hz: int = 22050) -> dict[int | str, dict[str, Any]]:
    """OpenAPI description of a 200 audio body in every format."""
    content: dict[str, Any] = {media_type(f, model_rate_hz): {} for f in AudioFormat}
    return {200: {"description": "Audio (X-Cache: hit|miss, X-Sample-Rate: Hz)", "content": content}}
