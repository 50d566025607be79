"""CosyVoice-300M's chunk schedule: plain state in, the next hop out (no threads, no clock, no sessions).

A streamed sentence is vocoded in chunks: a chunk waits until `hop + overlap` tokens are buffered, consumes `hop`
of them and keeps the last `overlap` as the next chunk's look-ahead (the official v1 scheme, spec §6). This module
alone decides how large each hop is and whether a chunk carries the request's first audio; the streaming loop
(service.families.cosyvoice1.streaming) only counts tokens and runs the calls.

Two schedules:
* fixed (`adaptive=False`): the first hop, then `max(hop, min_hop) * growth` capped at `max_hop`. With
  `ScheduleConfig.official(constants)` every boundary is the official v1 one (hop 100, scale 1): the parity setting.
* adaptive (the default): the first hop is small (first audio), and every later chunk is the smallest that carries
  enough audio to cover the time the next chunk of its size takes: the tokens still to decode at the measured
  token interval, plus the measured acoustic cost of its solver frames (prompt frames included) and vocoded frames,
  at the rates measured for chunks made beside the decode or after it, as this one will be (RateMeter). A hop longer
  than the official one (`steady_hop`, token_hop_len) must also not be longer than the audio already delivered.
  When no hop covers (the host is slower than real time for this voice), or nothing is measured yet, the hop is the
  audio delivered so far, at least `short_hop` (1 s) and at most the official hop. A listener then waits in any case;
  what decides how long is the largest single deficit (a chunk's making time against the audio already delivered),
  and a long chunk right after the short first chunk makes that deficit as large as it can be (docs/perf-log.md).

What else it answers for the shared interface (service.engine.chunking.ChunkSchedule), as CosyVoice2's schedule does:
* the look-ahead tail (`takes_tail`, adaptive only): a chunk cut when its sentence's tokens end within one overlap
  after its own (at most `2 * overlap` tokens after its hop) is the sentence's last and takes them along, instead of
  a last flow call over the 20 carried overlap tokens and those few. The audio has the same length (the overlap's
  frames are the last chunk's either way); the official split keeps the last call (`service verify` replays it).
* which calls may take both cores (`takes_cores`, `vocoder_takes_cores`): a sentence's first chunk and its last; the
  engine gives them the cores only when no other acoustic call and no decode step competes for them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from service.bundle import ModelConstants
from service.engine.chunking import Hop, Progress, Rates, first_audio

OFFICIAL = ModelConstants()  # the released CosyVoice-300M's constants
# The adaptive schedule's hop when no hop covers and less audio than that is out: 1 s of speech (50 tokens), half the
# official hop. On a 2-core host slower than real time for v1 it cut the built-in voice's TTCA by about a third and a
# 10 s voice's by about a tenth against the official hop there (docs/perf-log.md, 2026-12-01).
SHORT_HOP_S = 1.0


@dataclass(frozen=True)
class ScheduleConfig:
    """How a streamed sentence is cut into chunks (token counts; see the module docstring)."""

    first_hop: int  # tokens the request's first-audio chunk consumes
    overlap: int  # look-ahead tokens each non-final chunk keeps for the next (token_overlap_len)
    min_hop: int  # smallest hop of any later chunk
    max_hop: int  # largest hop
    growth: float = 1.0  # fixed schedule: hop multiplier per chunk
    adaptive: bool = True
    steady_hop: int = 100  # adaptive hop that short hops grow back to (token_hop_len)
    constants: ModelConstants = OFFICIAL  # the model's frame and sample rates, for the adaptive cost
    tail: int = 0  # most tokens after a chunk's hop it takes along as the sentence's last (takes_tail); 0: never
    short_hop: int = 0  # adaptive hop when no hop covers and little audio is out (_short_hop); 0: the steady hop

    def __post_init__(self) -> None:
        if self.first_hop <= self.overlap:
            raise ValueError(f"first_hop_tokens must be > token_overlap_len ({self.overlap}), got {self.first_hop}")
        if self.min_hop <= self.overlap:
            raise ValueError(f"min_hop must be > token_overlap_len ({self.overlap}), got {self.min_hop}")
        if self.max_hop < self.min_hop or self.growth < 1.0:
            raise ValueError("max_hop must be >= min_hop and growth >= 1")
        if self.tail < 0:
            raise ValueError("tail must be >= 0")

    @classmethod
    def official(cls, c: ModelConstants) -> ScheduleConfig:
        """The official v1 schedule: every hop token_hop_len, scaled by stream_scale_factor up to token_max_hop_len."""
        hop = c.token_hop_len
        return cls(hop, c.token_overlap_len, hop, c.token_max_hop_len, c.stream_scale_factor, False, hop, c)

    @classmethod
    def default(cls, c: ModelConstants, first_hop: int | None = None, *, tail: bool = True) -> ScheduleConfig:
        """The engine default: adaptive, first hop `overlap + 1` (the smallest that keeps the overlap frame-aligned);
        with `tail`, a chunk takes along up to two overlaps of tokens after its hop when they end the sentence."""
        overlap = c.token_overlap_len
        first = overlap + 1 if first_hop is None else first_hop
        short = max(overlap + 1, round(SHORT_HOP_S * c.token_rate_hz))
        last = 2 * overlap if tail else 0
        return cls(first, overlap, overlap + 1, c.token_max_hop_len, 1.0, True, c.token_hop_len, c, last, short)

    def with_first_hop(self, first_hop: int) -> ScheduleConfig:
        return replace(self, first_hop=first_hop)

    def first_audio_tokens(self, prompt_tokens: int = 0) -> int:
        """Tokens the LLM must deliver before the request's first audio can be made (the prompt does not count)."""
        return self.first_hop + self.overlap

    def next_hop(self, progress: Progress, rates: Rates | None) -> Hop:
        """The ChunkSchedule answer: `next_hop` below, every chunk waiting for the overlap."""
        return Hop(next_hop(self, progress, rates, self.constants), self.overlap)

    def takes_tail(self, left: int) -> bool:
        """Whether a chunk about to be cut with `left` tokens after its hop (its overlap, and what more is decoded)
        takes them along as the sentence's last once the token stream has ended. Otherwise a last call solves those
        `left` tokens from the flow cache (prompt frames, the 34 overlap frames and at most 34 more, every Euler step)
        and vocodes them, for at most 0.8 s of audio at the end of the sentence."""
        return self.tail > 0 and left <= self.tail

    def takes_cores(self, tokens: int, *, first: bool, final: bool) -> bool:
        """Whether a chunk's flow may run its two guidance rows side by side on both cores: every chunk may, and the
        engine's `cores_free` decides (no other acoustic call, and no decode step beside it unless the chunk carries
        the first audio). At 50 tokens a second v1's chunks mostly outlast its decoding: once a sentence's tokens are
        all decoded, a one-thread flow call would leave a core idle (TTCA 11.7 against 10.0 s with two threads on an
        AVX2 host, docs/perf-log.md)."""
        return True

    def vocoder_takes_cores(self, tokens: int, *, before: int, final: bool) -> bool:
        """Whether a chunk's vocoder call may run on both cores: the same chunks as `takes_cores` (the first has no
        speech `before` it), since v1 vocodes each chunk in the call that solves its flow."""
        return self.takes_cores(tokens, first=before == 0, final=final)


