"""CosyVoice2-0.5B assembled from its bundle: text frontend over the Qwen2 BPE, the cached streaming engine, voices."""

from __future__ import annotations

from typing import cast

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.errors import BundleError, SettingError
from service.families.cosyvoice2 import contract
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.families.cosyvoice2.voices import Voices2, v2_voice
from service.families.loaded import LoadedModel, VoiceEngine
from service.families.model import ModelContext, ModelVoice
from service.frontend import TextFrontend
from service.layers.qwen_tokenizer import Qwen2Tokenizer
from service.stores.analysis_cache import AnalysisCache
from service.stores.voices import MemoryVoiceStore


def load_engine(bundle: ModelBundle, runtime: RuntimeOptions) -> CosyVoice2Engine:
    """The family's own engine: Qwen2 LLM on the batching scheduler, cached chunk-causal flow, HiFT at 24 kHz."""
    return CosyVoice2Engine.load(bundle, runtime)


class CosyVoice2Model(LoadedModel[Voice2]):
    """One loaded CosyVoice2 bundle; thread-safe (the engine and the voices lock what they share).

    Built-in speakers exist only when the checkpoint had a spk2info.pt (the official release has none): requests
    then name a saved voice or send a prompt recording, and the probes run with `warmup_voice`.
    """

    family = contract.FAMILY

    def builtin_voice(self, name: str, embedding: object) -> Voice2:
        return Voice2.builtin(name, np.asarray(embedding, dtype=np.float32))

    def own(self, voice: ModelVoice) -> Voice2:
        return v2_voice(voice)


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
    engine = cast("VoiceEngine[Voice2]", (context.engine_loader or load_engine)(bundle, context.options))
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
