"""The transport-neutral application: settings -> bundle, frontend, engine, caches, stores and admission, shared by
the HTTP app, the gRPC server and the CLI."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from service.access import ApiKeys, ClientIdentity, Gate
from service.bundle import ModelBundle
from service.engine.memory import StateBudget, memory_limit, resident_bytes
from service.engine.options import EngineLevers, RuntimeOptions, SessionOptions
from service.errors import NotReadyError, SettingError, ShuttingDownError, TTSError
from service.families.model import EngineLoader, Model, ModelContext, VoiceLibrary
from service.families.registry import check_options, open_bundle
from service.frontend import TextFrontend
from service.frontend.lexicon import InMemoryLexiconStore, LexiconStore
from service.memory_plan import MemoryPlan
from service.served import QueueTotals, ServedModel, ServedModels, check_distinct, load_served, no_such_voice
from service.settings import Settings
from service.speech.job import SynthesisObserver
from service.speech.service import TTSService
from service.stores.analysis_cache import AnalysisCache
from service.stores.audio_cache import AudioCache, CacheStats, build_audio_cache
from service.stores.lexicon import RedisLexiconStore
from service.stores.ratelimit import RateLimiter
from service.stores.voices import DirectoryVoiceStore, RedisVoiceStore, VoiceStore

log = logging.getLogger(__name__)
T = TypeVar("T")
MiB = 1 << 20


def runtime_options(s: Settings) -> RuntimeOptions:
    """The engine's ONNX Runtime options (operator settings) and levers (the engine profile) from the settings."""
    e = s.engine_profile
    sessions = SessionOptions(
        intra_op_threads=s.intra_op_threads,
        inter_op_threads=e.inter_op_threads,
        llm_threads=e.llm_threads,
        acoustic_threads=e.acoustic_threads,
        allow_spinning=e.ort_spinning,
        openvino_shape_cache_entries=s.openvino_shape_cache_entries,
        compiled_cache_dir=s.cache_dir.expanduser() if s.cache_dir is not None else None,
        memory_limit_bytes=memory_limit(s.memory_limit).bytes,
    )
    levers = EngineLevers(
        **{f.name: getattr(e, f.name) for f in dataclasses.fields(EngineLevers)},
    )
    return RuntimeOptions.of(sessions, levers)


def check_settings(settings: Settings) -> None:
    """Refuse at once, before the slow load, settings the models in `settings.model_dirs` cannot honour: SettingError
    naming the field (e.g. a first hop under a family's minimum, a default speaker that is nowhere, two bundles of one
    model id), BundleError for a directory that is no bundle. Reads the manifests, the speakers and (for the default
    speaker) one saved voice; hashes, graphs and whether a saved voice suits a model wait for `Runtime.load`."""
    bundles = [open_bundle(path) for path in settings.model_dirs]
    check_distinct(bundles)
    for bundle in bundles:
        check_options(bundle, runtime_options(settings))
    _check_default_speaker_exists(settings, [name for bundle in bundles for name in bundle.speakers])


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
        raise SettingError(no_such_voice(name, speakers), param="default_speaker")


