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
from service.errors import NotFoundError, NotReadyError, ShuttingDownError, UnsupportedMediaTypeError
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


async def require_listing_key(request: Request, state: StateDep) -> None:
    """Model and voice lists: like require_api_key, but a request without a key passes while
    TTS_PUBLIC_MODEL_LIST is on (Open WebUI fetches them without one). A wrong key is still a 401."""
    state.keys.check(request, anonymous_ok=state.settings.public_model_list)


async def require_json_body(request: Request) -> None:
    """415 unless the body is declared JSON. Runs before the body is validated, so a form body (curl -d without
    a Content-Type header) gets a message that says what to send instead of a list of missing fields."""
    declared = request.headers.get("content-type")
    if declared is None:
        return  # FastAPI reads an undeclared body as JSON
    media = declared.split(";", 1)[0].strip().lower()
    if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
        return
    raise UnsupportedMediaTypeError(
        f"the request body must be JSON: send `Content-Type: application/json` (this request declared {media[:100]!r})"
    )


def enforce_rate_limit(request: Request, state: StateDep) -> None:
    """429 with Retry-After when the caller's bucket is empty (a sync def: runs off the event loop)."""
    state.rate_limit.check(request)


AUTHENTICATED = [Depends(require_api_key)]
ADMIN = [Depends(require_admin_key)]
LISTING = [Depends(require_listing_key)]
JSON_BODY = [Depends(require_json_body)]
SYNTHESIS_GUARDS = [Depends(require_api_key), Depends(enforce_rate_limit)]
