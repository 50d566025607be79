"""CosyVoice-300M (-SFT, -Instruct) assembled from its bundle: text frontend, ONNX synthesizer and voices."""

from __future__ import annotations

from typing import cast, get_args

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import BundleError, SettingError
from service.families.cosyvoice1 import contract
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.streaming import default_first_hop
from service.families.cosyvoice1.voice import Voice
from service.families.cosyvoice1.voices import Voices, v1_voice
from service.families.loaded import LoadedModel, VoiceEngine
from service.families.model import ModelContext, ModelVoice
from service.frontend import TextFrontend
from service.layers.prompt import MelVariant
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import MemoryVoiceStore


def load_synthesizer(bundle: ModelBundle, runtime: RuntimeOptions) -> Synthesizer:
    """The family's own engine: the ONNX Runtime synthesizer of the bundle."""
    return Synthesizer.load(bundle, runtime)


class CosyVoice1Model(LoadedModel[Voice]):
    """One loaded CosyVoice-300M bundle; thread-safe (the engine and the voices lock what they share)."""

    family = contract.FAMILY

    def builtin_voice(self, name: str, embedding: object) -> Voice:
        return Voice.builtin(name, np.asarray(embedding, dtype=np.float32))

    def own(self, voice: ModelVoice) -> Voice:
        return v1_voice(voice)


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
    engine = cast("VoiceEngine[Voice]", (context.engine_loader or load_synthesizer)(bundle, context.options))
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
