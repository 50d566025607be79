"""CosyVoice2 flow: encoder and estimator graphs called chunk by chunk with their caches, and the Euler CFM solve.

The official streaming flow is chunk-causal: attention under chunk masks (all left chunks), convolutions padded
on the left, a fixed noise buffer indexed by frame. So a frame's value never depends on later chunks, and a
stream that keeps every layer's left context solves each frame once and gets the frames the official
recompute-everything stream gets. The non-streaming call is the same graphs over the whole sequence with full
attention and empty caches.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bundle import CosyVoice2Constants, ModelConstants, expand_io_names
from service.engine.flow import cosine_t_span
from service.families.cosyvoice2.voice import FlowPrompt2

FULL_ATTENTION = 1 << 30  # chunk size of the non-streaming masks (one chunk covers any sequence)


def _grow(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """old (B,H,C,DK) ++ new (B,H,T,DK) along the time axis, in the old cache's element type."""
    return np.concatenate([old, new.astype(old.dtype, copy=False)], axis=2)


def input_type(session: Any, prefix: str) -> type[np.floating]:
    """float16 when the graph's inputs named `prefix`* are float16 (an int8 twin's caches), else float32.

    Reads through a ShrinkingSession to its InferenceSession; objects without `get_inputs` (test doubles) get float32.
    """
    inputs = getattr(getattr(session, "session", session), "get_inputs", None)
    if inputs is None:
        return np.float32
    types = {i.type for i in inputs() if i.name.startswith(prefix)}
    return np.float16 if types == {"tensor(float16)"} else np.float32


@dataclass
class EncoderState:
    """The flow encoder's left context: conv tails (1,512,2) and per-block keys/values (1,H,C,DK)."""

    look_ahead: np.ndarray
    up_tail: np.ndarray
    enc_k: list[np.ndarray]
    enc_v: list[np.ndarray]
    up_k: list[np.ndarray]
    up_v: list[np.ndarray]
    tokens: int = 0  # tokens encoded so far (prompt included)

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.look_ahead, self.up_tail, *self.enc_k, *self.enc_v, *self.up_k, *self.up_v))


@dataclass
class EstimatorState:
    """One Euler step's estimator context for both CFG rows: conv tails (2,SC,2) and keys/values (2,H,C,DK)."""

    tails: np.ndarray
    k: list[np.ndarray]
    v: list[np.ndarray]

    def nbytes(self) -> int:
        return int(self.tails.nbytes + sum(a.nbytes for a in (*self.k, *self.v)))


@dataclass
class FlowState:
    """Everything a streaming sequence keeps between flow calls."""

    encoder: EncoderState
    steps: list[EstimatorState]  # one per Euler step
    frames: int = 0  # frames solved so far (prompt included)

    def nbytes(self) -> int:
        return self.encoder.nbytes() + sum(s.nbytes() for s in self.steps)

    def copy(self) -> FlowState:
        """A copy to continue (a voice's prompt state serves many requests). The arrays are shared, not copied: flow
        calls replace a state's arrays with new ones and never write into them."""
        e = self.encoder
        encoder = EncoderState(e.look_ahead, e.up_tail, list(e.enc_k), list(e.enc_v), list(e.up_k), list(e.up_v), e.tokens)
        return FlowState(encoder, [EstimatorState(s.tails, list(s.k), list(s.v)) for s in self.steps], self.frames)


