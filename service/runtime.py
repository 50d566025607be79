"""The transport-neutral application: settings -> bundle, frontend, engine, caches, stores and admission, shared by
the HTTP app, the gRPC server and the CLI."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from service.access import ApiKeys, ClientIdentity, Gate
from service.bundle import ModelBundle
from service.engine.memory import StateBudget
from service.engine.options import EngineLevers, RuntimeOptions, SessionOptions
from service.engine.runtimes import native_kernels_note
from service.errors import BundleError, NotReadyError, SettingError, ShuttingDownError, TTSError
from service.families.model import EngineLoader, Model, ModelContext, VoiceLibrary
from service.families.registry import check_options, load_model, open_bundle
from service.frontend import TextFrontend
from service.settings import OPENAI_VOICES, Settings
from service.speech.job import SynthesisObserver
from service.speech.service import TTSService
from service.stores.analysis_cache import AnalysisCache
from service.stores.audio_cache import CacheStats, build_audio_cache
from service.stores.lexicon import RedisLexiconStore
from service.stores.ratelimit import RateLimiter
from service.stores.voices import DirectoryVoiceStore, RedisVoiceStore, VoiceStore

log = logging.getLogger(__name__)
T = TypeVar("T")


def runtime_options(s: Settings) -> RuntimeOptions:
    """The engine's ONNX Runtime options (operator settings) and levers (the engine profile) from the settings."""
    e = s.engine_profile
    sessions = SessionOptions(
        intra_op_threads=s.intra_op_threads,
        inter_op_threads=e.inter_op_threads,
        llm_threads=e.llm_threads,
        acoustic_threads=e.acoustic_threads,
        allow_spinning=e.ort_spinning,
        compiled_cache_dir=s.cache_dir.expanduser() if s.cache_dir is not None else None,
    )
    levers = EngineLevers(
        **{f.name: getattr(e, f.name) for f in dataclasses.fields(EngineLevers)},
    )
    return RuntimeOptions.of(sessions, levers)


def check_settings(settings: Settings) -> None:
    """Refuse at once, before the slow load, settings the model in `settings.model_dir` cannot honour: SettingError
    naming the field (e.g. a first hop under the family's minimum, a default speaker that is nowhere), BundleError for
    a directory that is no bundle. Reads the manifest, the speakers and (for the default speaker) one saved voice;
    hashes, graphs and whether a saved voice suits this model wait for `Runtime.load`."""
    bundle = open_bundle(settings.model_dir)
    check_options(bundle, runtime_options(settings))
    _check_default_speaker_exists(settings, tuple(bundle.speakers))


def voice_store(s: Settings) -> VoiceStore:
    """Where saved voices live: Redis (shared by replicas) when it is configured, else TTS_VOICES_DIR."""
    redis_url = s.redis_url.get_secret_value() if s.redis_url else None
    return RedisVoiceStore(redis_url) if redis_url else DirectoryVoiceStore(s.voices_dir)


def _check_default_speaker_exists(s: Settings, speakers: Sequence[str]) -> None:
    """A model with built-in speakers refuses a TTS_DEFAULT_SPEAKER that is neither one of them nor a saved voice (a
    typo), as `Runtime.load` would after minutes of loading. A store that cannot be read now (Redis down) is left to
    the load; a model without built-in speakers starts anyway (its default voice may be saved later)."""
    name = s.default_speaker
    if not speakers or name in speakers:
        return
    store = voice_store(s)
    try:
        saved = store.get(name)
    except TTSError:
        return
    finally:
        store.close()
    if saved is None:
        raise SettingError(_no_such_voice(name, speakers), param="default_speaker")


def _no_such_voice(name: str, speakers: Sequence[str]) -> str:
    """Why TTS_DEFAULT_SPEAKER `name` cannot be served by a model with built-in `speakers` (before or at the load)."""
    return f"{name!r} is neither a built-in speaker nor a saved voice; the bundle has {', '.join(speakers)}"


