"""The chunk-causal flow's chunk schedule (CosyVoice2 and later): plain numbers in (prompt tokens, the previous hop,
where it ended), the next hop out.

The flow attends in chunks of `chunk` tokens counted from the start of prompt + speech (the official
`static_chunk_size`): a frame sees every earlier chunk and its own chunk whole. A streamed chunk that ends on such a
boundary is solved exactly as the official recompute-everything stream solves it, and the caches continue from there.

Two schedules:
* official (`aligned_first=True`): the first hop is 25 tokens plus what brings prompt + hop to a boundary (up to
  24 more), then 50, then 100 each (CosyVoice2Model.tts per request); `service verify` replays it.
* early first audio (`aligned_first=False`, the service default): the first hop is small (`first`, 10 tokens) and
  ends inside an attention chunk, so its frames see only the part of their chunk that exists, as the frames of an
  utterance's last, partial chunk do in the official chunk-masked training; the rest of that chunk is solved next
  from the caches (its frames see the first hop's keys as they were computed). Every later chunk ends on a boundary
  and is one attention chunk (EARLY_SCALE). What differs from the official audio is the sentence's first attention
  chunk (and, through its keys, a little of what follows); the reason is first audio: the official first chunk
  waits for 25-49 tokens and solves them all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from service.bundle import ModelConstants
from service.engine.chunking import Hop, Progress, Rates
from service.engine.options import RuntimeOptions

EARLY_FIRST_HOP = 10  # tokens of the first streamed chunk with early first audio (0.4 s of speech, 0.24 s heard)
# Hops after the first attention chunk stay one chunk (25 tokens, 1 s): where the stream is slower than real time, a
# listener waits least when audio comes in small steps (a lower TTCA than the official doubling to 100 gives;
# docs/perf-log.md).
EARLY_SCALE = 1


@dataclass(frozen=True)
class HopSchedule:
    """Tokens per streaming chunk: the first hop, then x `scale` per chunk up to `most`, each plus `look_ahead` tokens
    the chunk waits for; hops after the first end on multiples of `chunk` (prompt included)."""

    chunk: int = 25
    first: int = 25
    most: int = 100
    scale: int = 2
    look_ahead: int = 3
    aligned_first: bool = True

    def __post_init__(self) -> None:
        if min(self.chunk, self.first, self.most, self.scale) < 1 or self.look_ahead < 0:
            raise ValueError("chunk, first, most and scale must be >= 1, look_ahead >= 0")

    @classmethod
    def official(cls, chunk: int, look_ahead: int, c: ModelConstants) -> HopSchedule:
        """CosyVoice2Model.tts for attention chunks of `chunk` tokens and `look_ahead` tokens of look-ahead: 25 (+ pad
        to a boundary), 50, 100, ..."""
        scale = max(1, int(c.stream_scale_factor))
        return cls(chunk, c.token_hop_len, c.token_max_hop_len, scale, look_ahead)

    @classmethod
    def early(cls, chunk: int, look_ahead: int, c: ModelConstants, first: int | None = None) -> HopSchedule:
        """A first hop of `first` tokens (EARLY_FIRST_HOP) wherever it ends, the rest of its attention chunk, then one
        attention chunk per hop (EARLY_SCALE)."""
        official = cls.official(chunk, look_ahead, c)
        return cls(official.chunk, first or EARLY_FIRST_HOP, official.most, EARLY_SCALE, official.look_ahead, False)

    def first_hop(self, prompt_tokens: int, first: int | None = None) -> int:
        """Tokens of a sentence's first chunk after a flow prompt of `prompt_tokens` (`first` overrides the base)."""
        base = first or self.first
        return base + self._pad(prompt_tokens + base) if self.aligned_first else base

    def next_hop(self, progress: Progress, rates: Rates | None) -> Hop:
        """The ChunkSchedule answer (rates are not used: the boundaries are the attention chunks'): a sentence's first
        hop after its prompt, then `after` the previous one; the base hop travels in `carry`."""
        if progress.chunks == 0:
            return Hop(self.first_hop(progress.prompt_tokens), self.look_ahead, self.first)
        hop, base = self.after(progress.carry, progress.prompt_tokens + progress.consumed)
        return Hop(hop, self.look_ahead, base)

    def after(self, base: int, end: int) -> tuple[int, int]:
        """(hop, base) of the chunk after one whose base hop was `base` and which ended at token `end` (prompt
        included). After a chunk that ended inside an attention chunk (an early first chunk): the rest of that chunk,
        base 0. Else the base grows by `scale` up to `most` (from 0: one chunk), and so does the hop."""
        rest = self._pad(end)
        if rest:
            return rest, 0
        grown = min(self.most, base * self.scale) if base else self.chunk
        return grown + self._pad(end + grown), grown

    @property
    def decode_lead(self) -> int:
        """Tokens the decode steps keep ahead of a stream's flow before they pause for a chunk that takes the cores
        (BatchScheduler.lead_tokens). Hops that stay one attention chunk: 1, the chunk a listener waits for gets both
        cores as soon as its tokens exist, and the decode steps catch up beside the one-core calls (vocoder, the rest
        of an early first attention chunk), which gave a lower TTCA than a lead of 25 at the same 4-client throughput
        (docs/perf-log.md). Growing hops (official): the largest hop, since the next chunk
        needs up to twice this one's tokens and pausing would leave it waiting for all of them."""
        return self.most if self.scale > 1 else 1

    def takes_cores(self, tokens: int, *, first: bool, final: bool) -> bool:
        """Whether a streamed chunk of `tokens` speech tokens has the cores to itself (its flow's two guidance rows
        side by side while the decode steps pause): a sentence's first chunk (first audio), its last (nothing left
        to decode) and every chunk of at least one attention chunk. A smaller one (the rest of an early first
        attention chunk) runs on one core beside the decode steps: what the listener waits for next is the following
        whole chunk, and its tokens are not decoded yet."""
        return first or final or tokens >= self.chunk

    def vocoder_takes_cores(self, tokens: int, *, before: int, final: bool) -> bool:
        """Whether the vocoder call of a chunk of `tokens` speech tokens, after `before` tokens of its sentence, runs on
        both cores while the decode steps pause: a sentence's last chunk (nothing left to decode) and, with hops that
        stay one attention chunk, its first chunk of a whole attention chunk. With the early schedule that is the chunk
        after the first attention chunk, the one a listener waits for longest (0.72 s heard before it, 1.0 s in it):
        on two threads its vocoder call takes about half the time, and the next chunk's tokens, which the paused decode
        steps make, are needed a second later. The calls between stay on one thread beside the decode steps. Growing
        hops (official) need twice the tokens for the next chunk: pausing the decode steps for the first chunk's
        vocoder call there brought first audio earlier and TTCA later (docs/perf-log.md)."""
        return final or (self.scale == 1 and tokens >= self.chunk and before < self.chunk)

    def takes_tail(self, left: int) -> bool:
        """Whether a chunk about to be cut with only `left` tokens after it (its look-ahead, or fewer) takes them along
        as the sentence's last chunk when the token stream has already ended. Early schedule: yes, since a last chunk
        of a look-ahead's tokens runs every Euler step and a vocoder call for 0.12 s of audio at the stream's end
        (full size ~0.4 s, where a listener's wait is longest); the frames come out the same, since the hop's frames
        never see later ones (chunk masks, left-padded convolutions) and their look-ahead tokens are the same. Official
        schedule: no, CosyVoice2Model.tts solves them in a call of their own (`service verify` replays it)."""
        return not self.aligned_first and left <= self.look_ahead

    def first_audio_tokens(self, prompt_tokens: int, first: int | None = None) -> int:
        """Speech tokens the LLM must deliver before a sentence's first chunk can be solved."""
        return self.first_hop(prompt_tokens, first) + self.look_ahead

    def _pad(self, end: int) -> int:
        return (-end) % self.chunk


def runtime_schedule(runtime: RuntimeOptions, chunk: int, look_ahead: int, c: ModelConstants) -> HopSchedule:
    """The schedule `runtime` asks for: "official" (CosyVoice2Model.tts) or the default early first audio; either with
    `runtime.first_hop_tokens` as its first hop when that is set (the official one still pads it to a chunk boundary)."""
    if runtime.stream_schedule == "official":
        official = HopSchedule.official(chunk, look_ahead, c)
        return official if runtime.first_hop_tokens is None else replace(official, first=runtime.first_hop_tokens)
    return HopSchedule.early(chunk, look_ahead, c, runtime.first_hop_tokens)


def window_tokens(seconds: float | None, schedule: HopSchedule, token_rate_hz: int) -> int | None:
    """Prompt tokens a streamed flow sees for a window of `seconds` (None: the whole prompt): at least the window,
    rounded up to `look_ahead` past a chunk boundary, so that all but the last `look_ahead` prompt tokens form whole
    chunks whose state depends on the prompt alone (cached per voice) and a sentence's first call solves only those
    few prompt tokens with its own."""
    if seconds is None:
        return None
    n = math.ceil(seconds * token_rate_hz)
    return n + (schedule.look_ahead - n) % schedule.chunk if n > 0 else 0
