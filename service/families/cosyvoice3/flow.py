"""Fun-CosyVoice3 flow: the look-ahead graph and the DiT estimator called chunk by chunk with their caches, and the
guided Euler solve (service.layers.cfm.GuidedEuler).

As CosyVoice2's, the official streaming flow is chunk-causal (attention under chunk masks over every left chunk, the
position embedding's convolutions padded on the left, a fixed noise buffer indexed by frame), so a stream that keeps
every block's keys and values solves each mel frame once and gets the frames the official recompute gets. The DiT's
caches grow by 1.8 MB per frame at full size (22 blocks x 2 x 1024 values x 2 guidance rows x 10 Euler steps, float16):
a stream may bound them with a window (`FlowState.window`), keeping the prompt's frames and the latest generated ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bundle import ModelConstants, expand_io_names
from service.families.cosyvoice3.contract import CosyVoice3Constants
from service.layers.cfm import GuidedEuler, frame_dtype, reads_int8
from service.layers.flow_prompt import FlowPrompt
from service.layers.frame_cache import EstimatorState, FrameCache, PrecisionLever, stored_precision
from service.layers.frame_window import WindowedFrames

FULL_ATTENTION = 1 << 30  # chunk size of the non-streaming masks (one chunk covers any sequence)
LOOKAHEAD_TAIL = 2  # conv1 outputs the look-ahead layer's causal conv2 reads before a chunk


@dataclass
class FlowState(WindowedFrames):
    """Everything a streamed sentence keeps between flow calls: the look-ahead layer's tail, each Euler step's DiT
    context (EstimatorState: position-embedding tails, each guidance row's keys/values), where the sequence stands.

    `window`: the most generated frames the caches keep besides the first `prompt_frames` (None: all, the official
    computation), as layers.frame_window.WindowedFrames keeps them."""

    tail: np.ndarray
    steps: list[EstimatorState]
    tokens: int = 0  # tokens encoded so far (prompt included)
    frames: int = 0  # frames solved so far (prompt included): the position of the next one
    prompt_frames: int = 0
    window: int | None = None

    def nbytes(self) -> int:
        return int(self.tail.nbytes + sum(s.nbytes() for s in self.steps))

    def copy(self, capacity: int, window: int | None) -> FlowState:
        """A copy to continue for up to `capacity` cached frames (a voice's prompt state serves many requests)."""
        steps = [s.copy(capacity) for s in self.steps]
        return FlowState(self.tail.copy(), steps, self.tokens, self.frames, self.prompt_frames, window)


class FlowRunner3(GuidedEuler):
    """Runs flow_speaker, flow_encoder (the look-ahead layer) and flow_estimator (the DiT) of a CosyVoice3 bundle."""

    def __init__(
        self,
        sessions: Mapping[str, Any],
        constants: ModelConstants,
        extra: CosyVoice3Constants,
        noise: np.ndarray,
        *,
        cfg_lanes: bool = False,
        lane_init: Callable[[], None] | None = None,
        precision: PrecisionLever = "graph",
    ) -> None:
        """`precision`: how the DiT's caches keep their frames (frame_cache.stored_precision)."""
        counts = extra.graph_counts()
        estimator = sessions["flow_estimator"]
        k_names = expand_io_names(("past_k_{b}",), 0, counts)
        v_names = expand_io_names(("past_v_{b}",), 0, counts)
        super().__init__(estimator, constants, noise, k_names, v_names, cfg_lanes=cfg_lanes, lane_init=lane_init)
        self._speaker = sessions["flow_speaker"]
        self._encoder = sessions["flow_encoder"]
        self.extra = extra
        self.est_dtype = frame_dtype(estimator)
        self.reads_int8 = reads_int8(estimator)
        self.precision = stored_precision(precision, self.est_dtype, self.reads_int8)
        self.chunk_frames = extra.chunk_tokens * extra.token_mel_ratio

    def empty_state(self, n_timesteps: int, capacity: int | None = None) -> FlowState:
        """A fresh sequence's state with room for `capacity` cached frames (None: as many as the noise buffer has)."""
        e = self.extra
        frames = self.noise.shape[1] if capacity is None else capacity

        def step() -> EstimatorState:
            def rows() -> list[FrameCache]:
                shape = (e.estimator_blocks, e.estimator_heads, e.estimator_head_dim)
                int8 = self.reads_int8
                return [FrameCache.empty(*shape, self.est_dtype, frames, self.precision, reads_int8=int8) for _ in (0, 1)]

            tails = np.zeros((2, 2 * e.estimator_dim, e.conv_tail), dtype=np.float32)
            return EstimatorState(tails, rows(), rows())

        tail = np.zeros((1, e.lookahead_channels, LOOKAHEAD_TAIL), dtype=np.float32)
        return FlowState(tail, [step() for _ in range(n_timesteps)])

    def speaker(self, embedding: np.ndarray) -> np.ndarray:
        """spks (80,) from a raw x-vector (192,)."""
        emb = np.asarray(embedding, dtype=np.float32).reshape(1, -1)
        return np.asarray(self._speaker.run(["spks"], {"embedding": emb})[0][0], dtype=np.float32)

    def encode(self, tokens: np.ndarray, context: np.ndarray, state: FlowState) -> np.ndarray:
        """mu (80, 2T) of the new tokens (T,) with look-ahead `context` (K <= 3,): each token's h twice; extends `state`."""
        feeds = {
            "tokens": np.maximum(np.asarray(tokens, dtype=np.int64), 0).reshape(1, -1),
            "context": np.maximum(np.asarray(context, dtype=np.int64), 0).reshape(1, -1),
            "tail": state.tail,
        }
        h, state.tail = self._encoder.run(None, feeds)
        state.tokens += int(np.asarray(tokens).shape[0])
        mu = np.repeat(np.asarray(h[0], dtype=np.float32), self.extra.token_mel_ratio, axis=0)
        return np.ascontiguousarray(mu.T)

    def advance(
        self,
        tokens: np.ndarray,
        context: np.ndarray,
        prompt: FlowPrompt,
        state: FlowState,
        *,
        full_attention: bool = False,
        between_steps: Callable[[], None] | None = None,
        wide: bool = True,
        keep: bool = True,
    ) -> np.ndarray:
        """Encode and solve the next tokens (T,) of a sequence (prompt tokens first) -> their mel (80, 2T).

        `context`: the up to 3 tokens that follow (empty at the end). `full_attention` with a fresh state and the whole
        sequence is the official non-streaming flow; otherwise attention is chunk-causal over what the state's window
        keeps. A call nothing continues from (full attention, or `keep` False: the official recompute) keeps no keys or
        values (1.8 MB a frame at full size). No tokens: no frames (a sentence the LLM ended at once)."""
        if np.asarray(tokens).shape[0] == 0:
            return np.zeros((self.constants.n_mels, 0), dtype=np.float32)
        mu = self.encode(tokens, context, state)
        start = state.frames
        cond = np.zeros_like(mu)
        overlap = max(0, min(prompt.mel.shape[0] - start, mu.shape[1]))
        if overlap:
            cond[:, :overlap] = prompt.mel[start : start + overlap].T
        keep = keep and not full_attention
        dropping = state.dropping(mu.shape[1], self.chunk_frames) if keep else (0, 0)
        chunk = FULL_ATTENTION if full_attention else self.chunk_frames
        shared = {"chunk": np.array([chunk], dtype=np.int64), "start": np.array([start], dtype=np.int64)}
        spks = self.speaker(prompt.embedding)
        mel = self.solve_steps(mu, spks, cond, start, state.steps, shared, between_steps, keep, wide=wide, dropping=dropping)
        state.frames += mu.shape[1]
        return mel

    def prompt_state(self, prompt: FlowPrompt, n_timesteps: int, capacity: int | None = None) -> FlowState:
        """The state after the prompt's complete chunks whose look-ahead is still prompt: all of it depends on the
        prompt alone, so every request of the voice can continue from a copy (empty for short prompts)."""
        e = self.extra
        chunks = max(0, (len(prompt.tokens) - e.pre_lookahead) // e.chunk_tokens)
        state = self.empty_state(n_timesteps, capacity)
        state.prompt_frames = 2 * len(prompt.tokens)
        if chunks:
            tokens = np.asarray(prompt.tokens, dtype=np.int64)
            end = chunks * e.chunk_tokens
            self.advance(tokens[:end], tokens[end : end + e.pre_lookahead], prompt, state)
        return state
