"""CosyVoice-300M (-SFT, -Instruct) assembled from its bundle: text frontend, ONNX synthesizer and voices."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Protocol, cast, get_args

from service.bundle import Capabilities, ModelBundle
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.types import AudioChunk, SynthesisOptions
from service.errors import BundleError, SettingError
from service.families.cosyvoice1 import contract
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.streaming import default_first_hop
from service.families.cosyvoice1.voice import Voice
from service.families.cosyvoice1.voices import Voices, v1_voice
from service.families.model import ModelContext, ModelVoice, VoiceReference
from service.families.voices import neutral_embedding
from service.frontend import TextFrontend
from service.layers.prompt import MelVariant
from service.stores.voices import AnalysisCache, MemoryVoiceStore


class V1Engine(Protocol):
    """What the model needs of its engine: Synthesizer, or a test's wrapper around one."""

    @property
    def sample_rate(self) -> int: ...

    @property
    def speakers(self) -> Sequence[str]: ...

    def voice(self, speaker: str) -> Voice: ...

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]: ...


class _Closable(Protocol):
    def close(self) -> None: ...


def load_synthesizer(bundle: ModelBundle, runtime: RuntimeOptions) -> Synthesizer:
    """The family's own engine: the ONNX Runtime synthesizer of the bundle."""
    return Synthesizer.load(bundle, runtime)


class CosyVoice1Model:
    """One loaded CosyVoice-300M bundle; thread-safe (the engine and the voices lock what they share)."""

    family = contract.FAMILY
    instruct_presets: tuple[str, ...] = ()

    def __init__(self, bundle: ModelBundle, frontend: TextFrontend, engine: V1Engine, voices: Voices) -> None:
        self.bundle = bundle
        self._frontend = frontend
        self.engine = engine
        self._voices = voices

    @property
    def model_id(self) -> str:
        return self.bundle.manifest.model

    @property
    def sample_rate(self) -> int:
        return self.engine.sample_rate

    @property
    def speakers(self) -> Sequence[str]:
        return self.engine.speakers

    @property
    def capabilities(self) -> Capabilities:
        return self.bundle.capabilities

    @property
    def frontend(self) -> TextFrontend:
        return self._frontend

    @property
    def voices(self) -> Voices:
        return self._voices

    def voice(self, speaker: str) -> ModelVoice:
        return self.engine.voice(speaker)

    def resolve(self, reference: VoiceReference) -> Voice:
        """A built-in speaker or saved voice by name, a one-off prompt, or a voice styled by an instruction."""
        return self._voices.voice_for(reference, self.engine.speakers, self.engine.voice)

    def warmup_voice(self) -> Voice:
        """The first built-in speaker; without any, a neutral voice (a unit x-vector and no prompt) for the probes."""
        if self.engine.speakers:
            return self.engine.voice(self.engine.speakers[0])
        dim = self.bundle.constants.spk_embed_dim
        return Voice.builtin("warm-up", neutral_embedding(dim))

    def synthesize(
        self, sentences: list[list[int]], voice: ModelVoice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        return self.engine.synthesize(sentences, v1_voice(voice), options, cancel)

    def state_budget(self) -> StateBudget | None:
        """None: a v1 stream carries a fixed overlap from chunk to chunk, nothing that grows with the sentence."""
        return None

    def close(self) -> None:
        """Stop the engine's scheduler thread (if it has one), then close the voice store and analysis cache."""
        close_engine = getattr(self.engine, "close", None)
        if callable(close_engine):
            cast(_Closable, self.engine).close()
        self._voices.close()


def check_options(bundle: ModelBundle, runtime: RuntimeOptions) -> None:
    """SettingError for what the v1 engine cannot do: a first streamed hop that is not longer than the bundle's token
    overlap (20 tokens: the first chunk's overlap would not stay frame-aligned; ScheduleConfig)."""
    least = default_first_hop(bundle.constants)
    hop = runtime.first_hop_tokens
    if hop is not None and hop < least:
        raise SettingError(
            f"must be at least {least} for CosyVoice-300M (more than its {least - 1}-token overlap), got {hop}",
            param="first_hop_tokens",
        )


def load_model(bundle: ModelBundle, context: ModelContext) -> CosyVoice1Model:
    """Frontend (whisper BPE), engine (the context's loader, else the synthesizer) and voices of a v1 bundle."""
    check_options(bundle, context.options)
    if context.mel_variant not in get_args(MelVariant):
        raise BundleError(f"prompt mel variant {context.mel_variant!r} is not one of {', '.join(get_args(MelVariant))}")
    frontend = TextFrontend.load(bundle.file(contract.TOKENIZER_NAME), lexicon_store=context.lexicon_store)
    engine = cast(V1Engine, (context.engine_loader or load_synthesizer)(bundle, context.options))
    voices = Voices.load(
        bundle,
        frontend,
        context.voice_store or MemoryVoiceStore(),
        context.analysis_cache or AnalysisCache(None),
        context.options,
        analyze=context.prompt_analysis,
        mel_variant=cast(MelVariant, context.mel_variant),
        max_voices=context.max_voices,
        reserved_names=context.reserved_voice_names,
    )
    return CosyVoice1Model(bundle, frontend, engine, voices)
