"""The models one server serves, in TTS_MODEL_DIR's order: each bundle's model, voices, frontend and synthesis service
(`ServedModel`), loaded by `load_served`, and found by id (`ServedModels.find`; the first is the default)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from service.bundle import Capabilities, ModelBundle
from service.engine.memory import StreamBudget
from service.engine.runtimes import native_kernels_note
from service.errors import BundleError, SettingError, TTSError, UnknownModelError
from service.families.model import Model, ModelContext, VoiceLibrary
from service.families.registry import load_model
from service.frontend import TextFrontend
from service.settings import OPENAI_VOICES, Settings
from service.speech.job import SpeechTimings, SynthesisObserver
from service.speech.service import TTSService
from service.stores.audio_cache import AudioCache

log = logging.getLogger(__name__)

# OpenAI's speech model names: each means the default model (the first served), as does a request that names none.
OPENAI_MODEL_ALIASES = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts", "gpt-4o-mini-tts-2025-12-15")
MAX_SHOWN_NAME = 64  # characters of a requested model name quoted back in an error


@dataclass(frozen=True)
class ServedModel:
    """One served bundle: its family's model (engine, frontend, voices) and the synthesis service over it."""

    bundle: ModelBundle
    model: Model
    service: TTSService
    created: int  # Unix time its manifest was written (OpenAI's `created`)

    @property
    def id(self) -> str:
        return self.bundle.manifest.model

    @property
    def family(self) -> str:
        return self.bundle.family

    @property
    def capabilities(self) -> Capabilities:
        return self.bundle.capabilities

    @property
    def frontend(self) -> TextFrontend:
        return self.model.frontend

    @property
    def voices(self) -> VoiceLibrary:
        """Prompt analysis and saved voices as this model speaks them (`usable` says which saved voices it can)."""
        return self.model.voices


class ServedModels(Sequence[ServedModel]):
    """The served models in TTS_MODEL_DIR's order (never empty); the first is the default."""

    def __init__(self, models: Sequence[ServedModel]) -> None:
        if not models:
            raise ValueError("a server serves at least one model")
        self._models = tuple(models)

    def __getitem__(self, index: int) -> ServedModel:  # type: ignore[override]
        return self._models[index]

    def __len__(self) -> int:
        return len(self._models)

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models)

    @property
    def first(self) -> ServedModel:
        return self._models[0]

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(m.id for m in self._models)

    def find(self, name: str | None) -> ServedModel:
        """The model a request names: one of our ids; an OpenAI model name, or none (None, ""), means the first.
        UnknownModelError (param `model`) naming the served ids for anything else."""
        if not name or name in OPENAI_MODEL_ALIASES:
            return self.first
        for served in self._models:
            if served.id == name:
                return served
        raise unknown_model(name, self.ids)

    def of_family(self, family: str) -> ServedModel | None:
        """The first served model of `family` (a manifest's family name), None when none is."""
        return next((m for m in self._models if m.family == family), None)


def unknown_model(name: str, ids: Sequence[str]) -> UnknownModelError:
    """The error for a model name no served model has. The ids come first: a WebSocket close reason (123 bytes)
    keeps the beginning of the message."""
    shown = repr(name) if len(name) <= MAX_SHOWN_NAME else f"{name[:MAX_SHOWN_NAME]!r}…"
    return UnknownModelError(
        f"use one of: {', '.join(ids)} (an OpenAI model name, or none, means {ids[0]}); {shown} is not served here",
        param="model",
    )


def check_distinct(bundles: Sequence[ModelBundle]) -> None:
    """Refuse (SettingError naming TTS_MODEL_DIR) two bundles that would be served under the same model id."""
    seen: dict[str, ModelBundle] = {}
    for bundle in bundles:
        earlier = seen.setdefault(bundle.manifest.model, bundle)
        if earlier is not bundle:
            raise SettingError(
                f"{earlier.root} and {bundle.root} are both the model {bundle.manifest.model!r}; each bundle is served "
                "under its manifest's model id, so every id may be served once",
                param="model_dir",
            )


