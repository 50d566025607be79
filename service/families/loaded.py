"""What every family's loaded model does the same way: the Model protocol over a bundle, a frontend, an engine and a
voice library. A family subclasses LoadedModel and says how a voice becomes its own and what its warm-up voice is."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Generic, Protocol, TypeVar

from service.bundle import Capabilities, ModelBundle
from service.engine.footprint import Footprint
from service.engine.memory import StateBudget
from service.engine.types import AudioChunk, SynthesisOptions
from service.families.model import ModelVoice, VoiceLibrary, VoiceReference
from service.families.voices import neutral_embedding, unknown_voice
from service.frontend import TextFrontend

V = TypeVar("V", bound=ModelVoice)
V_contra = TypeVar("V_contra", contravariant=True)


class VoiceEngine(Protocol[V_contra]):
    """What a model needs of its engine (the family's own, or a test's or benchmark's wrapper around it)."""

    @property
    def sample_rate(self) -> int: ...

    def synthesize(
        self, sentences: Sequence[Sequence[int]], voice: V_contra, options: SynthesisOptions, cancel: threading.Event | None
    ) -> Iterator[AudioChunk]: ...


class VoiceResolver(VoiceLibrary, Protocol[V]):
    """A family's voice library: the protocol's VoiceLibrary, and turning a reference into the family's voice."""

    def voice_for(self, reference: VoiceReference, speakers: Sequence[str], speaker: Callable[[str], V]) -> V: ...

    def close(self) -> None: ...


class LoadedModel(ABC, Generic[V]):
    """One loaded bundle of a family, thread-safe (the engine and the voices lock what they share). Built-in speakers
    are the bundle's speaker table, made into the family's voices by `builtin_voice`."""

    family: str
    instruct_presets: tuple[str, ...] = ()  # instructions the model was trained with (/info lists them; any text works)

    def __init__(self, bundle: ModelBundle, frontend: TextFrontend, engine: VoiceEngine[V], voices: VoiceResolver[V]) -> None:
        self.bundle = bundle
        self._frontend = frontend
        self.engine = engine
        self._voices = voices
        self._speakers: Mapping[str, V] = {name: self.builtin_voice(name, e) for name, e in bundle.speakers.items()}

    @abstractmethod
    def builtin_voice(self, name: str, embedding: object) -> V:
        """The family's voice of a built-in speaker (or of the neutral warm-up x-vector) with this embedding."""

    @abstractmethod
    def own(self, voice: ModelVoice) -> V:
        """`voice` as this family's engine takes it (InvalidInputError for another family's voice)."""

    @property
    def model_id(self) -> str:
        return self.bundle.manifest.model

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def speakers(self) -> Sequence[str]:
        return tuple(self._speakers)

    @property
    def capabilities(self) -> Capabilities:
        return self.bundle.capabilities

    @property
    def frontend(self) -> TextFrontend:
        return self._frontend

    @property
    def voices(self) -> VoiceResolver[V]:
        return self._voices

    def voice(self, speaker: str) -> V:
        found = self._speakers.get(speaker)
        if found is None:
            raise unknown_voice(speaker, self.speakers, saved=False)
        return found

    def resolve(self, reference: VoiceReference) -> V:
        """A built-in speaker or saved voice by name, a one-off prompt, or either styled by an instruction."""
        return self._voices.voice_for(reference, self.speakers, self.voice)

    def warmup_voice(self) -> V:
        """The first built-in speaker; without any, a neutral voice (a unit x-vector and no prompt) that runs every graph
        the requests run."""
        if self._speakers:
            return next(iter(self._speakers.values()))
        return self.builtin_voice("warm-up", neutral_embedding(self.bundle.constants.spk_embed_dim))

    def synthesize(
        self, sentences: list[list[int]], voice: ModelVoice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        return self.engine.synthesize(sentences, self.own(voice), options, cancel)

    def footprint(self, sentences: Sequence[Sequence[int]], voice: ModelVoice, options: SynthesisOptions) -> Footprint | None:
        """The most a request of `sentences` (text ids) in `voice` holds at once; None for an engine that states none."""
        bound = getattr(self.engine, "request_footprint", None)
        if bound is None:
            return None
        found: Footprint = bound(self.own(voice), [len(s) for s in sentences], options)
        return found

    def worst_footprint(self, options: SynthesisOptions) -> Footprint | None:
        """What one request may hold at the bounds `options` set; None for an engine that states none."""
        worst = getattr(self.engine, "worst_footprint", None)
        return None if worst is None else worst(options)

    def cache_bytes(self) -> dict[str, int]:
        """Bytes the engine's caches hold now, by kind (flow, prompt, llm_kv); empty for an engine that says none."""
        held = getattr(self.engine, "cache_bytes", None)
        return {} if held is None else dict(held())

    def state_budget(self) -> StateBudget | None:
        """The engine's bound on its streams' growing state (None for an engine that keeps none)."""
        budget = getattr(self.engine, "state_budget", None)
        return budget if isinstance(budget, StateBudget) else None

    def close(self) -> None:
        """Stop the engine's scheduler thread (if it has one), then close the voice store and analysis cache."""
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            close_engine()
        self._voices.close()