class Runtime:
    """The served models (their families', from the registry) and everything around them: one audio cache, stores,
    keys, rate limits and one count of in-flight places for all of them. Built cheaply from settings; `load()` does
    the heavy part.

    Thread-safe: transports call `gate`, `claim`, `model_for` from any thread. `service`, `model`, `voices`,
    `frontend` and `bundle` are the first (default) model's. `observer` receives what the synthesis services measure
    (the HTTP app passes its Prometheus metrics).
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
        self._models: ServedModels | None = None
        self.load_states: dict[str, str] = {}  # model id -> waiting, loading or loaded, in TTS_MODEL_DIR's order
        self._totals: QueueTotals | None = None  # the queue gauges' sums over several models' services
        self._budget_watched = False
        self.normalizer: dict[str, str] = {}
        self.model_created = 0  # Unix time the first bundle's manifest was written (OpenAI's `created`)
        self.closing = False
        self.load_error: Exception | None = None  # why a background load failed (`start_loading`)
        self._loader: threading.Thread | None = None
        self._in_flight = 0
        self._lock = threading.Lock()
        self.memory = MemoryPlan(settings)  # the one memory budget of every model's requests

    @property
    def redis_url(self) -> str | None:
        return self.settings.redis_url.get_secret_value() if self.settings.redis_url else None

    @property
    def model_id(self) -> str:
        return self.bundle.manifest.model if self.bundle else ""

    @property
    def model_ids(self) -> tuple[str, ...]:
        """The served models' ids in order (none while loading)."""
        return self._models.ids if self._models is not None else ()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start_loading(self, on_ready: Callable[[], None], on_failure: Callable[[], None]) -> None:
        """Run `load()` on a thread of its own, so the transports answer (liveness, 503 not_ready) while the models
        load. `on_ready` runs on that thread once every model is ready; after a failure, logged and kept in
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
        """Load every bundle (frontend, engine, warm-up with a real synthesis) around one audio cache, in order;
        blocking (minutes at most). The models serve once all of them are loaded; a failure closes those loaded."""
        s = self.settings
        log.info("%s", self.keys.describe(s.public_model_list))
        bundles = self._open_bundles()
        cache = build_audio_cache(self.redis_url, s.cache_max_bytes, s.cache_ttl_s)
        watch_cache: Callable[[CacheStats], None] | None = getattr(self.observer, "watch_cache", None)
        if watch_cache is not None:  # an observer that exports the cache's counters (the HTTP metrics)
            watch_cache(cache.stats)
        # the lexicon entries every model reads: in Redis when it is configured (shared by replicas), else here
        self.lexicon_store = RedisLexiconStore(self.redis_url) if self.redis_url else None
        lexicon: LexiconStore = self.lexicon_store or InMemoryLexiconStore()
        loaded: list[ServedModel] = []
        try:
            for bundle in bundles:
                loaded.append(self._load_one(bundle, bundles, lexicon, cache, len(loaded)))
        except BaseException:
            for served in loaded:
                served.service.close()
            cache.close()
            raise
        # What is loaded now lives until shutdown: keep it out of the cyclic GC, whose full passes over the text
        # frontend's dictionaries (~300k objects, each pass with the GIL held) otherwise stall an event loop.
        gc.collect()
        gc.freeze()
        self.memory.loaded([(m.id, m.model) for m in loaded], resident_bytes())
        watch_memory: Callable[[MemoryPlan, Sequence[ServedModel]], None] | None = getattr(self.observer, "watch_memory", None)
        if watch_memory is not None:
            watch_memory(self.memory, loaded)
        first = loaded[0]
        self.model_created, self.normalizer = first.created, first.frontend.normalizer_info
        self.bundle, self._frontend, self._service, self._model = first.bundle, first.frontend, first.service, first.model
        self._models = ServedModels(loaded)

    def _open_bundles(self) -> list[ModelBundle]:
        """Every bundle TTS_MODEL_DIR names, checked against its family's layout (and hashes when asked); SettingError
        for two of one model id."""
        s = self.settings
        bundles = []
        for path in s.model_dirs:
            log.info("loading the model from %s%s", path, " (checking every file's sha256)" * s.verify_bundle_hashes)
            bundles.append(open_bundle(path, verify_hashes=s.verify_bundle_hashes))
        check_distinct(bundles)
        self.load_states = {b.manifest.model: "waiting" for b in bundles}
        return bundles

    def _load_one(
        self, bundle: ModelBundle, bundles: Sequence[ModelBundle], lexicon: LexiconStore, cache: AudioCache, index: int
    ) -> ServedModel:
        """Load one bundle's model and say how much resident memory it added."""
        s, model_id = self.settings, bundle.manifest.model
        self.load_states[model_id] = "loading"
        before = resident_bytes()
        elsewhere = any(s.default_speaker in b.speakers for b in bundles if b is not bundle) or (
            len(bundles) > 1 and _is_saved(s, s.default_speaker)
        )
        observer = self.observer if len(bundles) == 1 else self._queue_totals().observer_for(index)
        context = self._model_context(lexicon)
        served = load_served(bundle, context, s, cache, observer, default_elsewhere=elsewhere, budget=self.memory.budget)
        watch_budget: Callable[[StateBudget], None] | None = getattr(self.observer, "watch_state_budget", None)
        budget = served.model.state_budget()
        if watch_budget is not None and budget is not None and not self._budget_watched:  # the first model's bound
            watch_budget(budget)
            self._budget_watched = True
        after = resident_bytes()
        self.load_states[model_id] = "loaded"
        log.info("model %s loaded: %+d MB resident (%d MB in all)", model_id, round((after - before) / MiB), after // MiB)
        return served

    def _queue_totals(self) -> QueueTotals:
        """The sum of every model's queue counts, for the observer's one queue gauge (several models only)."""
        if self._totals is None:
            self._totals = QueueTotals(self.observer)
        return self._totals

    def _model_context(self, lexicon: LexiconStore) -> ModelContext:
        """Options, shared stores and limits from the settings; each model gets its own store clients (it closes them)."""
        s = self.settings
        return ModelContext(
            options=runtime_options(s),
            lexicon_store=lexicon,
            voice_store=voice_store(s),
            analysis_cache=AnalysisCache(self.redis_url, ttl_s=s.cache_ttl_s),
            mel_variant=s.engine_profile.prompt_mel_variant,
            max_voices=s.max_voices,
            reserved_voice_names=self.reserved_voice_names,
            engine_loader=self.engine_loader,
        )

    def close(self) -> None:
        """Refuse new work, cancel running jobs, stop the engines and close the stores (blocking; a background load
        is waited for first, so what it loaded is closed too)."""
        self.closing = True
        if self._loader is not None:
            self._loader.join()
        gc.unfreeze()  # what this runtime held may now be collected
        services = [m.service for m in self._models] if self._models is not None else [self._service]
        for service in services:
            if service is not None:
                service.close()  # its jobs cancelled, its workers stopped, then the model (engine and voice stores) closed
        if services and services[0] is not None:
            services[0].cache.close()  # one cache for every model
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
    def models(self) -> ServedModels:
        """The served models in order; NotReadyError while loading, ShuttingDownError once closing."""
        return self._ready(self._models)

    @property
    def loaded_models(self) -> ServedModels | None:
        """The served models once loaded (closing or not), for listings and status pages; None while loading."""
        return self._models

    def model_for(self, name: str | None) -> ServedModel:
        """The served model a request names (`ServedModels.find`: our ids; an OpenAI model name or none means the
        first); UnknownModelError naming the served ids, NotReadyError while loading, ShuttingDownError once closing."""
        return self.models.find(name)

    @property
    def service(self) -> TTSService:
        """The first model's synthesis service; NotReadyError while loading, ShuttingDownError once closing."""
        return self._ready(self._service)

    @service.setter
    def service(self, value: TTSService) -> None:
        self._service = value

    @property
    def loaded_service(self) -> TTSService | None:
        """The first model's service if one is loaded (closing or not), for shutdown and status pages."""
        return self._service

    @property
    def model(self) -> Model:
        """The first loaded model; NotReadyError while loading, ShuttingDownError once closing."""
        return self._ready(self._model)

    @property
    def voices(self) -> VoiceLibrary:
        """The first model's prompt analysis and saved voices; NotReadyError while loading, ShuttingDownError once
        closing."""
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
        the service's OverloadedError (503 + Retry-After) while every place is taken or the queues are full.

        Places count requests from the moment their input is in (an HTTP body read, a WebSocket sentence to speak) to
        their end, across every transport and every model of this runtime; a client still sending, or idle, holds none.
        """
        service = self.service
        with self._lock:
            self._check_room(service)
            self._in_flight += 1
        return Slot(self)

    def _check_room(self, service: TTSService) -> None:
        """Every model's service takes `concurrent_requests + queue_max` jobs; the server as a whole takes that many."""
        services = [m.service for m in self._models] if self._models is not None else [service]
        jobs = sum(sum(s.queue_state()) for s in services)  # admitted: waiting and running
        one_model_full = len(services) == 1 and service.queue_full()  # several: the request's model decides later
        if self._in_flight >= service.capacity or jobs >= service.capacity or one_model_full:
            raise service.overloaded()

    def _release(self) -> None:
        with self._lock:
            self._in_flight -= 1


def _is_saved(s: Settings, name: str) -> bool:
    """Whether a saved voice `name` exists (for any model); False when the store cannot be read now."""
    store = voice_store(s)
    try:
        return store.get(name) is not None
    except TTSError:
        return False
    finally:
        store.close()


class Slot:
    """An in-flight place taken by `Runtime.claim`; `release()` gives it back (idempotent)."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime: Runtime | None = runtime

    def release(self) -> None:
        if self._runtime is not None:
            self._runtime._release()
            self._runtime = None
