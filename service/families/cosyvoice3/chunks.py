"""The flow half of a CosyVoice3 sentence: mel chunks as speech tokens arrive, three ways. The whole sentence in one
full-attention pass (non-streamed, official); the cached chunk-causal stream (default: each frame solved once, the
DiT's caches bounded by a window); the official recompute stream (`TTS_ENGINE_PROFILE=stream_schedule=official`: every call solves
the prompt and every token so far again, the last one with full attention, as CosyVoice2Model.tts with token2wav)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from service.bundle import ModelConstants
from service.engine.acoustic_gate import Pacer
from service.engine.chunking import Hop, Progress, first_audio
from service.engine.memory import StateBudget
from service.families.cosyvoice3.contract import CosyVoice3Constants
from service.families.cosyvoice3.flow import FlowRunner3, FlowState
from service.layers.chunk_schedule import HopSchedule
from service.layers.flow_prompt import FlowPrompt
from service.layers.frame_cache import PromptStates
from service.layers.frame_window import streamed_frames
from service.layers.mel_stream import TAIL_WAIT_S, MelChunk, Sentence, ended

PromptKey = tuple[str, int, int]  # voice fingerprint, Euler steps, prompt tokens the flow sees


@dataclass
class FlowChunks:
    """Cuts a sentence's tokens into mel chunks with a FlowRunner3; shared by every request of an engine (thread-safe:
    per-sentence state lives in the generators, the prompt states are shared read-only)."""

    flow: FlowRunner3
    constants: ModelConstants
    extra: CosyVoice3Constants
    prompt_states: PromptStates[PromptKey, FlowState]
    budget: StateBudget
    window: int | None  # generated frames a stream's caches keep (None: all)

    def whole(self, prompt: FlowPrompt, speech: list[int], steps: int, pace: Pacer, first: bool) -> tuple[np.ndarray, float]:
        """The official non-streaming flow: prompt + all tokens in one call, full attention -> mel (80, 2N), seconds."""
        clock = time.perf_counter()
        seq = np.asarray([*prompt.tokens, *speech], dtype=np.int64)
        state = self.flow.empty_state(steps, capacity=0)
        with pace.turn(first=first) as step_aside:
            mel = self.flow.advance(seq, seq[:0], prompt, state, full_attention=True, between_steps=step_aside)
        return mel[:, 2 * len(prompt.tokens) :], time.perf_counter() - clock

    def prompt_state(self, prompt: FlowPrompt, steps: int, fingerprint: str | None, capacity: int) -> FlowState:
        """The voice's prompt-only state (cached by fingerprint and window, frozen: every request's copy reads its caches'
        frames instead of copying them) as a copy this sentence extends, with room for `capacity` cached frames and the
        engine's window."""
        if not fingerprint:
            state = self.flow.prompt_state(prompt, steps, capacity)
            state.window = self.window
            return state
        key = (fingerprint, steps, len(prompt.tokens))
        shared = self.prompt_states.get(key)
        if shared is None:
            shared = self.flow.prompt_state(prompt, steps, capacity=0).freeze()  # kept: room for its own frames only
            self.prompt_states.put(key, shared)
        return shared.copy(capacity, self.window)

    def capacity(self, prompt: FlowPrompt, max_tokens: int | None, schedule: HopSchedule) -> int:
        """Cached frames a stream can reach: the prompt and the window (or the whole sentence)."""
        if max_tokens is None:
            return int(self.flow.noise.shape[1])
        return streamed_frames(self.extra, len(prompt.tokens), max_tokens, self.window, schedule.look_ahead)

    def cached(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt,
        steps: int,
        schedule: HopSchedule,
        *,
        fingerprint: str | None = None,
        pace: Pacer,
        max_tokens: int | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[MelChunk]:
        """The cached chunk-causal stream: mel chunks (80, 2 x tokens) cut by `schedule` as `tokens` arrive, each frame
        solved once. A stream reserves its caches' bytes in the budget before each chunk grows them (waiting while they
        do not fit; it ends early if `cancel` is set meanwhile) and returns them when it ends."""
        state = self.prompt_state(prompt, steps, fingerprint, self.capacity(prompt, max_tokens, schedule))
        job = Sentence(prompt, state, Hop(0, 0), [])
        job.hop = schedule.next_hop(job.progress(pace.audio_s), None)
        owner, stop = object(), (cancel.is_set if cancel is not None else None)
        try:
            if not self.budget.reserve(owner, state.nbytes(), stop):
                return
            for token in tokens:
                job.speech.append(int(token))
                while len(job.speech) - job.offset >= job.hop.tokens + job.hop.look_ahead:
                    left = len(job.speech) - job.offset - job.hop.tokens
                    if schedule.takes_tail(left) and ended(tokens, TAIL_WAIT_S if job.offset else 0.0):
                        break  # the stream has ended: this chunk is the last and takes its look-ahead along
                    if not self._reserve(owner, job, stop, final=False):
                        return
                    yield self._chunk(job, schedule, pace, final=False)
                    job.hop = schedule.next_hop(job.progress(pace.audio_s), None)
            if not self._reserve(owner, job, stop, final=True):
                return
            yield self._chunk(job, schedule, pace, final=True)
        finally:
            self.budget.release(owner)

    def _reserve(self, owner: object, job: Sentence[FlowState], stop: Callable[[], bool] | None, *, final: bool) -> bool:
        """Reserve what the state will hold once the next chunk has run (the window's drop first) beyond what this
        sentence holds already (a sentence keeps its largest reservation until it ends)."""
        end = len(job.prompt.tokens) + (len(job.speech) if final else job.offset + job.hop.tokens)
        after = job.state.bytes_after(self.extra.token_mel_ratio * max(0, end - job.encoded), self.flow.chunk_frames)
        return self.budget.reserve(owner, max(0, after - self.budget.held(owner)), stop)

    def _chunk(self, job: Sentence[FlowState], schedule: HopSchedule, pace: Pacer, *, final: bool) -> MelChunk:
        """Flow for the next hop (or the rest): the new tokens after what is encoded, with their look-ahead."""
        prompt_tokens = len(job.prompt.tokens)
        seq = np.asarray([*job.prompt.tokens, *job.speech], dtype=np.int64)
        end = len(seq) if final else prompt_tokens + job.offset + job.hop.tokens
        start = job.encoded
        tokens = end - prompt_tokens - job.offset
        first = first_audio(job.progress(pace.audio_s))
        clock = time.perf_counter()
        wide = schedule.takes_cores(tokens, first=job.offset == 0, final=final)
        with pace.turn(first=first, pauses_llm=wide) as step_aside:
            context = seq[end : end + schedule.look_ahead]
            mel = self.flow.advance(seq[start:end], context, job.prompt, job.state, between_steps=step_aside, wide=wide)
        mel = mel[:, max(0, 2 * (prompt_tokens - start)) :]
        job.offset, job.chunks = end - prompt_tokens, job.chunks + 1
        return MelChunk(mel, final, time.perf_counter() - clock, tokens, first)

    def official(
        self, tokens: Iterator[int], prompt: FlowPrompt, steps: int, schedule: HopSchedule, *, pace: Pacer
    ) -> Iterator[MelChunk]:
        """The official recompute stream: a call whenever `hop + 3` tokens are buffered, each over the prompt and every
        token so far (the last 3 only as look-ahead) with chunk masks, and a last full-attention call over them all;
        a chunk is the new frames after the previous ones (token2wav's `feat[:, :, 2 x token_offset:]`)."""
        speech: list[int] = []
        offset, chunks, last = 0, 0, Hop(0, 0)
        hop = schedule.next_hop(self._progress(0, last, 0, prompt, pace), None)
        for token in tokens:
            speech.append(int(token))
            if len(speech) - offset >= hop.tokens + hop.look_ahead:
                first = first_audio(self._progress(chunks, last, offset, prompt, pace))
                mel, flow_s = self._recompute(prompt, speech[: offset + hop.tokens + hop.look_ahead], steps, pace, first)
                yield MelChunk(mel[:, 2 * offset :], False, flow_s, hop.tokens, first)
                offset, chunks, last = offset + hop.tokens, chunks + 1, hop
                hop = schedule.next_hop(self._progress(chunks, last, offset, prompt, pace), None)
        first = first_audio(self._progress(chunks, last, offset, prompt, pace))
        mel, flow_s = self._recompute(prompt, speech, steps, pace, first, final=True)
        yield MelChunk(mel[:, 2 * offset :], True, flow_s, len(speech) - offset, first)

    @staticmethod
    def _progress(chunks: int, last: Hop, offset: int, prompt: FlowPrompt, pace: Pacer) -> Progress:
        return Progress(
            chunks=chunks, last_hop=last.tokens, buffered=0, llm_done=False, audio_s=pace.audio_s, consumed=offset,
            prompt_tokens=len(prompt.tokens), carry=last.carry,
        )  # fmt: skip

    def _recompute(
        self, prompt: FlowPrompt, speech: list[int], steps: int, pace: Pacer, first: bool, *, final: bool = False
    ) -> tuple[np.ndarray, float]:
        """CausalMaskedDiffWithDiT.inference over the prompt and `speech`: finalize and full attention when `final`,
        else the last pre_lookahead tokens as context and chunk masks -> the mel after the prompt, seconds."""
        clock = time.perf_counter()
        seq = np.asarray([*prompt.tokens, *speech], dtype=np.int64)
        look = 0 if final else self.extra.pre_lookahead
        body, context = seq[: len(seq) - look], seq[len(seq) - look :]
        state = self.flow.empty_state(steps, capacity=0)
        with pace.turn(first=first) as step_aside:
            mel = self.flow.advance(body, context, prompt, state, full_attention=final, between_steps=step_aside, keep=False)
        return mel[:, 2 * len(prompt.tokens) :], time.perf_counter() - clock