def load_served(
    bundle: ModelBundle,
    context: ModelContext,
    settings: Settings,
    cache: AudioCache,
    observer: SynthesisObserver,
    *,
    default_elsewhere: bool = False,
    budget: StreamBudget | None = None,
) -> ServedModel:
    """Load `bundle`'s model and its synthesis service, then warm it up with a real synthesis (blocking; minutes at
    most). `default_elsewhere`: TTS_DEFAULT_SPEAKER is a voice of another served model, so one that is not this
    model's is a warning, not an error. `budget`: the process's memory budget its requests reserve in."""
    s = settings
    log.info("%s (%s): building the text frontend, then opening the graphs", bundle.manifest.model, bundle.family)
    model = load_model(bundle, context)
    _check_default_speaker(s.default_speaker, model, default_elsewhere)
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
        observer=observer,
        probe_voice=None if s.default_speaker in model.speakers else model.warmup_voice(),
        default_voice=s.default_speaker,
        max_speech_s=s.max_speech_s,
        max_sentence_speech_s=s.max_sentence_speech_s,
        admission=s.admission,
        budget=budget,
    )
    log.info("model %s: graphs opened; warming up with a real synthesis", bundle.manifest.model)
    try:
        service.probe(s.warmup_text, s.default_speaker)
    except BaseException:
        service.close()  # its workers and the model's threads: a failed start leaves nothing running
        raise
    log.info("model %s loaded from %s: %d speakers, cache %s; ready", bundle.manifest.model, bundle.root,
             len(bundle.speakers), cache.backend)  # fmt: skip
    if bundle.manifest.warning:
        log.warning("%s", bundle.manifest.warning)
    native_note = native_kernels_note(bundle, context.options)
    if native_note:
        log.info("%s", native_note)
    created = int((bundle.root / "manifest.json").stat().st_mtime)  # read here, not on an event loop
    return ServedModel(bundle, model, service, created)


def no_such_voice(name: str, speakers: Sequence[str]) -> str:
    """Why TTS_DEFAULT_SPEAKER `name` cannot be served by a model with built-in `speakers` (before or at the load)."""
    return f"{name!r} is neither a built-in speaker nor a saved voice; the bundle has {', '.join(speakers)}"


def _check_default_speaker(name: str, model: Model, elsewhere: bool) -> None:
    """TTS_DEFAULT_SPEAKER names a built-in speaker or a saved voice. A name that is neither stops a model with built-in
    speakers (a typo) unless another served model speaks it; a model without any (CosyVoice2-0.5B as it ships) starts,
    with a warning: requests that name no voice are refused until a voice of that name is saved."""
    if name in model.speakers or model.voices.resolve(name) is not None:
        return
    if model.speakers and not elsewhere:
        model.close()
        raise BundleError(f"TTS_DEFAULT_SPEAKER {no_such_voice(name, model.speakers)}")
    if model.speakers:
        log.warning("TTS_DEFAULT_SPEAKER %r is another served model's voice, not one of %s (%s): requests to it that "
                    "name no voice answer 400", name, model.model_id, ", ".join(model.speakers))  # fmt: skip
        return
    log.warning("the model %s has no built-in speakers and TTS_DEFAULT_SPEAKER %r is not a saved voice (yet): requests "
                "that name no voice answer 400 until a voice of that name is saved (POST /v1/voices)", model.model_id,
                name)  # fmt: skip


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


class QueueTotals:
    """The queue gauges of one server whose models each have a synthesis service: every service reports its own
    (waiting, running) through `observer_for`; the observer sees their sums (its gauges hold one value each)."""

    def __init__(self, observer: SynthesisObserver) -> None:
        self.observer = observer
        self._counts: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def observer_for(self, index: int) -> SynthesisObserver:
        """What the service of the model at `index` reports to."""
        return _ModelObserver(self, index)

    def changed(self, index: int, waiting: int, running: int) -> None:
        with self._lock:
            self._counts[index] = (waiting, running)
            total_waiting = sum(w for w, _ in self._counts.values())
            total_running = sum(r for _, r in self._counts.values())
        self.observer.queue_changed(total_waiting, total_running)


class _ModelObserver(SynthesisObserver):
    """One model's service's observer: queue counts go to the totals, everything else to the server's observer."""

    def __init__(self, totals: QueueTotals, index: int) -> None:
        self._totals, self._index, self._inner = totals, index, totals.observer

    def queue_changed(self, waiting: int, running: int) -> None:
        self._totals.changed(self._index, waiting, running)

    def first_chunk(self, seconds: float) -> None:
        self._inner.first_chunk(seconds)

    def chunk_done(self) -> None:
        self._inner.chunk_done()

    def finished(self, timings: SpeechTimings) -> None:
        self._inner.finished(timings)

    def cancelled(self) -> None:
        self._inner.cancelled()

    def request_done(self, transport: str, route: str, status: str, seconds: float) -> None:
        self._inner.request_done(transport, route, status, seconds)
