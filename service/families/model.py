"""What a model family gives the rest of the service: the Model protocol, its voices, and the Family entry."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from service.bundle import Capabilities, FamilyLayout, ModelBundle
from service.engine.footprint import Footprint
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, SynthesisOptions
from service.errors import BundleError
from service.frontend import TextFrontend
from service.frontend.lexicon import LexiconStore
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import SavedVoice, VoiceStore
from service.verify.checks import Check, VerifyReport


@dataclass(frozen=True)
class PromptAudio:
    """An uploaded prompt recording: an encoded file (wav, flac, mp3, ogg/opus, m4a), or raw int16 mono PCM at
    `pcm_rate_hz` (the official gRPC prompt_audio: 16 kHz)."""

    data: bytes
    pcm_rate_hz: int | None = None

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


@dataclass(frozen=True)
class NamedVoice:
    """A built-in speaker or a saved voice, by name (an alias is followed by the speech service first)."""

    name: str


@dataclass(frozen=True)
class PromptVoice:
    """A one-off voice cloned from a prompt recording: zero-shot with its transcript, cross-lingual without one."""

    prompt: PromptAudio
    transcript: str = ""
    label: str = "prompt"  # the voice's name in logs and timings


@dataclass(frozen=True)
class InstructVoice:
    """The voice `base` (a name, as NamedVoice, or a one-off prompt recording) speaking as `instruction` says: a
    built-in speaker on CosyVoice-300M-Instruct (capability `instruct`), any cloned voice on CosyVoice2 (`instruct2`)."""

    base: str | PromptVoice
    instruction: str


# What a transport hands down as a request's voice. Errors about it name domain fields ("voice", "prompt_audio",
# "prompt_text", "instruction"); each transport renames them to its wire fields once (service.errors.wire_fields).
VoiceReference = NamedVoice | PromptVoice | InstructVoice


class ModelVoice(Protocol):
    """A voice as a family's `synthesize` takes it; only the family that made it reads more than these two."""

    @property
    def name(self) -> str: ...

    @property
    def fingerprint(self) -> str:
        """Names every number the audio depends on (part of the audio cache key)."""
        ...


class Engine(Protocol):
    """Synthesis: built-in voices and sentences of text ids -> self-describing audio chunks."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def speakers(self) -> Sequence[str]: ...

    def voice(self, speaker: str) -> ModelVoice:
        """The built-in speaker `speaker` (UnknownSpeakerError when there is none of that name)."""
        ...

    def synthesize(
        self, sentences: list[list[int]], voice: ModelVoice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        """Validation errors raised by the call; the generator does the work and ends early once `cancel` is set."""
        ...


class VoiceLibrary(Protocol):
    """Voices beyond the built-in speakers: prompt analysis, saved voices, instruct. Blocking: call off event loops."""

    @property
    def store(self) -> VoiceStore: ...

    @property
    def cache(self) -> AnalysisCache: ...

    @property
    def max_voices(self) -> int: ...

    @property
    def can_clone(self) -> bool: ...

    @property
    def can_instruct(self) -> bool: ...

    def prompt_voice(self, prompt: PromptAudio, transcript: str = "", *, name: str = "prompt") -> ModelVoice: ...

    def instruct_voice(self, base: ModelVoice, instruct_text: str) -> ModelVoice: ...

    def save(self, name: str, prompt: PromptAudio, transcript: str = "") -> SavedVoice: ...

    def saved(self, name: str) -> SavedVoice: ...

    def delete(self, name: str) -> None: ...

    def resolve(self, name: str) -> ModelVoice | None:
        """The saved voice `name` as `synthesize` takes it, or None."""
        ...

    def usable(self, voice: SavedVoice) -> bool:
        """False for a voice another model's prompt models analysed (a store shared with another family or bundle)."""
        ...