def next_hop(config: ScheduleConfig, progress: Progress, rates: Rates | None, c: ModelConstants) -> int:
    """Tokens the next chunk consumes; it is vocoded once `hop + overlap` are buffered (or the LLM ends).

    Without `rates` (nothing measured yet) the adaptive schedule takes hops of `steady_hop` (the official size).
    """
    if first_audio(progress):
        return config.first_hop
    if not config.adaptive:
        return _fixed_hop(config, progress)
    if rates is None:
        return _short_hop(config, progress, c)
    return _covering_hop(config, progress, rates, c)


def chunk_audio_s(hop: int, c: ModelConstants) -> float:
    """Seconds of audio a non-first chunk of `hop` tokens yields (its hop's mel frames)."""
    return c.tokens_to_mel_frames(hop) * c.mel_hop_samples / c.sample_rate


def chunk_cost_s(hop: int, config: ScheduleConfig, rates: Rates, c: ModelConstants, prompt_frames: int) -> float:
    """Estimated acoustic seconds of a chunk of `hop` tokens: flow over prompt + (hop + overlap) tokens' frames,
    HiFT over the hop's frames plus the vocoder's carried mel frames."""
    solver = prompt_frames + c.tokens_to_mel_frames(hop + config.overlap)
    vocoded = c.tokens_to_mel_frames(hop) + c.mel_cache_len
    return rates.call_s + rates.solver_frame_s * solver + rates.vocoder_frame_s * vocoded


def _fixed_hop(config: ScheduleConfig, progress: Progress) -> int:
    if progress.chunks == 0 and progress.audio_s > 0.0:  # a later sentence's first chunk
        return config.min_hop
    return min(config.max_hop, int(max(progress.last_hop, config.min_hop) * config.growth))


def _covering_hop(config: ScheduleConfig, progress: Progress, rates: Rates, c: ModelConstants) -> int:
    """The smallest hop whose audio covers making the next chunk of the same size, else the steady hop.

    The next chunk needs `hop + overlap` tokens after this one; those not yet decoded when this chunk is done
    arrive at `rates.token_s` each (the LLM keeps decoding while this chunk is vocoded).
    """
    most = min(config.max_hop, max(_steady_hop(config), _delivered_tokens(progress, c)))
    for hop in range(config.min_hop, most + 1):
        cost = chunk_cost_s(hop, config, rates, c, progress.prompt_frames)
        wait = 0.0
        if not progress.llm_done:
            have = max(progress.buffered, hop + config.overlap) - hop + cost / rates.token_s
            wait = max(0.0, hop + config.overlap - have) * rates.token_s
        if chunk_audio_s(hop, c) / progress.speed >= wait + cost:
            return hop
    return _short_hop(config, progress, c)


def _steady_hop(config: ScheduleConfig) -> int:
    return min(config.max_hop, max(config.min_hop, config.steady_hop))


def _delivered_tokens(progress: Progress, c: ModelConstants) -> int:
    """Speech tokens' worth of the audio the request has delivered so far."""
    return round(progress.audio_s * progress.speed * c.token_rate_hz)


def _short_hop(config: ScheduleConfig, progress: Progress, c: ModelConstants) -> int:
    """The hop when none covers: as much as the request has delivered, at least `short_hop` and at most the steady
    hop. Each chunk is then made while the listener plays the one before, and the largest deficit (a chunk's making
    time against the audio delivered before it) is that of a short chunk, not of a steady one right after the short
    first chunk; the hops grow back to the steady one as audio accumulates, so a long stream pays the extra overlap
    frames of short chunks only at its start."""
    grown = max(config.short_hop or config.steady_hop, _delivered_tokens(progress, c))
    return min(_steady_hop(config), max(config.min_hop, grown))
