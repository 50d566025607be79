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

from service.bundle import ModelConstants, expand_io_names
from service.errors import BundleError
from service.families.cosyvoice2.contract import CosyVoice2Constants
from service.families.cosyvoice2.voice import FlowPrompt2
from service.layers.cfm import cosine_t_span
from service.layers.frame_cache import EstimatorState, FrameCache

FULL_ATTENTION = 1 << 30  # chunk size of the non-streaming masks (one chunk covers any sequence)


def _grow(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """old (B,H,C,DK) ++ new (B,H,T,DK) along the time axis, in the old cache's element type."""
    return np.concatenate([old, new.astype(old.dtype, copy=False)], axis=2)


def graph_inputs(session: Any) -> list[Any]:
    """A graph's inputs, read through a ShrinkingSession to its InferenceSession; none for objects without
    `get_inputs` (test doubles)."""
    inputs = getattr(getattr(session, "session", session), "get_inputs", None)
    return [] if inputs is None else list(inputs())


def check_time_first(session: Any, extra: CosyVoice2Constants) -> None:
    """Refuse an estimator graph whose caches are heads-first (B,H,C,DK): bundles exported before time-first caches."""
    shape = next((i.shape for i in graph_inputs(session) if i.name == "past_k_0"), None)
    if shape is not None and len(shape) == 4 and shape[2] != extra.estimator_heads:
        raise BundleError(
            "flow_estimator takes its key/value caches heads-first (an export before time-first caches): "
            "re-export the bundle with this version (export/export_onnx.py)"
        )


def input_type(session: Any, prefix: str) -> type[np.floating]:
    """float16 when the graph's inputs named `prefix`* are float16 (an int8 twin's caches), else float32 (also for
    objects without inputs, test doubles)."""
    types = {i.type for i in graph_inputs(session) if i.name.startswith(prefix)}
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
class FlowState:
    """Everything a streaming sequence keeps between flow calls."""

    encoder: EncoderState
    steps: list[EstimatorState]  # one per Euler step
    frames: int = 0  # frames solved so far (prompt included)

    def nbytes(self) -> int:
        return self.encoder.nbytes() + sum(s.nbytes() for s in self.steps)

    def bytes_per_frame(self) -> int:
        """What one more solved frame adds to the estimator's caches (every step's rows, keys and values)."""
        return sum(c.bytes_per_frame() for s in self.steps for c in (*s.k, *s.v))

    def copy(self, capacity: int) -> FlowState:
        """A copy to continue for up to `capacity` frames in all (a voice's prompt state serves many requests). The
        encoder's arrays are shared (encoder calls replace them, never write into them); the estimator's caches,
        appended in place, are copied."""
        e = self.encoder
        encoder = EncoderState(e.look_ahead, e.up_tail, list(e.enc_k), list(e.enc_v), list(e.up_k), list(e.up_v), e.tokens)
        return FlowState(encoder, [s.copy(capacity) for s in self.steps], self.frames)


class FlowRunner2:
    """Runs flow_speaker, flow_encoder and flow_estimator of a CosyVoice2 bundle (batch 1, CFG rows 2).

    The estimator runs each classifier-free-guidance row as its own batch-1 call on that row's caches (FrameCache,
    appended in place). `cfg_lanes`: a call that runs alone (no other estimator call of this runner in flight) runs
    the two rows side by side, the second on a lane thread. The full-size estimator runs ~3,300 small kernels: ONNX
    Runtime's intra-op threads barely shorten a call (100 frames: 180 ms on 2 threads, 190 ms on 1), two calls on two
    cores nearly halve it. Concurrent requests run their rows one after the other (each already has its core). The rows
    are independent (fp32: the same numbers as one batch-2 call; int8: each row quantizes its activations with its
    own scale instead of one scale for both).
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
        check_time_first(self._estimator, extra)
        counts = extra.graph_counts()
        self._enc_names = expand_io_names(("enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"), 0, counts)
        self._k_names = expand_io_names(("past_k_{b}",), 0, counts)
        self._v_names = expand_io_names(("past_v_{b}",), 0, counts)
        self._lanes = ThreadPoolExecutor(2, thread_name_prefix="cfg-lane", initializer=lane_init) if cfg_lanes else None
        self._in_flight = 0  # estimator calls running now (read and written under _count_lock)
        self._count_lock = threading.Lock()

    def close(self) -> None:
        if self._lanes is not None:
            self._lanes.shutdown(wait=False)

    # ---- state ------------------------------------------------------------------------------------
    def empty_state(self, n_timesteps: int, capacity: int | None = None) -> FlowState:
        """A fresh sequence's state with room for `capacity` frames (None: as many as the noise buffer has)."""
        frames = self.noise.shape[1] if capacity is None else capacity
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
            def rows() -> list[FrameCache]:
                shape = (e.estimator_blocks, e.estimator_heads, e.estimator_head_dim)
                return [FrameCache.empty(*shape, self.est_dtype, frames) for _ in (0, 1)]

            return EstimatorState(np.zeros((2, e.estimator_tail_channels, e.conv_tail), dtype=np.float32), rows(), rows())

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

    def estimate(
        self, feeds: dict[str, np.ndarray], state: EstimatorState, keep: bool = True, *, wide: bool = True
    ) -> np.ndarray:
        """Velocity (2, 80, M) of the CFG rows for the new frames in `feeds`; extends `state` in place (its keys and
        values only with `keep`: a call no later call continues from needs none of them).

        Each guidance row is its own batch-1 call on its own caches: alone (no other estimator call of this runner
        in flight) and `wide`, the two run side by side on the lane thread and this one, else one after the other
        here (one batch-2 call was 6 % faster than two batch-1 calls, full size, but needs both rows' caches in one
        array). `wide` False keeps the call on one core (the other left to the decode steps).
        """
        with self._count_lock:
            self._in_flight += 1
            lanes = self._lanes if self._in_flight == 1 and wide else None
        try:
            if lanes is None:
                rows = [self._row(feeds, state, 0, keep), self._row(feeds, state, 1, keep)]
            else:
                other = lanes.submit(self._row, feeds, state, 1, keep)
                try:
                    mine = self._row(feeds, state, 0, keep)
                finally:
                    theirs = other.result()
                rows = [mine, theirs]
        finally:
            with self._count_lock:
                self._in_flight -= 1
        return np.stack(rows)

    def _row(self, feeds: Mapping[str, np.ndarray], state: EstimatorState, row: int, keep: bool = True) -> np.ndarray:
        """The estimator on guidance row `row` alone: velocity (80, M); updates the row's tails and, with `keep`,
        appends its keys/values."""
        mine = {name: a if name == "chunk" else a[row : row + 1] for name, a in feeds.items()}
        mine["tails"] = state.tails[row : row + 1]
        k, v = state.k[row], state.v[row]
        mine.update((name, k.view(b)) for b, name in enumerate(self._k_names))
        mine.update((name, v.view(b)) for b, name in enumerate(self._v_names))
        velocity, tails, new_k, new_v = self._estimator.run(None, mine)
        if keep:
            k.append(new_k)
            v.append(new_v)
        state.tails[row] = tails[0]
        return np.asarray(velocity[0], dtype=np.float32)

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
        keep: bool = True,
        *,
        wide: bool = True,
    ) -> np.ndarray:
        """Euler CFM with classifier-free guidance for new frames start..start+M-1 -> mel (80, M).

        mu, cond (80, M), spks (80,); the initial x is the fixed noise buffer's frames at the same positions.
        Row 0 of each estimator call is conditioned, row 1 sees zeros for mu, spks and cond; the velocity is
        (1 + cfg_rate) * v0 - cfg_rate * v1. Step s reads and extends `state.steps[s]` (its keys and values only with
        `keep`). `wide`: the guidance rows may run side by side (`estimate`).
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
            v = self.estimate(feeds, state.steps[step - 1], keep, wide=wide)
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
        wide: bool = True,
    ) -> np.ndarray:
        """Encode and solve the next tokens (T,) of a sequence (prompt tokens first) -> their mel (80, 2T).

        `context`: the up to pre_lookahead tokens that follow (empty at the end). `wide` False keeps the solve on one
        core (`estimate`). `full_attention` with a fresh state and the whole sequence is the official non-streaming
        flow; otherwise attention is chunk-causal. Nothing
        continues from a full-attention call, so it keeps no estimator keys/values (they would take 2.3 MB per frame
        at full size, float16: 1.7 GB for a 10 s recording and a 5 s sentence, written and never read).
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
        spks = self.speaker(prompt.embedding)
        return self.solve(mu, spks, cond, start, state, chunk_frames, between_steps, keep=not full_attention, wide=wide)

    def prompt_state(self, prompt: FlowPrompt2, n_timesteps: int, capacity: int | None = None) -> FlowState:
        """The state after the prompt's complete chunks whose look-ahead is still prompt: all of it depends on the
        prompt alone, so every request of the voice can continue from a copy (empty for short prompts). `capacity`:
        frames the state has room for (None: the noise buffer's; a state kept for copies needs only the prompt's)."""
        e = self.extra
        chunks = max(0, (len(prompt.tokens) - e.pre_lookahead) // e.chunk_tokens)
        state = self.empty_state(n_timesteps, capacity)
        if chunks:
            tokens = np.asarray(prompt.tokens, dtype=np.int64)
            end = chunks * e.chunk_tokens
            self.advance(tokens[:end], tokens[end : end + e.pre_lookahead], prompt, state)
        return state
