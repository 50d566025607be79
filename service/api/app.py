"""The app factory: create_app(settings) wires settings, metrics, limits and routes; the lifespan loads the model."""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.staticfiles import StaticFiles

from service.api.admission import AdmissionMiddleware, synthesis_routes
from service.api.auth import ApiKeys
from service.api.bodylimit import BodyLimitMiddleware
from service.api.deps import AppState
from service.api.docs import install_docs
from service.api.errors import install_error_handlers
from service.api.metrics import Metrics, RequestMetricsMiddleware
from service.api.ratelimit import ClientIdentity, RateLimit
from service.api.routes import lexicon, openai, ops, speech
from service.api.routes.ops import STATIC_DIR
from service.bundle import ModelBundle
from service.cache import RedisLexiconStore, build_audio_cache
from service.engine.sessions import RuntimeOptions
from service.engine.synthesizer import Synthesizer
from service.errors import BundleError
from service.frontend import TextFrontend
from service.settings import RENAMED, Settings, unknown_env_vars
from service.tts import Engine, TTSService

log = logging.getLogger(__name__)

EngineLoader = Callable[[ModelBundle, RuntimeOptions], Engine]


def load_synthesizer(bundle: ModelBundle, runtime: RuntimeOptions) -> Engine:
    """Default engine: the ONNX Runtime synthesizer of the bundle."""
    return Synthesizer.load(bundle, runtime)


def create_app(settings: Settings | None = None, *, engine_loader: EngineLoader = load_synthesizer) -> FastAPI:
    """Build one app instance. Nothing global: two apps in one process share no state or metrics.

    `engine_loader` builds the engine from the loaded bundle (tests wrap the real synthesizer with it).
    """
    settings = settings or Settings()
    for name in unknown_env_vars(os.environ):
        log.warning("ignoring unknown setting %s (not a TTS_* setting; see the README settings table)", name)
    for old, new in RENAMED.items():
        if old in os.environ:
            log.warning("%s is the old name of %s; it is still read, but rename it", old, new)
    keys = ApiKeys([k.get_secret_value() for k in settings.api_keys], [k.get_secret_value() for k in settings.admin_api_keys])
    redis_url = settings.redis_url.get_secret_value() if settings.redis_url else None
    rate_limit = RateLimit(settings.rate_limit_per_minute, ClientIdentity(settings.trusted_proxies, keys.enabled), redis_url)
    state = AppState(settings=settings, metrics=Metrics(), keys=keys, rate_limit=rate_limit)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.stream_threads = anyio.CapacityLimiter(settings.concurrent_requests + settings.queue_max + 4)
        await anyio.to_thread.run_sync(_load, state, engine_loader)
        try:
            yield
        finally:
            await _unload(state)

    app = FastAPI(
        title="cosyvoice-lite",
        summary="CosyVoice-300M-SFT text-to-speech on ONNX Runtime (CPU)",
        version="0.1.0",
        lifespan=lifespan,
        docs_url=None,  # install_docs serves Swagger UI from local files
        redoc_url=None,  # ReDoc only exists as a CDN script
    )
    app.state.tts = state
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    # outside the body limit (a refusal reads no body), inside CORS (browsers can read a refusal)
    routers = (speech.router, openai.router, lexicon.router, ops.router)
    app.add_middleware(AdmissionMiddleware, state=state, routes=synthesis_routes(*routers))
    if settings.cors_allow_origins:
        app.add_middleware(
            CORSMiddleware, allow_origins=settings.cors_allow_origins, allow_methods=["GET", "POST"], allow_headers=["*"]
        )
    app.add_middleware(RequestMetricsMiddleware, metrics=lambda: state.metrics)
    for router in routers:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")
    install_docs(app)
    return app


def runtime_options(s: Settings) -> RuntimeOptions:
    """The engine's ONNX Runtime and stage-scheduling options from the settings."""
    return RuntimeOptions(
        intra_op_threads=s.intra_op_threads,
        inter_op_threads=s.inter_op_threads,
        llm_threads=s.llm_threads,
        acoustic_threads=s.acoustic_threads,
        allow_spinning=s.ort_spinning,
        max_batch=s.max_batch,
        acoustic_slots=s.acoustic_slots,
        acoustic_nice=s.acoustic_nice,
        first_audio_priority=s.first_audio_priority,
    )


def _load(state: AppState, engine_loader: EngineLoader) -> None:
    """Load bundle, frontend, engine and cache, then warm up with a real synthesis (runs in a thread)."""
    s = state.settings
    bundle = ModelBundle.load(s.model_dir, verify_hashes=s.verify_bundle_hashes)
    if s.default_speaker not in bundle.speakers:
        raise BundleError(f"TTS_DEFAULT_SPEAKER {s.default_speaker!r} is not in the bundle; it has {', '.join(bundle.speakers)}")
    redis_url = s.redis_url.get_secret_value() if s.redis_url else None
    # lexicon entries live in Redis (shared by replicas) when it is configured, else in this process
    state.lexicon_store = RedisLexiconStore(redis_url) if redis_url else None
    frontend = TextFrontend.load(bundle.tokenizer_path, lexicon_store=state.lexicon_store)
    engine = engine_loader(bundle, runtime_options(s))
    cache = build_audio_cache(redis_url, s.cache_max_bytes, s.cache_ttl_s)
    state.metrics.watch_cache(cache.stats)
    service = TTSService(
        frontend,
        engine,
        cache,
        bundle_sha256=bundle.manifest_sha256,
        concurrency=s.concurrent_requests,
        queue_max=s.queue_max,
        retry_after_s=s.retry_after_s,
        n_timesteps=s.n_timesteps,
        observer=state.metrics,
    )
    service.probe(s.warmup_text, s.default_speaker)
    # What is loaded now lives until shutdown: keep it out of the cyclic GC, whose full passes over the text
    # frontend's dictionaries (~300k objects, 100-200 ms with the GIL held) otherwise stall the event loop.
    gc.collect()
    gc.freeze()
    log.info(
        "model %s loaded from %s: %d speakers, cache %s; ready",
        bundle.manifest.model,
        s.model_dir,
        len(bundle.speakers),
        cache.backend,
    )
    if bundle.manifest.warning:
        log.warning("%s", bundle.manifest.warning)
    state.bundle, state.normalizer, state.service = bundle, frontend.normalizer_info, service
    state.frontend = frontend


async def _unload(state: AppState) -> None:
    state.closing = True
    gc.unfreeze()  # what this app held may now be collected
    service = state.service
    if service is not None:
        await anyio.to_thread.run_sync(service.close)
        service.cache.close()
    if state.lexicon_store is not None:
        state.lexicon_store.close()
