"""What one CosyVoice2 request may hold in memory at most (service.engine.footprint), from its voice, its sentences'
text tokens and the engine's levers: the estimator's and encoder's caches of a streamed sentence (or the attention of a
whole one) and the LLM's K/V row. docs/memory.md has the formulas and the full-size figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from service.bundle import ModelConstants
from service.engine.footprint import (
    LONGEST_SENTENCE_TOKENS,
    Footprint,
    attention_bytes,
    largest_sentence,
    llm_kv_bytes,
)
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.chunks import FlowChunks2
from service.families.cosyvoice2.contract import CosyVoice2Constants
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2
from service.layers.chunk_schedule import HopSchedule
from service.layers.frame_window import call_frame_bytes, call_frames, estimator_frame_bytes, streamed_frames
from service.layers.prompt import MAX_PROMPT_S


class CosyVoice2Engine(Protocol):
    """What the bound reads of the engine (service.families.cosyvoice2.engine.CosyVoice2Engine)."""

    constants: ModelConstants
    extra: CosyVoice2Constants
    runner: Any  # its `kv_dtype`
    chunks: FlowChunks2

    def flow_prompt(self, prompt: FlowPrompt2, options: SynthesisOptions) -> FlowPrompt2: ...

    def schedule_for(self, options: SynthesisOptions) -> HopSchedule: ...


LLM_SPECIAL_POSITIONS = 3  # sos, task and the first decoded position beyond the prompt, text and speech


def footprint(engine: CosyVoice2Engine, voice: Voice2, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
    """The most a request of sentences of `texts` text tokens in `voice` holds at once (its largest sentence's)."""
    return largest_sentence(texts, engine.constants, options, lambda t, s: _sentence(engine, voice, t, s, options))


def worst_footprint(engine: CosyVoice2Engine, options: SynthesisOptions) -> Footprint:
    """What one request may hold at the bounds: a recording of the longest prompt, its transcript as long as a
    sentence, and a sentence of the most text tokens making the most speech the caps allow."""
    rate = engine.constants.token_rate_hz
    tokens = tuple(range(int(MAX_PROMPT_S * rate)))
    mel = np.zeros((2 * len(tokens), engine.constants.n_mels), dtype=np.float32)
    voice = Voice2.cloned("worst", np.zeros(engine.constants.spk_embed_dim, dtype=np.float32), tokens, mel,
                          tuple(range(LONGEST_SENTENCE_TOKENS)))  # fmt: skip
    return footprint(engine, voice, [LONGEST_SENTENCE_TOKENS], options)


def _sentence(
    engine: CosyVoice2Engine, voice: Voice2, text: int, speech: int, options: SynthesisOptions
) -> list[tuple[str, int]]:
    c, e = engine.constants, engine.extra
    llm = voice.llm
    positions = len(llm.prompt_text_ids) + text + len(llm.speech_tokens) + speech + LLM_SPECIAL_POSITIONS
    parts = [("LLM K/V", llm_kv_bytes(c, np.dtype(engine.runner.kv_dtype).itemsize, positions))]
    if not options.stream:
        frames = e.token_mel_ratio * (len(voice.flow.tokens) + speech)
        return [*parts, ("flow attention", attention_bytes(e.estimator_heads, frames))]
    prompt = engine.flow_prompt(voice.flow, options)
    return [*parts, *_stream(engine, prompt, speech, options)]


def _stream(engine: CosyVoice2Engine, prompt: FlowPrompt2, speech: int, options: SynthesisOptions) -> list[tuple[str, int]]:
    """A streamed sentence's flow caches: the estimator's frames (prompt and window) in every Euler step and guidance
    row, one call's new frames of a step as the graph returns them, and the encoder's per token (with the copy a call
    makes while it grows them)."""
    e = engine.extra
    schedule = engine.schedule_for(options)
    steps = options.n_timesteps or engine.constants.n_timesteps
    flow = engine.chunks.flow
    frames = streamed_frames(e, len(prompt.tokens), speech, engine.chunks.window, schedule.look_ahead)
    per_frame = estimator_frame_bytes(e, steps, flow.est_dtype, flow.precision)
    call = call_frames(e, len(prompt.tokens), speech, schedule) * call_frame_bytes(e, flow.est_dtype)
    per_token = (e.encoder_blocks + e.token_mel_ratio * e.up_blocks) * 2 * e.encoder_heads * e.encoder_head_dim * 4
    tokens = len(prompt.tokens) + speech + schedule.look_ahead
    return [("estimator caches", frames * per_frame), ("estimator call", call), ("encoder caches", 2 * per_token * tokens)]
