"""Per-app state and the dependencies routes receive through `Annotated` aliases."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import anyio
from fastapi import Depends, Request

from service.api.auth import ApiKeys
from service.api.metrics import Metrics
from service.api.ratelimit import RateLimit
from service.bundle import ModelBundle
from service.cache import RedisLexiconStore
from service.errors import NotFoundError, NotReadyError, ShuttingDownError
from service.frontend import Lexicon, TextFrontend
from service.settings import Settings
from service.tts import TTSService


@dataclass
class AppState:
    """Everything one app instance owns; the lifespan fills in the model-dependent part."""

    settings: Settings
    metrics: Metrics
    keys: ApiKeys
    rate_limit: RateLimit
    stream_threads: anyio.CapacityLimiter | None = None  # threads that wait for job output (set in the lifespan)
    service: TTSService | None = None
    frontend: TextFrontend | None = None
    lexicon_store: RedisLexiconStore | None = None  # closed at shutdown (None: the lexicon lives in memory)
    bundle: ModelBundle | None = None
    normalizer: dict[str, str] = field(default_factory=dict)
    closing: bool = False

    @property
    def model_id(self) -> str:
        return self.bundle.manifest.model if self.bundle else ""


def get_state(request: Request) -> AppState:
    state = request.app.state.tts
    assert isinstance(state, AppState)
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_service(state: StateDep) -> TTSService:
    """The synthesis service; 503 while the model is loading or the app is stopping."""
    if state.closing:
        raise ShuttingDownError("the service is shutting down")
    if state.service is None:
        raise NotReadyError("the model is still loading")
    return state.service


ServiceDep = Annotated[TTSService, Depends(get_service)]


def get_frontend(state: StateDep) -> TextFrontend:
    """The text frontend; 503 while the model is loading or the app is stopping."""
    if state.closing:
        raise ShuttingDownError("the service is shutting down")
    if state.frontend is None:
        raise NotReadyError("the model is still loading")
    return state.frontend


FrontendDep = Annotated[TextFrontend, Depends(get_frontend)]


def get_lexicon(frontend: FrontendDep) -> Lexicon:
    """The pronunciation lexicon; 404 when the frontend runs in official mode (which has none)."""
    if frontend.lexicon is None:
        raise NotFoundError("the pronunciation lexicon is off (official frontend mode)")
    return frontend.lexicon


LexiconDep = Annotated[Lexicon, Depends(get_lexicon)]


async def require_admin_key(request: Request, state: StateDep) -> None:
    """401 without a known key, 403 for a non-admin key, whenever TTS_API_KEYS or TTS_ADMIN_API_KEYS is set."""
    state.keys.check_admin(request)


async def require_api_key(request: Request, state: StateDep) -> None:
    """401 unless the request carries a configured API key (no-op when TTS_API_KEYS is empty)."""
    state.keys.check(request)


def enforce_rate_limit(request: Request, state: StateDep) -> None:
    """429 with Retry-After when the caller's bucket is empty (a sync def: runs off the event loop)."""
    state.rate_limit.check(request)


AUTHENTICATED = [Depends(require_api_key)]
ADMIN = [Depends(require_admin_key)]
SYNTHESIS_GUARDS = [Depends(require_api_key), Depends(enforce_rate_limit)]
