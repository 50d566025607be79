"""What one CosyVoice-300M request may hold in memory at most (service.engine.footprint): the LLM's K/V row, and for a
sentence without streaming its flow's full-attention pass over prompt and sentence. A streamed sentence keeps no
growing flow state (each chunk's flow call solves the prompt window, its overlap and its hop afresh: a call's
activations, bounded by the acoustic slots, not by the streams). docs/memory.md has the figures."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from service.bundle import ModelConstants
from service.engine.footprint import (
    LONGEST_SENTENCE_TOKENS,
    Footprint,
    attention_bytes,
    largest_sentence,
    llm_kv_bytes,
)
from service.engine.types import LLMPrompt, SynthesisOptions
from service.families.cosyvoice1.voice import FlowPrompt, Voice
from service.layers.prompt import MAX_PROMPT_S

FLOW_HEADS = 8  # the flow estimator's attention heads (official ConditionalDecoder: num_heads 8)
LLM_SPECIAL_POSITIONS = 4  # sos, the speaker slot, task and the first decoded position


def footprint(
    constants: ModelConstants, kv_itemsize: int, voice: Voice, texts: Sequence[int], options: SynthesisOptions
) -> Footprint:
    """The most a request of sentences of `texts` text tokens in `voice` holds at once (its largest sentence's)."""
    return largest_sentence(texts, constants, options, lambda t, s: _sentence(constants, kv_itemsize, voice, t, s, options))


def worst_footprint(constants: ModelConstants, kv_itemsize: int, options: SynthesisOptions) -> Footprint:
    """What one request may hold at the bounds: a recording of the longest prompt with a transcript as long as a
    sentence, and a sentence of the most text tokens making the most speech the caps allow."""
    tokens = tuple(range(int(MAX_PROMPT_S * constants.token_rate_hz)))
    mel = np.zeros((constants.tokens_to_mel_frames(len(tokens)), constants.n_mels), dtype=np.float32)
    embedding = np.zeros(constants.spk_embed_dim, dtype=np.float32)
    llm = LLMPrompt(embedding, tuple(range(LONGEST_SENTENCE_TOKENS)), tokens)
    voice = Voice("worst", llm, FlowPrompt(embedding, tokens, mel))
    return footprint(constants, kv_itemsize, voice, [LONGEST_SENTENCE_TOKENS], options)


def _sentence(
    c: ModelConstants, kv_itemsize: int, voice: Voice, text: int, speech: int, options: SynthesisOptions
) -> list[tuple[str, int]]:
    positions = len(voice.llm.prompt_text_ids) + text + len(voice.llm.speech_tokens) + speech + LLM_SPECIAL_POSITIONS
    parts = [("LLM K/V", llm_kv_bytes(c, kv_itemsize, positions))]
    if options.stream:
        return parts
    frames = voice.flow.frames + c.tokens_to_mel_frames(speech)
    return [*parts, ("flow attention", attention_bytes(FLOW_HEADS, frames))]
