"""Operations routes: /healthz (liveness), /readyz (real inference + cache ping), /metrics, /info, and the web page."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
from fastapi import APIRouter
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from service.api.deps import ServiceDep, StateDep
from service.api.routes.common import model_facts, openai_max_chars
from service.api.schemas import FORMATS, Health, Readiness, ServiceInfo
from service.api.textfields import TextRoute
from service.errors import NotFoundError, TTSError

router = APIRouter(tags=["operations"], route_class=TextRoute)
STATIC_DIR = Path(__file__).resolve().parents[1] / "static"


@router.get("/healthz", response_model=Health, summary="Liveness: the process answers")
async def healthz() -> Health:
    return Health(status="ok")


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}}, summary="Readiness")
async def readyz(state: StateDep) -> JSONResponse:
    """200 `ready` after a real (recent or fresh) inference; 200 `degraded` when the audio cache is down
    (requests still work, uncached); 503 `not_ready` while loading, stopping, or when loading or inference fails."""
    service = state.service
    if service is None or state.closing:
        failed = state.runtime.load_error is not None and not state.closing
        engine = "stopping" if state.closing else "failed" if failed else "loading"
        return _readiness(503, "not_ready", engine, "-", "the model could not be loaded (see the log)" if failed else None)
    settings = state.settings
    try:
        await anyio.to_thread.run_sync(
            service.probe, settings.warmup_text, settings.default_speaker, settings.ready_probe_interval_s
        )
    except TTSError as e:
        return _readiness(503, "not_ready", "failed", "-", e.message)
    cache_ok = await anyio.to_thread.run_sync(service.cache.ping)
    cache = f"{service.cache.backend}: {'ok' if cache_ok else 'down'}"
    return _readiness(200, "ready" if cache_ok else "degraded", "ok", cache)


def _readiness(status_code: int, status: str, engine: str, cache: str, detail: str | None = None) -> JSONResponse:
    body = Readiness(status=status, engine=engine, cache=cache, detail=detail)  # type: ignore[arg-type]
    headers = {"Retry-After": "5"} if status_code == 503 else {}
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


@router.get("/metrics", response_class=Response, summary="Prometheus metrics")
async def metrics(state: StateDep) -> Response:
    body = await anyio.to_thread.run_sync(generate_latest, state.metrics.registry)  # walks every series: CPU work
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@router.get("/info", response_model=ServiceInfo, summary="Model, speakers, formats and limits")
async def info(state: StateDep, service: ServiceDep) -> ServiceInfo:
    """Also `random_weights` / `test_model` from the bundle's manifest, and a `warning` when either is true."""
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
        **model_facts(state).model_dump(),
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
