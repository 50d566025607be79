"""Per-app state and the dependencies routes receive through `Annotated` aliases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import anyio
from fastapi import Depends, Request

from service.access import ApiKeys
from service.api.auth import caller_of, was_admitted
from service.api.drain import Drain
from service.api.metrics import Metrics
from service.bundle import Capabilities, ModelBundle
from service.errors import NotFoundError, UnsupportedMediaTypeError
from service.families.model import VoiceLibrary
from service.frontend import Lexicon, TextFrontend
from service.runtime import Runtime
from service.settings import Settings
from service.speech.service import TTSService
from service.stores.lexicon import RedisLexiconStore


@dataclass
class AppState:
    """What one app instance owns: the transport-neutral runtime, its HTTP metrics, and the stream threads."""

    runtime: Runtime
    metrics: Metrics
    drain: Drain  # the shutdown drain every transport follows
    stream_threads: anyio.CapacityLimiter | None = None  # threads that wait for job output (set in the lifespan)

    @property
    def settings(self) -> Settings:
        return self.runtime.settings

    @property
    def service(self) -> TTSService | None:
        """The loaded service (None while loading); routes use `ServiceDep`, which also refuses while closing."""
        return self.runtime.loaded_service

    @service.setter
    def service(self, value: TTSService) -> None:
        self.runtime.service = value

    @property
    def bundle(self) -> ModelBundle | None:
        return self.runtime.bundle

    @property
    def capabilities(self) -> Capabilities:
        """What the loaded model can voice (the defaults while none is loaded; routes that read it need the service)."""
        bundle = self.runtime.bundle
        return bundle.capabilities if bundle is not None else Capabilities()

    @property
    def normalizer(self) -> dict[str, str]:
        return self.runtime.normalizer

    @property
    def lexicon_store(self) -> RedisLexiconStore | None:
        return self.runtime.lexicon_store

    @property
    def closing(self) -> bool:
        return self.runtime.closing

    @property
    def keys(self) -> ApiKeys:
        return self.runtime.keys

    @property
    def model_id(self) -> str:
        return self.runtime.model_id


def get_state(request: Request) -> AppState:
    state = request.app.state.tts
    assert isinstance(state, AppState)
    return state


StateDep = Annotated[AppState, Depends(get_state)]


def get_service(state: StateDep) -> TTSService:
    """The synthesis service; 503 while the model is loading or the app is stopping."""
    return state.runtime.service


ServiceDep = Annotated[TTSService, Depends(get_service)]


def get_frontend(state: StateDep) -> TextFrontend:
    """The text frontend; 503 while the model is loading or the app is stopping."""
    return state.runtime.frontend


FrontendDep = Annotated[TextFrontend, Depends(get_frontend)]


def get_voices(state: StateDep) -> VoiceLibrary:
    """Prompt analysis and saved voices; 503 while the model is loading or the app is stopping."""
    return state.runtime.voices


VoicesDep = Annotated[VoiceLibrary, Depends(get_voices)]


def get_lexicon(frontend: FrontendDep) -> Lexicon:
    """The pronunciation lexicon; 404 when the frontend runs in official mode (which has none)."""
    if frontend.lexicon is None:
        raise NotFoundError("the pronunciation lexicon is off (official frontend mode)")
    return frontend.lexicon


LexiconDep = Annotated[Lexicon, Depends(get_lexicon)]


async def require_admin_key(request: Request, state: StateDep) -> None:
    """401 without a known key, 403 for a non-admin key, whenever TTS_API_KEYS or TTS_ADMIN_API_KEYS is set."""
    state.keys.check_admin(caller_of(request))


async def require_api_key(request: Request, state: StateDep) -> None:
    """401 unless the request carries a configured API key (no-op when TTS_API_KEYS is empty)."""
    state.keys.check(caller_of(request))


async def require_listing_key(request: Request, state: StateDep) -> None:
    """Model and voice lists: like require_api_key, but a request without a key passes while
    TTS_PUBLIC_MODEL_LIST is on (Open WebUI fetches them without one). A wrong key is still a 401."""
    state.keys.check(caller_of(request), anonymous_ok=state.settings.public_model_list)


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
    """429 with Retry-After when the caller's bucket is empty (a sync def: runs off the event loop).

    A request the admission middleware let through was counted there already and is not counted again."""
    if not was_admitted(request):
        state.runtime.rate_limit.hit(state.runtime.identity(caller_of(request)))


AUTHENTICATED = [Depends(require_api_key)]
ADMIN = [Depends(require_admin_key)]
LISTING = [Depends(require_listing_key)]
JSON_BODY = [Depends(require_json_body)]
SYNTHESIS_GUARDS = [Depends(require_api_key), Depends(enforce_rate_limit)]
