"""The app factory: create_app(settings) wires the runtime, metrics and routes; the lifespan loads the runtime."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from service.api.admission import AdmissionMiddleware, SlotMiddleware, synthesis_routes
from service.api.bodylimit import BodyLimitMiddleware, MultipartTTSMiddleware
from service.api.deps import AppState
from service.api.docs import install_docs, install_openapi
from service.api.drain import Drain, DrainMiddleware
from service.api.errors import install_error_handlers
from service.api.metrics import Metrics, RequestMetricsMiddleware
from service.api.routes import dashscope, lexicon, official, openai, ops, speech, stream, voices
from service.api.routes.ops import STATIC_DIR
from service.api.textfields import TextRoute
from service.api.tracing import RequestIdMiddleware
from service.families.model import EngineLoader
from service.requestids import HEADER
from service.rpc.server import GrpcServer
from service.runtime import Runtime
from service.settings import OPENAI_VOICES, RENAMED, Settings, unknown_env_vars

log = logging.getLogger(__name__)
# Every router of the app; the admission middleware guards those of their routes that carry the synthesis guards.
ROUTERS = (
    speech.router,
    official.router,
    openai.router,
    stream.router,
    dashscope.router,
    voices.router,
    lexicon.router,
    ops.router,
)


def create_app(
    settings: Settings | None = None,
    *,
    engine_loader: EngineLoader | None = None,
    load_in_background: bool = False,
    on_load_failure: Callable[[], None] | None = None,
) -> FastAPI:
    """Build one app instance. Nothing global: two apps in one process share no state or metrics.

    `engine_loader` builds the engine from the loaded bundle (None: its family's own; tests wrap the real one).
    `load_in_background` (the server, `python -m service.api`): the lifespan starts the model load on a thread and
    the app answers at once (/healthz 200; /readyz and synthesis 503 not_ready until the model is ready);
    `on_load_failure` then runs if the load fails (the server stops). Without it the lifespan returns once the model
    is loaded (tests: a TestClient's requests find it ready).
    """
    settings = settings or Settings()
    for name in unknown_env_vars(os.environ):
        log.warning("ignoring unknown setting %s (not a TTS_* setting; see docs/settings.md)", name)
    for old, new in RENAMED.items():
        if old in os.environ:
            log.warning("%s is the old name of %s; it is still read, but rename it", old, new)
    metrics = Metrics()
    runtime = Runtime(settings, observer=metrics, engine_loader=engine_loader, reserved_voice_names=tuple(OPENAI_VOICES))
    state = AppState(runtime=runtime, metrics=metrics, drain=Drain(settings.drain_timeout_s))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.stream_threads = anyio.CapacityLimiter(settings.concurrent_requests + settings.queue_max + 4)
        # gRPC listens from the start (health NOT_SERVING, calls UNAVAILABLE) and turns SERVING once loaded
        rpc = GrpcServer(state.runtime, settings.host, settings.grpc_port) if settings.grpc_port else None
        if rpc is not None:
            rpc.start()
            state.drain.on_begin(rpc.stop_accepting)  # gRPC refuses new calls when HTTP does (service.api.serving)
        try:
            ready = rpc.ready if rpc is not None else _nothing
            if load_in_background:
                state.runtime.start_loading(ready, on_load_failure or _nothing)
            else:
                await anyio.to_thread.run_sync(state.runtime.load)
                ready()
            yield
        finally:
            state.drain.begin()  # begun at SIGTERM by DrainingServer; here for servers that do not
            if rpc is not None:
                await anyio.to_thread.run_sync(rpc.wait_stopped)  # its calls' grace ends at the drain's deadline
            await anyio.to_thread.run_sync(state.runtime.close)

    app = FastAPI(
        title="cosyvoice-lite",
        summary=None,  # install_openapi: the served model's name
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # install_docs serves Swagger UI from local files
        redoc_url=None,  # ReDoc only exists as a CDN script
    )
    app.state.tts = state
    app.router.route_class = TextRoute  # routes added on the app itself (/docs) read text strictly like the routers'
    install_error_handlers(app)
    app.add_middleware(SlotMiddleware, state=state)  # inside the body limit: a place is taken once the body is in
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=settings.max_body_bytes,
        upload_bytes=settings.max_upload_bytes,
        timeout_s=settings.body_timeout_s,
    )
    # outside the body limit (a refusal reads no body), inside CORS (browsers can read a refusal)
    routers = ROUTERS
    app.add_middleware(AdmissionMiddleware, state=state, routes=synthesis_routes(*routers))
    app.add_middleware(MultipartTTSMiddleware)  # outside admission: a multipart /tts is admitted as /tts/prompt
    app.add_middleware(DrainMiddleware, drain=state.drain)  # inside CORS and the metrics: its 503s are read and counted
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_allow_origins,
            allow_methods=["GET", "POST"],
            allow_headers=["*"],
            expose_headers=[HEADER],  # a browser page may read the request id of an answer
        )
    app.add_middleware(RequestMetricsMiddleware, metrics=lambda: state.metrics)
    app.add_middleware(RequestIdMiddleware)  # outermost: every answer carries x-request-id, refusals included
    for router in routers:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
    install_docs(app)
    install_openapi(app, lambda: ", ".join(state.runtime.model_ids))
    return app


def _nothing() -> None:
    return None