class Runtime:
    """One loaded model (its family's, from the registry) and everything around it. Built cheaply from settings;
    `load()` does the heavy part.

    Thread-safe: transports call `admit`, `service`, `frontend` from any thread. `observer` receives what
    the synthesis service measures (the HTTP app passes its Prometheus metrics).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        observer: SynthesisObserver | None = None,
        engine_loader: EngineLoader | None = None,
        reserved_voice_names: tuple[str, ...] = (),
    ) -> None:
        self.settings = settings
        self.reserved_voice_names = reserved_voice_names  # names saved voices may not take (e.g. OpenAI's)
        self.observer = observer or SynthesisObserver()
        self.engine_loader = engine_loader  # None: the family's own engine (tests and benchmarks wrap it)
        s = settings
        self.keys = ApiKeys([k.get_secret_value() for k in s.api_keys], [k.get_secret_value() for k in s.admin_api_keys])
        self.identity = ClientIdentity(s.trusted_proxies, self.keys.enabled)
        self.rate_limit = RateLimiter(s.rate_limit_per_minute, self.redis_url)
        self.gate = Gate(self.keys, self.identity, self.rate_limit)
        self.bundle: ModelBundle | None = None
        self._service: TTSService | None = None
        self._frontend: TextFrontend | None = None
        self.lexicon_store: RedisLexiconStore | None = None  # None: the lexicon lives in this process
        self._model: Model | None = None
        self.normalizer: dict[str, str] = {}
        self.model_created = 0  # Unix time the bundle's manifest was written (OpenAI's `created`)
        self.closing = False
        self.load_error: Exception | None = None  # why a background load failed (`start_loading`)
        self._loader: threading.Thread | None = None
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def redis_url(self) -> str | None:
        return self.settings.redis_url.get_secret_value() if self.settings.redis_url else None

    @property
    def model_id(self) -> str:
        return self.bundle.manifest.model if self.bundle else ""

    # ---- lifecycle ---------------------------------------------------------------------------
    def start_loading(self, on_ready: Callable[[], None], on_failure: Callable[[], None]) -> None:
        """Run `load()` on a thread of its own, so the transports answer (liveness, 503 not_ready) while the model
        loads. `on_ready` runs on that thread once the model is ready; after a failure, logged and kept in
        `load_error`, `on_failure` runs instead. `close()` waits for the load to end."""

        def run() -> None:
            try:
                self.load()
            except TTSError as e:  # a bundle or setting the model cannot start with: its message says which
                log.error("the model could not be loaded: %s", e.message)
                self.load_error = e
            except Exception as e:  # a fault of ours: with its traceback; the server must not stay "loading"
                log.exception("the model could not be loaded")
                self.load_error = e
            (on_ready if self.load_error is None else on_failure)()

        self._loader = threading.Thread(target=run, name="model-load", daemon=True)
        self._loader.start()

    def load(self) -> None:
        """Load bundle, frontend, engine and cache, then warm up with a real synthesis (blocking; minutes at most)."""
        s = self.settings
        log.info("%s", self.keys.describe(s.public_model_list))
        log.info("loading the model from %s%s", s.model_dir, " (checking every file's sha256)" * s.verify_bundle_hashes)
        bundle = open_bundle(s.model_dir, verify_hashes=s.verify_bundle_hashes)
        log.info("%s (%s): building the text frontend, then opening the graphs", bundle.manifest.model, bundle.family)
        model = load_model(bundle, self._model_context())
        _check_default_speaker(s.default_speaker, model)
        cache = build_audio_cache(self.redis_url, s.cache_max_bytes, s.cache_ttl_s)
        watch_cache: Callable[[CacheStats], None] | None = getattr(self.observer, "watch_cache", None)
        if watch_cache is not None:  # an observer that exports the cache's counters (the HTTP metrics)
            watch_cache(cache.stats)
        watch_budget: Callable[[StateBudget], None] | None = getattr(self.observer, "watch_state_budget", None)
        budget = model.state_budget()
        if watch_budget is not None and budget is not None:  # the same for the streams' flow-cache bound
            watch_budget(budget)
        aliases = voice_aliases(s.voice_aliases, tuple(bundle.speakers))
        _warn_unknown_targets(s.voice_aliases, tuple(bundle.speakers), model.voices)
        service = TTSService(
            model.frontend,
            model,
            cache,
            voices=model.resolve,
            aliases=aliases,
            alias_names=tuple(OPENAI_VOICES),
            bundle_sha256=bundle.manifest_sha256,
            concurrency=s.concurrent_requests,
            queue_max=s.queue_max,
            retry_after_s=s.retry_after_s,
            n_timesteps=s.engine_profile.n_timesteps,
            observer=self.observer,
            probe_voice=None if s.default_speaker in model.speakers else model.warmup_voice(),
            default_voice=s.default_speaker,
            max_speech_s=s.max_speech_s,
            max_sentence_speech_s=s.max_sentence_speech_s,
        )
        log.info("model %s: graphs opened; warming up with a real synthesis", bundle.manifest.model)
        service.probe(s.warmup_text, s.default_speaker)
        # What is loaded now lives until shutdown: keep it out of the cyclic GC, whose full passes over the text
        # frontend's dictionaries (~300k objects, each pass with the GIL held) otherwise stall an event loop.
        gc.collect()
        gc.freeze()
        log.info("model %s loaded from %s: %d speakers, cache %s; ready", bundle.manifest.model, s.model_dir,
                 len(bundle.speakers), cache.backend)  # fmt: skip
        if bundle.manifest.warning:
            log.warning("%s", bundle.manifest.warning)
        native_note = native_kernels_note(bundle, runtime_options(s))
        if native_note:
            log.info("%s", native_note)
        self.model_created = int((bundle.root / "manifest.json").stat().st_mtime)  # read here, not on an event loop
        self.bundle, self.normalizer = bundle, model.frontend.normalizer_info
        self._frontend, self._service, self._model = model.frontend, service, model

    def _model_context(self) -> ModelContext:
        """Options, shared stores and limits from the settings; the lexicon in Redis when it is configured."""
        s = self.settings
        # lexicon entries live in Redis (shared by replicas) when it is configured, else in this process
        self.lexicon_store = RedisLexiconStore(self.redis_url) if self.redis_url else None
        store = voice_store(s)
        return ModelContext(
            options=runtime_options(s),
            lexicon_store=self.lexicon_store,
            voice_store=store,
            analysis_cache=AnalysisCache(self.redis_url, ttl_s=s.cache_ttl_s),
            mel_variant=s.engine_profile.prompt_mel_variant,
            max_voices=s.max_voices,
            reserved_voice_names=self.reserved_voice_names,
            engine_loader=self.engine_loader,
        )

    def close(self) -> None:
        """Refuse new work, cancel running jobs, stop the engine and close the stores (blocking; a background load
        is waited for first, so what it loaded is closed too)."""
        self.closing = True
        if self._loader is not None:
            self._loader.join()
        gc.unfreeze()  # what this runtime held may now be collected
        service = self._service
        if service is not None:
            service.close()  # its jobs cancelled, its workers stopped, then the model (engine and voice stores) closed
            service.cache.close()
        if self.lexicon_store is not None:
            self.lexicon_store.close()

    # ---- what transports use ------------------------------------------------------------------
    def _ready(self, part: T | None) -> T:
        """A loaded part; NotReadyError while loading, ShuttingDownError once closing."""
        if self.closing:
            raise ShuttingDownError("the service is shutting down")
        if part is None:
            raise NotReadyError("the model is still loading")
        return part

    @property
    def service(self) -> TTSService:
        """The synthesis service; NotReadyError while loading, ShuttingDownError once closing."""
        return self._ready(self._service)

    @service.setter
    def service(self, value: TTSService) -> None:
        self._service = value

    @property
    def loaded_service(self) -> TTSService | None:
        """The service if one is loaded (closing or not), for shutdown and status pages."""
        return self._service

    @property
    def model(self) -> Model:
        """The loaded model; NotReadyError while loading, ShuttingDownError once closing."""
        return self._ready(self._model)

    @property
    def voices(self) -> VoiceLibrary:
        """Prompt analysis and saved voices; NotReadyError while loading, ShuttingDownError once closing."""
        return self.model.voices

    @property
    def frontend(self) -> TextFrontend:
        return self._ready(self._frontend)

    @frontend.setter
    def frontend(self, value: TextFrontend) -> None:
        self._frontend = value

    def check_room(self) -> None:
        """Raise what `claim` would raise now (NotReadyError, ShuttingDownError, OverloadedError), taking nothing: a
        transport refuses a request it cannot serve before reading its body or opening its session."""
        service = self.service
        with self._lock:
            self._check_room(service)

    def claim(self) -> Slot:
        """One in-flight place for a synthesis request whose input has arrived; NotReadyError / ShuttingDownError, or
        the service's OverloadedError (503 + Retry-After) while every place is taken or its queue is full.

        Places count requests from the moment their input is in (an HTTP body read, a WebSocket sentence to speak) to
        their end, across every transport of this runtime; a client still sending, or idle, holds none.
        """
        service = self.service
        with self._lock:
            self._check_room(service)
            self._in_flight += 1
        return Slot(self)

    def _check_room(self, service: TTSService) -> None:
        if self._in_flight >= service.capacity or service.queue_full():
            raise service.overloaded()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1


def _check_default_speaker(name: str, model: Model) -> None:
    """TTS_DEFAULT_SPEAKER names a built-in speaker or a saved voice. A name that is neither stops a model with built-in
    speakers (a typo); a model without any (CosyVoice2-0.5B as it ships) starts, with a warning: requests that name no
    voice are refused until a voice of that name is saved."""
    if name in model.speakers or model.voices.resolve(name) is not None:
        return
    if model.speakers:
        model.close()
        raise BundleError(f"TTS_DEFAULT_SPEAKER {_no_such_voice(name, model.speakers)}")
    log.warning("the model has no built-in speakers and TTS_DEFAULT_SPEAKER %r is not a saved voice (yet): requests "
                "that name no voice answer 400 until a voice of that name is saved (POST /v1/voices)", name)  # fmt: skip


def voice_aliases(configured: Mapping[str, str], speakers: Sequence[str]) -> dict[str, str]:
    """OpenAI voice name -> what it speaks as: TTS_VOICE_ALIASES over the defaults whose speaker the bundle has."""
    defaults = {name: speaker for name, speaker in OPENAI_VOICES.items() if speaker in speakers}
    return defaults | {name.lower(): target for name, target in configured.items()}


def _warn_unknown_targets(configured: Mapping[str, str], speakers: Sequence[str], voices: VoiceLibrary) -> None:
    """A warning per alias whose target is no built-in speaker and no saved voice yet (it may be saved later)."""
    for name, target in configured.items():
        if target in speakers:
            continue
        try:
            found = voices.store.get(target) is not None
        except TTSError:  # the store (Redis) is down at start: the alias is checked when it is used
            continue
        if not found:
            log.warning("TTS_VOICE_ALIASES: %s=%s names neither a built-in speaker (%s) nor a saved voice; requests "
                        "for %r answer unknown_speaker until a voice named %r is saved", name, target,
                        ", ".join(speakers), name, target)  # fmt: skip


class Slot:
    """An in-flight place taken by `Runtime.claim`; `release()` gives it back (idempotent)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime: Runtime | None = runtime

    def release(self) -> None:
        if self._runtime is not None:
            self._runtime._release()
            self._runtime = None
