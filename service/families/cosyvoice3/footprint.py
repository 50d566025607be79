"""What one Fun-CosyVoice3 request may hold in memory at most (service.engine.footprint), from its voice, its
sentences' text tokens and the engine's levers: the DiT's K/V caches and position-convolution tails of a streamed
sentence (or the full attention of a whole one, or of the official recompute stream's calls), the causal HiFT's mel
and source buffers, and the LLM's K/V row. docs/memory.md has the formulas and the full-size figures."""

from __future__ import annotations

import math
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
from service.families.cosyvoice3.chunks import FlowChunks
from service.families.cosyvoice3.contract import CosyVoice3Constants
from service.families.cosyvoice3.flow import LOOKAHEAD_TAIL
from service.families.cosyvoice3.vocoder import CONTEXT_FRAMES, F0_CONTEXT_FRAMES
from service.families.cosyvoice3.voice import Voice3
from service.layers.chunk_schedule import HopSchedule
from service.layers.flow_prompt import FlowPrompt
from service.layers.frame_window import (
    GUIDANCE_ROWS,
    call_frame_bytes,
    call_frames,
    estimator_frame_bytes,
    streamed_frames,
)
from service.layers.prompt import MAX_PROMPT_S

LLM_SPECIAL_POSITIONS = 3  # sos, task and the first decoded position beyond the prompt, text and speech
FLOAT32 = 4
# A vocoder call's numpy buffers per sample: the harmonic stack's noise rows, their scaled copy and the stack itself
# (nb_harmonics + 1 each), then the source and the decoded samples (one each).
STACK_COPIES, SAMPLE_COPIES = 3, 2


class CosyVoice3Engine(Protocol):
    """What the bound reads of the engine (service.families.cosyvoice3.engine.CosyVoice3Engine)."""

    constants: ModelConstants
    extra: CosyVoice3Constants
    runner: Any  # its `kv_dtype`
    chunks: FlowChunks
    recompute: bool

    def flow_prompt(self, prompt: FlowPrompt, options: SynthesisOptions) -> FlowPrompt: ...

    def schedule_for(self, options: SynthesisOptions) -> HopSchedule: ...


def footprint(engine: CosyVoice3Engine, voice: Voice3, texts: Sequence[int], options: SynthesisOptions) -> Footprint:
    """The most a request of sentences of `texts` text tokens in `voice` holds at once (its largest sentence's)."""
    return largest_sentence(texts, engine.constants, options, lambda t, s: _sentence(engine, voice, t, s, options))


def worst_footprint(engine: CosyVoice3Engine, options: SynthesisOptions) -> Footprint:
    """What one request may hold at the bounds: a recording of the longest prompt, its transcript as long as a
    sentence, and a sentence of the most text tokens making the most speech the caps allow."""
    tokens = tuple(range(int(MAX_PROMPT_S * engine.constants.token_rate_hz)))
    mel = np.zeros((2 * len(tokens), engine.constants.n_mels), dtype=np.float32)
    embedding = np.zeros(engine.constants.spk_embed_dim, dtype=np.float32)
    voice = Voice3.cloned("worst", embedding, tokens, mel, tuple(range(LONGEST_SENTENCE_TOKENS)), ())
    return footprint(engine, voice, [LONGEST_SENTENCE_TOKENS], options)


def tails_bytes(extra: CosyVoice3Constants, steps: int) -> int:
    """A sentence's flow state besides its K/V caches: every Euler step's position-convolution tails (both guidance
    rows, both convolutions' channels, kernel - 1 frames each, float32) and the look-ahead layer's tail."""
    per_step = GUIDANCE_ROWS * 2 * extra.estimator_dim * extra.conv_tail * FLOAT32
    return steps * per_step + extra.lookahead_channels * LOOKAHEAD_TAIL * FLOAT32


def vocoder_bytes(constants: ModelConstants, frames: int) -> int:
    """The causal HiFT's numpy buffers over `frames` mel frames: the mel, and per sample the harmonic stack's work
    (STACK_COPIES) and the source and samples (SAMPLE_COPIES), float32."""
    samples = frames * math.prod(constants.upsample_rates) * constants.istft_hop
    per_sample = STACK_COPIES * (constants.nb_harmonics + 1) + SAMPLE_COPIES
    return FLOAT32 * (frames * constants.n_mels + samples * per_sample)


def _sentence(
    engine: CosyVoice3Engine, voice: Voice3, text: int, speech: int, options: SynthesisOptions
) -> list[tuple[str, int]]:
    c, e = engine.constants, engine.extra
    llm = voice.llm
    positions = len(llm.prompt_text_ids) + text + len(llm.speech_tokens) + speech + LLM_SPECIAL_POSITIONS
    steps = options.n_timesteps or c.n_timesteps
    kv = llm_kv_bytes(c, np.dtype(engine.runner.kv_dtype).itemsize, positions)
    parts = [("LLM K/V", kv), ("DiT tails", tails_bytes(e, steps))]
    frames = e.token_mel_ratio * speech
    if not options.stream or engine.recompute:  # one call (or each official call) over the whole prompt and sentence
        attention = attention_bytes(e.estimator_heads, e.token_mel_ratio * len(voice.flow.tokens) + frames)
        return [*parts, ("flow attention", attention), ("vocoder", vocoder_bytes(c, frames))]
    return [*parts, *_stream(engine, engine.flow_prompt(voice.flow, options), speech, steps, options)]


def _stream(
    engine: CosyVoice3Engine, prompt: FlowPrompt, speech: int, steps: int, options: SynthesisOptions
) -> list[tuple[str, int]]:
    """A cached stream's DiT caches (the prompt's frames and the window, in every Euler step and guidance row), one
    call's new frames of a step as the graph returns them, and its vocoder's window (CONTEXT_FRAMES and
    F0_CONTEXT_FRAMES of mel before one call's frames)."""
    e = engine.extra
    schedule = engine.schedule_for(options)
    flow = engine.chunks.flow
    frames = streamed_frames(e, len(prompt.tokens), speech, engine.chunks.window, schedule.look_ahead)
    per_frame = estimator_frame_bytes(e, steps, flow.est_dtype, flow.precision)
    call = call_frames(e, len(prompt.tokens), speech, schedule)
    window = CONTEXT_FRAMES + F0_CONTEXT_FRAMES + call
    return [
        ("DiT caches", frames * per_frame),
        ("DiT call", call * call_frame_bytes(e, flow.est_dtype)),
        ("vocoder", vocoder_bytes(engine.constants, window)),
    ]
