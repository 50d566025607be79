"""The flow half of a CosyVoice2 sentence: mel chunks as speech tokens arrive. The whole sentence in one
full-attention pass (non-streamed, official), or the cached chunk-causal stream: each frame solved once, the
estimator's caches continued from the voice's shared prompt state and bounded by a window."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from service.engine.acoustic_gate import Pacer
from service.engine.chunking import Hop, first_audio
from service.engine.memory import StateBudget
from service.families.cosyvoice2.contract import CosyVoice2Constants
from service.families.cosyvoice2.flow import FlowRunner2, FlowState
from service.families.cosyvoice2.sentence import TAIL_WAIT_S, MelChunk, Sentence, ended
from service.families.cosyvoice2.voice import FlowPrompt2
from service.layers.chunk_schedule import HopSchedule
from service.layers.frame_cache import PromptStates
from service.layers.frame_window import streamed_frames

PromptKey = tuple[str, int, int]  # voice fingerprint, Euler steps, prompt tokens the flow sees


@dataclass
class FlowChunks2:
    """Cuts a sentence's tokens into mel chunks with a FlowRunner2; shared by every request of an engine (thread-safe:
    per-sentence state lives in the generators, the prompt states are shared read-only)."""

    flow: FlowRunner2
    extra: CosyVoice2Constants
    prompt_states: PromptStates[PromptKey, FlowState]
    budget: StateBudget
    window: int | None  # generated frames a stream's estimator caches keep (None: all)

    @property
    def chunk_frames(self) -> int:
        return self.extra.chunk_tokens * self.extra.token_mel_ratio

    def whole(self, prompt: FlowPrompt2, speech: list[int], steps: int, pace: Pacer, first: bool) -> tuple[np.ndarray, float]:
        """The official non-streaming flow: prompt + all tokens in one call, full attention -> mel (80, 2N), seconds.
        `first`: it carries the request's first audio."""
        clock = time.perf_counter()
        seq = np.asarray([*prompt.tokens, *speech], dtype=np.int64)
        state = self.flow.empty_state(steps)
        with pace.turn(first=first) as step_aside:
            mel = self.flow.advance(seq, seq[:0], prompt, state, full_attention=True, between_steps=step_aside)
        return mel[:, 2 * len(prompt.tokens) :], time.perf_counter() - clock

    def prompt_state(self, prompt: FlowPrompt2, steps: int, fingerprint: str | None, capacity: int) -> FlowState:
        """The voice's prompt-only flow state (kept per fingerprint and window, frozen: every request's copy reads its
        caches' frames instead of copying them) as a copy this sentence extends to `capacity` frames, with the engine's
        window."""
        prompt_frames = self.extra.token_mel_ratio * len(prompt.tokens)
        if not fingerprint:
            state = self.flow.prompt_state(prompt, steps, capacity)
            state.window, state.prompt_frames = self.window, prompt_frames
            return state
        key = (fingerprint, steps, len(prompt.tokens))
        shared = self.prompt_states.get(key)
        if shared is None:
            shared = self.flow.prompt_state(prompt, steps, capacity=0).freeze()  # room for its own frames only
            self.prompt_states.put(key, shared)
        return shared.copy(capacity, self.window, prompt_frames)

    def capacity(self, prompt_tokens: int, max_tokens: int | None, schedule: HopSchedule) -> int:
        """Cached frames a stream can reach: the prompt and the window (or the whole sentence)."""
        if max_tokens is None:
            return int(self.flow.noise.shape[1])  # all the frames the flow can solve
        return streamed_frames(self.extra, prompt_tokens, max_tokens, self.window, schedule.look_ahead)

    def cached(
        self,
        tokens: Iterator[int],
        prompt: FlowPrompt2,
        steps: int,
        schedule: HopSchedule,
        *,
        fingerprint: str | None,
        pace: Pacer,
        max_tokens: int | None,
        cancel: threading.Event | None,
        exact_final: bool,
    ) -> Iterator[MelChunk]:
        """The cached chunk-causal stream: mel chunks (80, 2 x tokens) cut by `schedule` as `tokens` arrive, each frame
        solved once. A stream reserves what its caches will hold in the budget before each chunk grows them (waiting
        while they do not fit; it ends early if `cancel` is set meanwhile) and gives it all back when it ends."""
        capacity = self.capacity(len(prompt.tokens), max_tokens, schedule)
        state = self.prompt_state(prompt, steps, fingerprint, capacity)
        job = Sentence(prompt, state, Hop(0, 0), [])
        job.hop = schedule.next_hop(job.progress(pace.audio_s), None)
        owner, stop = object(), (cancel.is_set if cancel is not None else None)  # owner: this sentence
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
            if not exact_final and not self._reserve(owner, job, stop, final=True):  # the exact pass keeps none
                return
            yield self._chunk(job, schedule, pace, final=True, exact=exact_final)
        finally:
            self.budget.release(owner)

    def _reserve(self, owner: object, job: Sentence, stop: Callable[[], bool] | None, *, final: bool) -> bool:
        """Reserve what the state will hold once the next chunk has run (the window's drop first) beyond what this
        sentence holds already (a sentence keeps its largest reservation until it ends)."""
        end = len(job.prompt.tokens) + (len(job.speech) if final else job.offset + job.hop.tokens)
        after = job.state.bytes_after(self.extra.token_mel_ratio * max(0, end - job.encoded), self.chunk_frames)
        return self.budget.reserve(owner, max(0, after - self.budget.held(owner)), stop)

    def _chunk(self, job: Sentence, schedule: HopSchedule, pace: Pacer, *, final: bool, exact: bool = False) -> MelChunk:
        """Flow for the next hop (or the rest): the new tokens after what is encoded, with their look-ahead."""
        prompt_tokens = len(job.prompt.tokens)
        seq = np.asarray([*job.prompt.tokens, *job.speech], dtype=np.int64)
        end = len(seq) if final else prompt_tokens + job.offset + job.hop.tokens
        start = job.encoded
        tokens = end - prompt_tokens - job.offset  # this chunk's speech tokens
        first = first_audio(job.progress(pace.audio_s))
        clock = time.perf_counter()
        if final and exact:
            mel, _ = self.whole(job.prompt, job.speech, len(job.state.steps), pace, first)
            mel = mel[:, 2 * job.offset :]
        else:
            wide = schedule.takes_cores(tokens, first=job.offset == 0, final=final)
            with pace.turn(first=first, pauses_llm=wide) as step_aside:
                context = seq[end : end + schedule.look_ahead]
                mel = self.flow.advance(seq[start:end], context, job.prompt, job.state, between_steps=step_aside, wide=wide)
            mel = mel[:, max(0, 2 * (prompt_tokens - start)) :]
        job.offset, job.chunks = end - prompt_tokens, job.chunks + 1
        return MelChunk(mel, final, time.perf_counter() - clock, tokens, first)
