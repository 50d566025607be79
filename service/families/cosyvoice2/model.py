"""CosyVoice2-0.5B assembled from its bundle: text frontend over the Qwen2 BPE, the cached streaming engine, voices."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, cast

from service.bundle import Capabilities, ModelBundle
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, SynthesisOptions
from service.errors import BundleError, SettingError
from service.families.cosyvoice2 import contract
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.families.cosyvoice2.voices import Voices2, v2_voice
from service.families.model import ModelContext, ModelVoice, VoiceReference
from service.families.voices import neutral_embedding, unknown_voice
from service.frontend import TextFrontend
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.stores.voices import AnalysisCache, MemoryVoiceStore


class V2Engine(Protocol):
    """What the model needs of its engine: CosyVoice2Engine, or a test's or benchmark's wrapper around one."""

    @property
    def sample_rate(self) -> int: ...

    def synthesize(
        self, sentences: Sequence[Sequence[int]], voice: Voice2, options: SynthesisOptions, cancel: threading.Event | None
    ) -> Iterator[AudioChunk]: ...


def load_engine(bundle: ModelBundle, runtime: RuntimeOptions) -> CosyVoice2Engine:
    """The family's own engine: Qwen2 LLM on the batching scheduler, cached chunk-causal flow, HiFT at 24 kHz."""
    return CosyVoice2Engine.load(bundle, runtime)


class CosyVoice2Model:
    """One loaded CosyVoice2 bundle; thread-safe (the engine and the voices lock what they share).

    Built-in speakers exist only when the checkpoint had a spk2info.pt (the official release has none): requests
    then name a saved voice or send a prompt recording, and the probes run with `warmup_voice`.
    """

    family = contract.FAMILY
    instruct_presets: tuple[str, ...] = ()

    def __init__(self, bundle: ModelBundle, frontend: TextFrontend, engine: V2Engine, voices: Voices2) -> None:
        self.bundle = bundle
        self._frontend = frontend
        self.engine = engine
        self._voices = voices
        self._speakers = {name: Voice2.builtin(name, e) for name, e in bundle.speakers.items()}

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
    def voices(self) -> Voices2:
        return self._voices

    def voice(self, speaker: str) -> Voice2:
        found = self._speakers.get(speaker)
        if found is None:
            raise unknown_voice(speaker, self.speakers, saved=False)
        return found

    def resolve(self, reference: VoiceReference) -> Voice2:
        """A spk2info speaker or saved voice by name, a one-off prompt (zero-shot with a transcript, cross-lingual
        without), or either speaking as an instruction says (instruct2)."""
        return self._voices.voice_for(reference, self.speakers, self.voice)

    def state_budget(self) -> StateBudget | None:
        """The engine's bound on the streams' flow caches (None for a test's engine without one)."""
        budget = getattr(self.engine, "state_budget", None)
        return budget if isinstance(budget, StateBudget) else None

    def warmup_voice(self) -> Voice2:
        """The first built-in speaker; without any (the official checkpoint), a neutral voice: a unit x-vector and no
        prompt, which runs every graph the requests run."""
        if self._speakers:
            return next(iter(self._speakers.values()))
        dim = self.bundle.constants.spk_embed_dim
        return Voice2.builtin("warm-up", neutral_embedding(dim))

    def synthesize(
        self, sentences: list[list[int]], voice: ModelVoice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        return self.engine.synthesize(sentences, v2_voice(voice), options, cancel)

    def close(self) -> None:
        """Stop the engine's scheduler thread (if it has one), then close the voice store and analysis cache."""
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            close_engine()
        self._voices.close()


def check_options(bundle: ModelBundle, runtime: RuntimeOptions) -> None:
    """SettingError for what the v2 engine cannot do: a first streamed hop under one token (the chunk-causal flow
    solves any first hop from its caches: no overlap to keep, unlike v1)."""
    hop = runtime.first_hop_tokens
    if hop is not None and hop < 1:
        raise SettingError(f"must be at least 1 for CosyVoice2, got {hop}", param="first_hop_tokens")


def load_model(bundle: ModelBundle, context: ModelContext) -> CosyVoice2Model:
    """Frontend (the bundle's Qwen2 BPE on tiktoken), engine (the context's loader, else CosyVoice2Engine), voices."""
    if bundle.family != contract.FAMILY:
        raise BundleError(f"{bundle.root}: not a CosyVoice2 bundle (family {bundle.family!r})")
    check_options(bundle, context.options)
    tokenizer = Qwen2Tokenizer.load(bundle.file(contract.TOKENIZER_NAME), cache_dir=context.options.compiled_cache_dir)
    frontend = TextFrontend.load(tokenizer, lexicon_store=context.lexicon_store)
    engine = cast(V2Engine, (context.engine_loader or load_engine)(bundle, context.options))
    voices = Voices2.load(
        bundle,
        frontend,
        context.voice_store or MemoryVoiceStore(),
        context.analysis_cache or AnalysisCache(None),
        context.options,
        analyze=context.prompt_analysis,
        max_voices=context.max_voices,
        reserved_names=context.reserved_voice_names,
    )
    return CosyVoice2Model(bundle, frontend, engine, voices)
