"""Flow runner: token encoder graph, numpy length regulator split, conv stack graph, Euler CFM with CFG (spec §4)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from service.bundle import ModelConstants
from service.families.cosyvoice1.voice import FlowPrompt, as_flow_prompt
from service.layers.cfm import euler_times
from service.layers.dsp import interpolate_linear


@dataclass(frozen=True)
class FlowCache:
    """Noise z and mean mu of the last mel_overlap_len frames of the previous flow call, each (n_mels, c)."""

    z: np.ndarray
    mu: np.ndarray

    @classmethod
    def empty(cls, n_mels: int) -> FlowCache:
        zero = np.zeros((n_mels, 0), dtype=np.float32)
        return cls(z=zero, mu=zero)

    @property
    def frames(self) -> int:
        return int(self.z.shape[-1])


@dataclass(frozen=True)
class FlowInput:
    """What the solver needs for one call: mu, z and cond (n_mels, P + M), spks (n_mels,), P prompt frames.

    cond holds the prompt mel in its first P frames and zeros after; the solver's output loses those P frames.
    """

    mu: np.ndarray
    spks: np.ndarray
    z: np.ndarray
    cond: np.ndarray
    prompt_frames: int = 0


def regulate_length(h: np.ndarray, n_frames: int, edge_tokens: int, edge_frames: int) -> np.ndarray:
    """Interpolate token features h (T, C) to (C, n_frames) like InterpolateRegulator.inference.

    With T > 2 * edge_tokens, the first and last edge_tokens go to edge_frames each and the middle to the
    rest, so a streaming overlap of edge_tokens lines up with exactly edge_frames mel frames; otherwise
    all tokens are resized together.
    """
    x = np.ascontiguousarray(h.T, dtype=np.float32)
    n_tok = x.shape[-1]
    if n_tok <= 2 * edge_tokens:
        return interpolate_linear(x, n_frames)
    head = interpolate_linear(x[:, :edge_tokens], edge_frames)
    mid = interpolate_linear(x[:, edge_tokens : n_tok - edge_tokens], n_frames - 2 * edge_frames)
    tail = interpolate_linear(x[:, n_tok - edge_tokens :], edge_frames)
    return np.concatenate([head, mid, tail], axis=-1)


# Whether an estimator call may take both cores now (asked before each call of a solve that may).
CoresFree = Callable[[], bool]


class FlowRunner:
    """Runs the three flow graphs of a bundle with the numpy regulator and solver; batch 1, thread-safe.

    `cfg_lanes`: an estimator call may run its conditioned and its unconditioned rows as two calls side by side (this
    thread and a lane thread) when its solve says the cores are free and no other call of this runner is in flight;
    with one-thread sessions that is both cores for a lone call. The rows are independent: the same numbers in fp32;
    in an int8 graph each half quantizes its activations with its own range (one call takes one range for all rows).
    """

    def __init__(self, sessions: Mapping[str, Any], constants: ModelConstants, *, cfg_lanes: bool = False) -> None:
        if constants.t_scheduler != "cosine":
            raise ValueError(f"unsupported t_scheduler {constants.t_scheduler!r} (only 'cosine')")
        self._encoder = sessions["flow_encoder"]
        self._lr = sessions["flow_lr"]
        self._estimator = sessions["flow_estimator"]
        self.constants = constants
        self.cfg_lanes = cfg_lanes
        self._lane = ThreadPoolExecutor(1, thread_name_prefix="cfg-lane") if cfg_lanes else None
        self._in_flight = 0  # estimator calls running now (read and written under _count_lock)
        self._count_lock = threading.Lock()

    def close(self) -> None:
        if self._lane is not None:
            self._lane.shutdown(wait=False)

    def mel_frames(self, n_tokens: int) -> int:
        """Mel frames the flow produces for n_tokens speech tokens."""
        return self.constants.tokens_to_mel_frames(n_tokens)

    def solver_frames(self, n_tokens: int, prompt: FlowPrompt | None = None) -> int:
        """Frames the solver integrates for n_tokens: the prompt's P frames plus mel_frames(n_tokens)."""
        return (prompt.frames if prompt is not None else 0) + self.mel_frames(n_tokens)

    def encode(self, tokens: np.ndarray, embedding: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Token features h (T, n_mels) and speaker conditioning spks (n_mels,) from ids (T,) and a raw x-vector."""
        ids = np.maximum(np.asarray(tokens, dtype=np.int64), 0)[None]
        emb = np.asarray(embedding, dtype=np.float32).reshape(1, -1)
        h, spks = self._encoder.run(["h", "spks"], {"tokens": ids, "embedding": emb})
        return np.asarray(h[0], dtype=np.float32), np.asarray(spks[0], dtype=np.float32)

    def mean(self, h: np.ndarray, n_frames: int, *, prompt_h: np.ndarray | None = None, prompt_frames: int = 0) -> np.ndarray:
        """Conditioning mean mu (n_mels, P + n_frames): length regulation in numpy, then the conv stack graph.

        `prompt_h` (P_tok, C), when given, is resized to `prompt_frames` frames in front of the text part.
        """
        c = self.constants
        x = regulate_length(h, n_frames, c.token_overlap_len, c.mel_overlap_len)
        if prompt_h is not None and len(prompt_h):
            head = interpolate_linear(np.ascontiguousarray(prompt_h.T, dtype=np.float32), prompt_frames)
            x = np.concatenate([head, x], axis=-1)
        (mu,) = self._lr.run(["mu"], {"x": x[None]})
        return np.asarray(mu[0], dtype=np.float32)

    def solve(
        self,
        mu: np.ndarray,
        spks: np.ndarray,
        z: np.ndarray,
        n_timesteps: int,
        between_steps: Callable[[], None] | None = None,
        cond: np.ndarray | None = None,
        lanes: CoresFree | None = None,
    ) -> np.ndarray:
        """Euler integration of the CFM ODE from noise z to a mel (n_mels, M), classifier-free guided.

        Each step runs the estimator once with a batch of 2: row 0 conditioned on (mu, spks, cond), row 1
        with all three zeroed; the velocity is (1 + cfg_rate) * v_cond - cfg_rate * v_uncond. `cond`
        (n_mels, M) defaults to zeros (no prompt). `between_steps`, if given, runs between two steps (the
        caller may let more urgent work have the cores there). `lanes`: asked before each estimator call whether its
        two guidance rows may run side by side (`cfg_lanes`).
        """
        conds = None if cond is None else [cond]
        return self.solve_many([mu], [spks], [z], n_timesteps, between_steps, conds, lanes=lanes)[0]

    def solve_inputs(
        self,
        inputs: Sequence[FlowInput],
        n_timesteps: int,
        between_steps: Callable[[], None] | None = None,
        lanes: CoresFree | None = None,
    ) -> list[np.ndarray]:
        """Mels (n_mels, M) of prepared calls of equal shape, solved together, each without its prompt frames."""
        mels = self.solve_many(
            [i.mu for i in inputs], [i.spks for i in inputs], [i.z for i in inputs], n_timesteps, between_steps,
            [i.cond for i in inputs], lanes=lanes,
        )  # fmt: skip
        return [mel[:, inp.prompt_frames :] for mel, inp in zip(mels, inputs, strict=True)]

    def solve_many(
        self,
        mus: Sequence[np.ndarray],
        spkss: Sequence[np.ndarray],
        zs: Sequence[np.ndarray],
        n_timesteps: int,
        between_steps: Callable[[], None] | None = None,
        conds: Sequence[np.ndarray] | None = None,
        *,
        lanes: CoresFree | None = None,
    ) -> list[np.ndarray]:
        """`solve` for k requests of the same length at once: one estimator call of batch 2k per Euler step.

        Rows 0..k-1 are the conditioned rows, k..2k-1 the unconditioned ones. The estimator treats rows
        independently, so each mel equals its own `solve` up to float rounding; small calls are overhead
        bound (2k = 16 rows of 70 frames cost ~3x one call of 2 rows, not 8x).
        """
        if n_timesteps < 1:
            raise ValueError("n_timesteps must be >= 1")
        k = len(mus)
        n_mels, m = mus[0].shape
        if k < 1 or any(mu.shape != (n_mels, m) or z.shape != (n_mels, m) for mu, z in zip(mus, zs, strict=True)):
            raise ValueError("solve_many needs at least one request and equal (n_mels, frames) shapes")
        cfg = np.float32(self.constants.cfg_rate)
        mu_rows = np.zeros((2 * k, n_mels, m), dtype=np.float32)
        mu_rows[:k] = np.stack(mus)
        spk_rows = np.zeros((2 * k, n_mels), dtype=np.float32)
        spk_rows[:k] = np.stack(spkss)
        cond_rows = np.zeros((2 * k, n_mels, m), dtype=np.float32)
        if conds is not None:  # conditioned rows see the prompt mel; the unconditioned ones see zeros, as mu and spks
            cond_rows[:k] = np.stack(conds)
        feeds = {"mask": np.ones((2 * k, 1, m), dtype=np.float32), "mu": mu_rows, "spks": spk_rows, "cond": cond_rows}
        times, steps_dt = euler_times(n_timesteps)
        x = np.stack(zs).astype(np.float32)
        for step in range(1, n_timesteps + 1):
            t, dt = times[step - 1], steps_dt[step - 1]
            feeds["x"] = np.concatenate([x, x])
            feeds["t"] = np.full(2 * k, t, dtype=np.float32)
            v = self._velocity(feeds, k, lanes)
            x = x + dt * ((np.float32(1.0) + cfg) * v[:k] - cfg * v[k:])
            if step < n_timesteps and between_steps is not None:
                between_steps()
        return [row.astype(np.float32) for row in x]

    def _velocity(self, feeds: Mapping[str, np.ndarray], k: int, lanes: CoresFree | None) -> np.ndarray:
        """The estimator's velocity (2k, n_mels, M) for `feeds`: one call, or its conditioned rows here and its
        unconditioned ones on the lane thread side by side when `lanes` says the cores are free and no other call of
        this runner is in flight."""
        with self._count_lock:
            self._in_flight += 1
            lane = self._lane if self._in_flight == 1 and lanes is not None and lanes() else None
        try:
            if lane is None:
                return np.asarray(self._estimator.run(["v"], feeds)[0])
            theirs = lane.submit(self._estimator.run, ["v"], {name: a[k:] for name, a in feeds.items()})
            try:
                mine = self._estimator.run(["v"], {name: a[:k] for name, a in feeds.items()})[0]
            finally:
                other = theirs.result()[0]
            return np.concatenate([mine, other])
        finally:
            with self._count_lock:
                self._in_flight -= 1

    def prepare(
        self,
        tokens: np.ndarray,
        prompt: FlowPrompt | np.ndarray,
        noise: np.ndarray,
        cache: FlowCache | None = None,
    ) -> tuple[FlowInput, FlowCache]:
        """Everything `inference` does before the solver: the solver's inputs and the cache for the next chunk.

        `noise` is (n_mels, P + M) with P the prompt's frames (0 for a built-in speaker) and M =
        mel_frames(len(tokens)). With a prompt, prompt ++ chunk tokens are encoded together, the prompt part
        is resized to P frames and the chunk part regulated to M (official InterpolateRegulator.inference).
        The cache holds z and mu of the P prompt frames and of the last mel_overlap_len frames.
        """
        p = as_flow_prompt(prompt)
        n_prompt = len(p.tokens)
        h, spks = self.encode(np.asarray([*p.tokens, *np.asarray(tokens).tolist()]), p.embedding)
        mu = self.mean(h[n_prompt:], self.mel_frames(len(h) - n_prompt), prompt_h=h[:n_prompt], prompt_frames=p.frames)
        z = np.array(noise, dtype=np.float32, copy=True) * np.float32(self.constants.temperature)
        if z.shape != mu.shape:
            raise ValueError(f"noise shape {z.shape} does not match mu {mu.shape}")
        if cache is not None and cache.frames:
            z[:, : cache.frames] = cache.z
            mu[:, : cache.frames] = cache.mu
        cond = np.zeros_like(mu)
        if p.mel is not None:
            cond[:, : p.frames] = p.mel.T
        keep = self.constants.mel_overlap_len
        new_cache = FlowCache(
            z=np.concatenate([z[:, : p.frames], z[:, -keep:]], axis=-1),
            mu=np.concatenate([mu[:, : p.frames], mu[:, -keep:]], axis=-1),
        )
        return FlowInput(mu, spks, z, cond, p.frames), new_cache

    def steps(self, n_timesteps: int | None) -> int:
        """Euler steps to run: the request's, else the bundle's."""
        return self.constants.n_timesteps if n_timesteps is None else n_timesteps

    def inference(
        self,
        tokens: np.ndarray,
        prompt: FlowPrompt | np.ndarray,
        noise: np.ndarray,
        cache: FlowCache | None = None,
        n_timesteps: int | None = None,
    ) -> tuple[np.ndarray, FlowCache]:
        """Mel (n_mels, M) for speech tokens (T,), M = mel_frames(T), and the cache for the next chunk.

        `prompt` is a FlowPrompt or a built-in speaker's raw x-vector. `noise` (n_mels, P + M) is the initial
        z (standard normal times temperature). A non-empty `cache` replaces the first cache.frames columns of
        z and mu, so overlapping streaming chunks share them (and the prompt frames).
        """
        inp, new_cache = self.prepare(tokens, prompt, noise, cache)
        return self.solve_inputs([inp], self.steps(n_timesteps))[0], new_cache