class Model(Engine, Protocol):
    """One loaded model of a family: what transports, speech and the CLI may use of it."""

    @property
    def family(self) -> str: ...

    @property
    def model_id(self) -> str: ...

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def frontend(self) -> TextFrontend: ...

    @property
    def voices(self) -> VoiceLibrary: ...

    @property
    def instruct_presets(self) -> Sequence[str]:
        """Instructions the model was trained with, for clients to offer (empty: none named; a model that takes
        instructions takes any text)."""
        ...

    def resolve(self, reference: VoiceReference) -> ModelVoice:
        """The family's voice for `reference` (UnknownSpeakerError for a name that is neither a built-in speaker nor a
        saved voice). Reads the voice store and may analyse a recording: blocking, call it off event loops."""
        ...

    def warmup_voice(self) -> ModelVoice:
        """A voice that runs every stage, for the warm-up and readiness probes of a model whose default speaker is not
        built in (a bundle without built-in speakers: CosyVoice2-0.5B as it ships)."""
        ...

    def state_budget(self) -> StateBudget | None:
        """The bound on what its streams' growing state holds at once (CosyVoice2: the flow caches), for the
        metrics; None for a model whose streams keep no such state."""
        ...

    def footprint(self, sentences: Sequence[Sequence[int]], voice: ModelVoice, options: SynthesisOptions) -> Footprint | None:
        """The most a request of `sentences` (text ids) in `voice` holds in memory at once, by part (what admission
        reserves); None for a model that states none."""
        ...

    def worst_footprint(self, options: SynthesisOptions) -> Footprint | None:
        """What one request may hold at the bounds `options` set (the longest prompt and sentence): the per-stream
        worst case the start-up log states; None for a model that states none."""
        ...

    def cache_bytes(self) -> dict[str, int]:
        """Bytes its caches hold now, by kind (flow, prompt, llm_kv), for /metrics."""
        ...

    def close(self) -> None:
        """Stop the model's threads and close its stores (blocking)."""
        ...


# Builds a family's engine (the family's own engine type, or a test's or benchmark's wrapper with its methods).
EngineLoader = Callable[[ModelBundle, RuntimeOptions], object]


@dataclass(frozen=True)
class ModelContext:
    """What a family builds a model with besides its bundle: options, shared stores, limits.

    The stores default to this process only (no saved voice survives it), which suits the CLI and benchmarks.
    """

    options: RuntimeOptions = field(default_factory=RuntimeOptions)
    lexicon_store: LexiconStore | None = None  # None: the lexicon lives in this process
    voice_store: VoiceStore | None = None
    analysis_cache: AnalysisCache | None = None
    mel_variant: str = "trained"  # settings.prompt_mel_variant (a family that has one variant ignores it)
    max_voices: int = 100
    reserved_voice_names: tuple[str, ...] = ()
    prompt_analysis: bool = True  # open the bundle's prompt models (voice cloning); `service synth` does without
    engine_loader: EngineLoader | None = None  # None: the family's own engine


ModelLoader = Callable[[ModelBundle, ModelContext], Model]
# Refuses (SettingError) runtime options the family's engine cannot honour with this bundle; cheap, opens no graph.
OptionsCheck = Callable[[ModelBundle, RuntimeOptions], None]
Verifier = Callable[[ModelBundle, Path, RuntimeOptions | None, Callable[[Check], None] | None], VerifyReport]


@dataclass(frozen=True)
class Family:
    """A model family as the registry knows it: its manifest name, how it is served and how it is verified."""

    name: str
    layout: FamilyLayout  # what its bundles hold (checked before a bundle is served or verified)
    verify: Verifier  # replays the official implementation's fixtures (`python -m service verify`)
    load: ModelLoader | None = None  # None: the family is verified, not served yet
    check: OptionsCheck | None = None  # None: every option within the settings' bounds is fine
    engine: EngineLoader | None = None  # its own engine, as `load` builds it (tools wrap it through ModelContext)

    def load_engine(self, bundle: ModelBundle, options: RuntimeOptions) -> object:
        """The family's own engine for `bundle` (BundleError for a family that is not served)."""
        if self.engine is None:
            raise BundleError(f"model family {self.name!r} has no engine to serve with")
        return self.engine(bundle, options)

    def check_bundle(self, bundle: ModelBundle) -> None:
        """Refuse (BundleError) a bundle that is not laid out as this family's bundles are."""
        self.layout.check(bundle.manifest, bundle.root)