class FlowRunner2:
    """Runs flow_speaker, flow_encoder and flow_estimator of a CosyVoice2 bundle (batch 1, CFG rows 2).

    `cfg_lanes`: an estimator call that runs alone (no other call of this runner in flight) runs its two
    classifier-free-guidance rows as two concurrent batch-1 calls (the second on a lane thread) instead of one batch-2
    call. The full-size estimator is ~10,000 small nodes: ONNX Runtime's intra-op threads barely shorten a call
    (100 frames: 180 ms on 2 threads, 190 ms on 1), two calls on two cores nearly halve it. Calls of concurrent requests
    stay whole (each already has its core). The rows are independent (fp32: the same numbers; int8: each row
    quantizes its activations with its own scale instead of one scale for both).
    """

    def __init__(
        self,
        sessions: Mapping[str, Any],
        constants: ModelConstants,
        extra: CosyVoice2Constants,
        noise: np.ndarray,
        *,
        cfg_lanes: bool = False,
        lane_init: Callable[[], None] | None = None,
    ) -> None:
        if constants.t_scheduler != "cosine":
            raise ValueError(f"unsupported t_scheduler {constants.t_scheduler!r} (only 'cosine')")
        self._speaker = sessions["flow_speaker"]
        self._encoder = sessions["flow_encoder"]
        self._estimator = sessions["flow_estimator"]
        self.constants = constants
        self.extra = extra
        self.noise = np.ascontiguousarray(noise, dtype=np.float32)  # (80, noise_frames)
        self.est_dtype = input_type(self._estimator, "past_k_")
        counts = extra.graph_counts()
        self._enc_names = expand_io_names(("enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"), 0, counts)
        self._est_names = expand_io_names(("past_k_{b}", "past_v_{b}"), 0, counts)
        self._lanes = ThreadPoolExecutor(2, thread_name_prefix="cfg-lane", initializer=lane_init) if cfg_lanes else None
        self._in_flight = 0  # estimator calls running now (read and written under _count_lock)
        self._count_lock = threading.Lock()

    def close(self) -> None:
        if self._lanes is not None:
            self._lanes.shutdown(wait=False)

    # ---- state ------------------------------------------------------------------------------------
    def empty_state(self, n_timesteps: int) -> FlowState:
        e = self.extra
        tail = np.zeros((1, e.encoder_dim, e.conv_tail), dtype=np.float32)

        def kv(n: int, heads: int, dim: int, rows: int, dtype: type[np.floating]) -> list[np.ndarray]:
            return [np.zeros((rows, heads, 0, dim), dtype=dtype) for _ in range(n)]

        encoder = EncoderState(
            tail,
            tail.copy(),
            kv(e.encoder_blocks, e.encoder_heads, e.encoder_head_dim, 1, np.float32),
            kv(e.encoder_blocks, e.encoder_heads, e.encoder_head_dim, 1, np.float32),
            kv(e.up_blocks, e.encoder_heads, e.encoder_head_dim, 1, np.float32),
            kv(e.up_blocks, e.encoder_heads, e.encoder_head_dim, 1, np.float32),
        )

        def step() -> EstimatorState:
            blocks = e.estimator_blocks
            k = kv(blocks, e.estimator_heads, e.estimator_head_dim, 2, self.est_dtype)
            v = kv(blocks, e.estimator_heads, e.estimator_head_dim, 2, self.est_dtype)
            return EstimatorState(np.zeros((2, e.estimator_tail_channels, e.conv_tail), dtype=np.float32), k, v)

        return FlowState(encoder, [step() for _ in range(n_timesteps)])

    def speaker(self, embedding: np.ndarray) -> np.ndarray:
        """spks (80,) from a raw x-vector (192,)."""
        emb = np.asarray(embedding, dtype=np.float32).reshape(1, -1)
        return np.asarray(self._speaker.run(["spks"], {"embedding": emb})[0][0], dtype=np.float32)

    # ---- graph calls ------------------------------------------------------------------------------
    def encode(self, tokens: np.ndarray, context: np.ndarray, state: EncoderState, chunk: int) -> np.ndarray:
        """mu (80, 2T) of the new tokens (T,) with look-ahead `context` (K <= 3,); extends `state` in place."""
        feeds: dict[str, np.ndarray] = {
            "tokens": np.maximum(np.asarray(tokens, dtype=np.int64), 0).reshape(1, -1),
            "context": np.maximum(np.asarray(context, dtype=np.int64), 0).reshape(1, -1),
            "chunk": np.array([chunk], dtype=np.int64),
            "look_ahead": state.look_ahead,
            "up_tail": state.up_tail,
        }
        feeds.update(zip(self._enc_names, [*state.enc_k, *state.enc_v, *state.up_k, *state.up_v], strict=True))
        h, look_ahead, up_tail, enc_k, enc_v, up_k, up_v = self._encoder.run(None, feeds)
        state.look_ahead, state.up_tail = look_ahead, up_tail
        state.enc_k = [_grow(a, b) for a, b in zip(state.enc_k, enc_k, strict=True)]
        state.enc_v = [_grow(a, b) for a, b in zip(state.enc_v, enc_v, strict=True)]
        state.up_k = [_grow(a, b) for a, b in zip(state.up_k, up_k, strict=True)]
        state.up_v = [_grow(a, b) for a, b in zip(state.up_v, up_v, strict=True)]
        state.tokens += int(np.asarray(tokens).shape[0])
        return np.ascontiguousarray(np.asarray(h[0], dtype=np.float32).T)

    def estimate(self, feeds: dict[str, np.ndarray], state: EstimatorState) -> np.ndarray:
        """Velocity (2, 80, M) of the CFG rows for the new frames in `feeds`; extends `state` in place."""
        feeds = dict(feeds)
        feeds["tails"] = state.tails
        feeds.update(zip(self._est_names, [*state.k, *state.v], strict=True))
        with self._count_lock:
            self._in_flight += 1
            lanes = self._lanes if self._in_flight == 1 else None
        try:
            v, tails, new_k, new_v = self._estimator.run(None, feeds) if lanes is None else self._run_rows(lanes, feeds)
        finally:
            with self._count_lock:
                self._in_flight -= 1
        state.tails = tails
        state.k = [_grow(a, b) for a, b in zip(state.k, new_k, strict=True)]
        state.v = [_grow(a, b) for a, b in zip(state.v, new_v, strict=True)]
        return np.asarray(v, dtype=np.float32)

    def _run_rows(self, lanes: ThreadPoolExecutor, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The estimator on each CFG row alone (row 1 on a lane thread, row 0 here), outputs joined as one call's."""
        rows = [{k: a if k == "chunk" else a[r : r + 1] for k, a in feeds.items()} for r in (0, 1)]
        other = lanes.submit(self._estimator.run, None, rows[1])
        mine = self._estimator.run(None, rows[0])
        theirs = other.result()
        # v (B,80,M), tails (B,SC,2), new_k/new_v (blocks,B,H,M,DK)
        return [np.concatenate([a, b], axis=0 if i < 2 else 1) for i, (a, b) in enumerate(zip(mine, theirs, strict=True))]

    # ---- solving ----------------------------------------------------------------------------------
    def solve(
        self,
        mu: np.ndarray,
        spks: np.ndarray,
        cond: np.ndarray,
        start: int,
        state: FlowState,
        chunk: int,
        between_steps: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Euler CFM with classifier-free guidance for new frames start..start+M-1 -> mel (80, M).

        mu, cond (80, M), spks (80,); the initial x is the fixed noise buffer's frames at the same positions.
        Row 0 of each estimator call is conditioned, row 1 sees zeros for mu, spks and cond; the velocity is
        (1 + cfg_rate) * v0 - cfg_rate * v1. Step s reads and extends `state.steps[s]`.
        """
        frames = mu.shape[1]
        if start + frames > self.noise.shape[1]:
            raise ValueError(f"the flow's noise covers {self.noise.shape[1]} frames; this sequence needs {start + frames}")
        n_timesteps = len(state.steps)
        cfg = np.float32(self.constants.cfg_rate)
        zero = np.zeros_like(mu)
        feeds = {
            "mu": np.stack([mu, zero]),
            "spks": np.stack([spks, np.zeros_like(spks)]),
            "cond": np.stack([cond, zero]),
            "chunk": np.array([chunk], dtype=np.int64),
        }
        x = self.noise[:, start : start + frames] * np.float32(self.constants.temperature)
        t_span = cosine_t_span(n_timesteps)
        t, dt = t_span[0], t_span[1] - t_span[0]
        for step in range(1, n_timesteps + 1):
            feeds["x"] = np.stack([x, x])
            feeds["t"] = np.full(2, t, dtype=np.float32)
            v = self.estimate(feeds, state.steps[step - 1])
            x = x + dt * ((np.float32(1.0) + cfg) * v[0] - cfg * v[1])
            t = t + dt
            if step < n_timesteps:
                dt = t_span[step + 1] - t
                if between_steps is not None:
                    between_steps()
        state.frames += frames
        return np.asarray(x, dtype=np.float32)

    def advance(
        self,
        tokens: np.ndarray,
        context: np.ndarray,
        prompt: FlowPrompt2,
        state: FlowState,
        *,
        full_attention: bool = False,
        between_steps: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Encode and solve the next tokens (T,) of a sequence (prompt tokens first) -> their mel (80, 2T).

        `context`: the up to pre_lookahead tokens that follow (empty at the end). `full_attention` with a fresh
        state and the whole sequence is the official non-streaming flow; otherwise attention is chunk-causal.
        """
        e = self.extra
        chunk_tokens = FULL_ATTENTION if full_attention else e.chunk_tokens
        chunk_frames = FULL_ATTENTION if full_attention else e.chunk_tokens * e.token_mel_ratio
        mu = self.encode(tokens, context, state.encoder, chunk_tokens)
        start = state.frames
        cond = np.zeros_like(mu)
        overlap = max(0, min(prompt.mel.shape[0] - start, mu.shape[1]))
        if overlap:
            cond[:, :overlap] = prompt.mel[start : start + overlap].T
        return self.solve(mu, self.speaker(prompt.embedding), cond, start, state, chunk_frames, between_steps)

    def prompt_state(self, prompt: FlowPrompt2, n_timesteps: int) -> FlowState:
        """The state after the prompt's complete chunks whose look-ahead is still prompt: all of it depends on the
        prompt alone, so every request of the voice can continue from a copy (empty for short prompts)."""
        state = self.empty_state(n_timesteps)
        e = self.extra
        chunks = max(0, (len(prompt.tokens) - e.pre_lookahead) // e.chunk_tokens)
        if chunks:
            tokens = np.asarray(prompt.tokens, dtype=np.int64)
            end = chunks * e.chunk_tokens
            self.advance(tokens[:end], tokens[end : end + e.pre_lookahead], prompt, state)
        return state
