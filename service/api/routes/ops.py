"""Operations routes: /healthz (liveness), /readyz (real inference + cache ping), /metrics, /info, and the web page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import AppState, ServiceDep, StateDep
from service.api.routes.common import bundle_facts, model_facts, openai_max_chars
from service.api.schemas import FORMATS, Health, ModelInfo, ModelReadiness, Readiness, ServiceInfo
from service.api.textfields import TextRoute
from service.errors import NotFoundError, TTSError
from service.served import ServedModel

router = APIRouter(tags=["operations"], route_class=TextRoute)
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, summary="Readiness")
async def readyz(state: StateDep) -> JSONResponse:
    """200 `ready` after a real (recent or fresh) inference on every served model; 200 `degraded` when the audio cache
    is down (requests still work, uncached); 503 `not_ready` while loading, stopping, or when loading or an inference
    fails. With several models, `models` says each one's state."""
    models = state.runtime.loaded_models
    if models is None or state.closing:
        failed = state.runtime.load_error is not None and not state.closing
        engine = "stopping" if state.closing else "failed" if failed else "loading"
        detail = "the model could not be loaded (see the log)" if failed else None
        loading = [ModelReadiness(model=m, engine=e) for m, e in list(state.runtime.load_states.items())]
        return _readiness(state, Readiness(status="not_ready", engine=engine, cache="-", detail=detail, models=loading))
    checked = [await _probe(state, served) for served in models]
    failure = next((m for m in checked if m.detail is not None), None)
    if failure is not None:
        detail = f"{failure.model}: {failure.detail}" if len(checked) > 1 else failure.detail
        return _readiness(state, Readiness(status="not_ready", engine="failed", cache="-", detail=detail, models=checked))
    cache = models.first.service.cache  # one audio cache for every model
    cache_ok = await anyio.to_thread.run_sync(cache.ping)
    cache_state = f"{cache.backend}: {'ok' if cache_ok else 'down'}"
    body = Readiness(status="ready" if cache_ok else "degraded", engine="ok", cache=cache_state, models=checked)
    return _readiness(state, body)


async def _probe(state: AppState, served: ServedModel) -> ModelReadiness:
    """A real inference on `served` unless one succeeded within TTS_READY_PROBE_INTERVAL_S."""
    s = state.settings
    try:
        await anyio.to_thread.run_sync(served.service.probe, s.warmup_text, s.default_speaker, s.ready_probe_interval_s)
    except TTSError as e:
        return ModelReadiness(model=served.id, engine="failed", detail=e.message)
    return ModelReadiness(model=served.id, engine="ok")


def _readiness(state: AppState, body: Readiness) -> JSONResponse:
    """The body with `models` only when several are served (one model's readiness is the top level's)."""
    content = body.model_dump()
    if len(state.settings.model_dirs) == 1:
        del content["models"]
    headers = {"Retry-After": "5"} if body.status == "not_ready" else {}
    return JSONResponse(content, status_code=503 if body.status == "not_ready" else 200, headers=headers)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(state: StateDep) -> Response:
    body = await anyio.to_thread.run_sync(generate_latest, state.metrics.registry)  # walks every series: CPU work
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/info", response_model=ServiceInfo, summary="Model, speakers, formats and limits")
async def info(state: StateDep, service: ServiceDep) -> ServiceInfo:
    """The first (default) model at the top level, also `random_weights` / `test_model` from its manifest and a
    `warning` when either is true; `models` describes every served model."""
    speakers = service.speakers
    return ServiceInfo(
        model=state.model_id,
        sample_rate_hz=service.sample_rate,
        speakers=speakers,
        default_speaker=state.settings.default_speaker,
        formats=FORMATS,
        openai_voices=service.aliases,
        openai_pcm_sample_rate_hz=state.settings.openai_pcm_sample_rate_hz,
        max_chars=state.settings.max_chars,
        openai_max_chars=openai_max_chars(state),
        audio_bitrate_kbps=state.settings.audio_bitrate_kbps,
        normalizer=state.normalizer,
        capabilities=dataclasses.asdict(state.bundle.capabilities) if state.bundle else {},
        max_upload_bytes=state.settings.max_upload_bytes,
        instruct_presets=list(state.runtime.model.instruct_presets),
        models=[_model_info(m) for m in state.runtime.models],
        **model_facts(state).model_dump(),
    )


def _model_info(served: ServedModel) -> ModelInfo:
    return ModelInfo(
        model=served.id,
        family=served.family,
        sample_rate_hz=served.service.sample_rate,
        speakers=served.service.speakers,
        openai_voices=served.service.aliases,
        capabilities=dataclasses.asdict(served.capabilities),
        instruct_presets=list(served.model.instruct_presets),
        description=served.bundle.manifest.description,
        **bundle_facts(served.bundle).model_dump(),
    )


@router.get("/", response_class=FileResponse, include_in_schema=False)
async def index() -> FileResponse:
    return await _static("index.html", "text/html; charset=utf-8", "the web page")


@router.get("/favicon.ico", response_class=FileResponse, include_in_schema=False)
async def favicon() -> FileResponse:
    """The page's icon (SVG; browsers ask for this name by default)."""
    return await _static("favicon.svg", "image/svg+xml", "the icon")


async def _static(name: str, media_type: str, what: str) -> FileResponse:
    path = STATIC_DIR / name
    if not await anyio.to_thread.run_sync(path.is_file):
        raise NotFoundError(f"{what} is not installed")
    return FileResponse(path, media_type=media_type)
