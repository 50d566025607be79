"""Fun-CosyVoice3-0.5B assembled from its bundle: text frontend over the Qwen2 BPE, the cached streaming engine, voices."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, cast

from service.bundle import Capabilities, ModelBundle
from service.engine.footprint import Footprint
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, SynthesisOptions
from service.errors import BundleError, SettingError
from service.families.cosyvoice3 import contract
from service.families.cosyvoice3.engine import CosyVoice3Engine
from service.families.cosyvoice3.voice import Voice3
from service.families.cosyvoice3.voices import Voices3, v3_voice
from service.families.model import ModelContext, ModelVoice, VoiceReference
from service.families.voices import neutral_embedding, unknown_voice
from service.frontend import TextFrontend
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import MemoryVoiceStore


class V3Engine(Protocol):
    """What the model needs of its engine: CosyVoice3Engine, or a test's or benchmark's wrapper around one."""

    @property
    def sample_rate(self) -> int: ...

    def synthesize(
        self, sentences: Sequence[Sequence[int]], voice: Voice3, options: SynthesisOptions, cancel: threading.Event | None
    ) -> Iterator[AudioChunk]: ...


def load_engine(bundle: ModelBundle, runtime: RuntimeOptions) -> CosyVoice3Engine:
    """The family's own engine: Qwen2 LLM on the batching scheduler, the DiT flow from its caches, the causal HiFT."""
    return CosyVoice3Engine.load(bundle, runtime)


class CosyVoice3Model:
    """One loaded CosyVoice3 bundle; thread-safe (the engine and the voices lock what they share).

    The released checkpoint has no built-in speakers: requests name a saved voice or send a prompt recording, and the
    probes run with `warmup_voice`. The 26 instructions it was trained with are `instruct_presets` (any text works)."""

    family = contract.FAMILY
    instruct_presets = contract.INSTRUCT_PRESETS

    def __init__(self, bundle: ModelBundle, frontend: TextFrontend, engine: V3Engine, voices: Voices3) -> None:
        self.bundle = bundle
        self._frontend = frontend
        self.engine = engine
        self._voices = voices
        self._speakers = {name: Voice3.builtin(name, e, voices.system_ids) for name, e in bundle.speakers.items()}

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
    def voices(self) -> Voices3:
        return self._voices

    def voice(self, speaker: str) -> Voice3:
        found = self._speakers.get(speaker)
        if found is None:
            raise unknown_voice(speaker, self.speakers, saved=False)
        return found

    def resolve(self, reference: VoiceReference) -> Voice3:
        """A built-in speaker or saved voice by name, a one-off prompt (zero-shot with a transcript, cross-lingual
        without), or either speaking as an instruction says (instruct2)."""
        return self._voices.voice_for(reference, self.speakers, self.voice)

    def state_budget(self) -> StateBudget | None:
        """The engine's bound on the streams' DiT caches (None for a test's engine without one)."""
        budget = getattr(self.engine, "state_budget", None)
        return budget if isinstance(budget, StateBudget) else None

    def footprint(self, sentences: Sequence[Sequence[int]], voice: ModelVoice, options: SynthesisOptions) -> Footprint | None:
        """The most a request of `sentences` (text ids) in `voice` holds at once; None for an engine that states none."""
        bound = getattr(self.engine, "request_footprint", None)
        if bound is None:
            return None
        found: Footprint = bound(v3_voice(voice), [len(s) for s in sentences], options)
        return found

    def worst_footprint(self, options: SynthesisOptions) -> Footprint | None:
        """What one request may hold at the bounds `options` set; None for an engine that states none."""
        worst = getattr(self.engine, "worst_footprint", None)
        return None if worst is None else cast(Footprint, worst(options))

    def cache_bytes(self) -> dict[str, int]:
        """Bytes the streams' DiT caches hold now (reserved in the engine's budget)."""
        budget = self.state_budget()
        return {"flow": budget.used} if budget is not None else {}

    def warmup_voice(self) -> Voice3:
        """The first built-in speaker; without any (the official checkpoint), a neutral voice: a unit x-vector and no
        prompt (the system prompt and its marker in front of the text), which runs every graph the requests run."""
        if self._speakers:
            return next(iter(self._speakers.values()))
        return Voice3.builtin("warm-up", neutral_embedding(self.bundle.constants.spk_embed_dim), self._voices.system_ids)

    def synthesize(
        self, sentences: list[list[int]], voice: ModelVoice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        return self.engine.synthesize(sentences, v3_voice(voice), options, cancel)

    def close(self) -> None:
        """Stop the engine's scheduler thread (if it has one), then close the voice store and analysis cache."""
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            close_engine()
        self._voices.close()


def check_options(bundle: ModelBundle, runtime: RuntimeOptions) -> None:
    """SettingError for what the v3 engine cannot do: a first streamed hop under one token."""
    hop = runtime.first_hop_tokens
    if hop is not None and hop < 1:
        raise SettingError(f"must be at least 1 for CosyVoice3, got {hop}", param="first_hop_tokens")


def load_model(bundle: ModelBundle, context: ModelContext) -> CosyVoice3Model:
    """Frontend (the bundle's Qwen2 BPE on tiktoken), engine (the context's loader, else CosyVoice3Engine), voices."""
    if bundle.family != contract.FAMILY:
        raise BundleError(f"{bundle.root}: not a CosyVoice3 bundle (family {bundle.family!r})")
    check_options(bundle, context.options)
    tokenizer = Qwen2Tokenizer.load(bundle.file(contract.TOKENIZER_NAME), cache_dir=context.options.compiled_cache_dir)
    frontend = TextFrontend.load(tokenizer, lexicon_store=context.lexicon_store)
    engine = cast(V3Engine, (context.engine_loader or load_engine)(bundle, context.options))
    voices = Voices3.load(
        bundle,
        frontend,
        context.voice_store or MemoryVoiceStore(),
        context.analysis_cache or AnalysisCache(None),
        context.options,
        analyze=context.prompt_analysis,
        max_voices=context.max_voices,
        reserved_names=context.reserved_voice_names,
    )
    return CosyVoice3Model(bundle, frontend, engine, voices)
