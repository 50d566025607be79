"""CosyVoice2 flow: encoder and estimator graphs called chunk by chunk with their caches, and the Euler CFM solve.

The official streaming flow is chunk-causal: attention under chunk masks (all left chunks), convolutions padded
on the left, a fixed noise buffer indexed by frame. So a frame's value never depends on later chunks, and a
stream that keeps every layer's left context solves each frame once and gets the frames the official
recompute-everything stream gets. The non-streaming call is the same graphs over the whole sequence with full
attention and empty caches.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bundle import ModelConstants, expand_io_names
from service.errors import BundleError
from service.families.cosyvoice2.contract import CosyVoice2Constants
from service.families.cosyvoice2.voice import FlowPrompt2
from service.layers.cfm import GuidedEuler, frame_dtype, reads_int8
from service.layers.frame_cache import EstimatorState, FrameCache, PrecisionLever, stored_precision
from service.layers.frame_window import WindowedFrames

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
class FlowState(WindowedFrames):
    """Everything a streaming sequence keeps between flow calls. `window`: the most generated frames the estimator's
    caches keep besides the first `prompt_frames` (None: all, the official computation), as
    layers.frame_window.WindowedFrames keeps them; the encoder keeps every token (its relative positions would shift)."""

    encoder: EncoderState
    steps: list[EstimatorState]  # one per Euler step
    frames: int = 0  # frames solved so far (prompt included)
    prompt_frames: int = 0
    window: int | None = None

    @property
    def tokens(self) -> int:
        """Tokens (prompt included) the encoder has encoded so far."""
        return self.encoder.tokens

    def nbytes(self) -> int:
        return self.encoder.nbytes() + sum(s.nbytes() for s in self.steps)

    def copy(self, capacity: int, window: int | None = None, prompt_frames: int = 0) -> FlowState:
        """A copy to continue for up to `capacity` cached frames with `window` (a voice's prompt state serves many
        requests). The encoder's arrays are shared (encoder calls replace them, never write into them); the
        estimator's caches, appended in place, are copied (or, from a frozen state, read: `freeze`)."""
        e = self.encoder
        encoder = EncoderState(e.look_ahead, e.up_tail, list(e.enc_k), list(e.enc_v), list(e.up_k), list(e.up_v), e.tokens)
        return FlowState(encoder, [s.copy(capacity) for s in self.steps], self.frames, prompt_frames, window)


class FlowRunner2(GuidedEuler):
    """Runs flow_speaker, flow_encoder and flow_estimator of a CosyVoice2 bundle (batch 1, CFG rows 2).

    The estimator's guidance rows are solved as GuidedEuler does (each row its own batch-1 call on its own caches,
    side by side on the lane thread when `cfg_lanes` and no other call is in flight). The full-size estimator runs
    ~3,300 small kernels: ONNX Runtime's intra-op threads barely shorten a call, two calls on two cores nearly halve
    it (docs/perf-log.md). Concurrent requests run their rows one after the other.
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
        precision: PrecisionLever = "graph",
    ) -> None:
        """`precision`: how the estimator's caches keep their frames (frame_cache.stored_precision)."""
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
        check_time_first(estimator, extra)
        self._enc_names = expand_io_names(("enc_k_{e}", "enc_v_{e}", "up_k_{u}", "up_v_{u}"), 0, counts)

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
                int8 = self.reads_int8
                return [FrameCache.empty(*shape, self.est_dtype, frames, self.precision, reads_int8=int8) for _ in (0, 1)]

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
        dropping: tuple[int, int] = (0, 0),
    ) -> np.ndarray:
        """Euler CFM with classifier-free guidance for new frames start..start+M-1 -> mel (80, M) (GuidedEuler's
        solve over the state's steps, attention chunks of `chunk` frames, `dropping` what the window lets go of); the
        state counts the new frames."""
        shared = {"chunk": np.array([chunk], dtype=np.int64)}
        x = self.solve_steps(mu, spks, cond, start, state.steps, shared, between_steps, keep, wide=wide, dropping=dropping)
        state.frames += mu.shape[1]
        return x

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
        dropping = (0, 0) if full_attention else state.dropping(mu.shape[1], chunk_frames)
        spks = self.speaker(prompt.embedding)
        return self.solve(
            mu, spks, cond, start, state, chunk_frames, between_steps, keep=not full_attention, wide=wide, dropping=dropping
        )

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
