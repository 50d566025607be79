"""Conditional flow matching, as every CosyVoice flow solves it: the Euler time grid, and the classifier-free-guided
Euler solve of a chunk-causal estimator whose guidance rows keep their own caches (CosyVoice2 and later)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from service.bundle import CACHE_SCALE_SUFFIX, ModelConstants
from service.bundle.solver import cosine_t_span as cosine_t_span
from service.bundle.solver import euler_times as euler_times
from service.layers.frame_cache import EstimatorState

# Feeds every guidance row of an estimator call reads whole (the rest are sliced per row).
SHARED_FEEDS = frozenset({"chunk", "start"})


def _cache_types(session: Any) -> set[str]:
    """The element types of an estimator graph's key caches (inputs `past_k_*`, their scales aside), read through a
    ShrinkingSession to its InferenceSession; none for objects without `get_inputs` (test doubles)."""
    inputs = getattr(getattr(session, "session", session), "get_inputs", None)
    caches = [i for i in (inputs() if inputs is not None else []) if i.name.startswith("past_k_")]
    return {i.type for i in caches if not i.name.endswith(CACHE_SCALE_SUFFIX)}


def frame_dtype(session: Any) -> type[np.floating]:
    """The type of an estimator graph's frames: float16 when it reads float16 caches (an int8 bundle's) or int8 frames
    with their scales (a native twin's, whose new frames come in float16), else float32 (also test doubles)."""
    return np.float16 if _cache_types(session) in ({"tensor(float16)"}, {"tensor(int8)"}) else np.float32


def reads_int8(session: Any) -> bool:
    """Whether an estimator graph reads its caches as int8 frames with their scales (a native twin's)."""
    return _cache_types(session) == {"tensor(int8)"}


class GuidedEuler:
    """Runs a chunk-causal estimator graph (inputs x, mu, t, spks, cond, its shared feeds, `tails`, the cache names
    `k_names`/`v_names`; outputs v, tails_out, new_k, new_v) through the Euler CFM solve with classifier-free guidance.

    Each guidance row is its own batch-1 call on that row's caches (FrameCache, appended in place). `cfg_lanes`: a call
    that runs alone (no other estimator call of this solver in flight) runs the two rows side by side, the second on a
    lane thread. The rows are independent (fp32: the same numbers as one batch-2 call; int8: each row quantizes its
    activations with its own scale instead of one scale for both).
    """

    def __init__(
        self,
        estimator: Any,
        constants: ModelConstants,
        noise: np.ndarray,
        k_names: Sequence[str],
        v_names: Sequence[str],
        *,
        cfg_lanes: bool = False,
        lane_init: Callable[[], None] | None = None,
    ) -> None:
        if constants.t_scheduler != "cosine":
            raise ValueError(f"unsupported t_scheduler {constants.t_scheduler!r} (only 'cosine')")
        self._estimator = estimator
        self.constants = constants
        self.noise = np.ascontiguousarray(noise, dtype=np.float32)  # (80, noise_frames)
        self._k_names, self._v_names = list(k_names), list(v_names)
        self._lanes = ThreadPoolExecutor(2, thread_name_prefix="cfg-lane", initializer=lane_init) if cfg_lanes else None
        self._in_flight = 0  # estimator calls running now (read and written under _count_lock)
        self._count_lock = threading.Lock()

    def close(self) -> None:
        if self._lanes is not None:
            self._lanes.shutdown(wait=False)

    def estimate(
        self,
        feeds: dict[str, np.ndarray],
        state: EstimatorState,
        keep: bool = True,
        *,
        wide: bool = True,
        dropping: tuple[int, int] = (0, 0),
    ) -> np.ndarray:
        """Velocity (2, 80, M) of the CFG rows for the new frames in `feeds`; extends `state` in place (its keys and
        values only with `keep`: a call no later call continues from needs none of them; `dropping`: what a window
        lets go of as they go in, FrameCache.append).

        Each guidance row is its own batch-1 call on its own caches: alone (no other estimator call of this solver
        in flight) and `wide`, the two run side by side on the lane thread and this one, else one after the other
        here (one batch-2 call was 6 % faster than two batch-1 calls, full size, but needs both rows' caches in one
        array). `wide` False keeps the call on one core (the other left to the decode steps).
        """
        with self._count_lock:
            self._in_flight += 1
            lanes = self._lanes if self._in_flight == 1 and wide else None
        try:
            if lanes is None:
                rows = [self._row(feeds, state, 0, keep, dropping), self._row(feeds, state, 1, keep, dropping)]
            else:
                other = lanes.submit(self._row, feeds, state, 1, keep, dropping)
                try:
                    mine = self._row(feeds, state, 0, keep, dropping)
                finally:
                    theirs = other.result()
                rows = [mine, theirs]
        finally:
            with self._count_lock:
                self._in_flight -= 1
        return np.stack(rows)

    def _row(
        self,
        feeds: Mapping[str, np.ndarray],
        state: EstimatorState,
        row: int,
        keep: bool = True,
        dropping: tuple[int, int] = (0, 0),
    ) -> np.ndarray:
        """The estimator on guidance row `row` alone: velocity (80, M); updates the row's tails and, with `keep`,
        appends its keys/values (letting go of `dropping` first, FrameCache.append)."""
        mine = {name: a if name in SHARED_FEEDS else a[row : row + 1] for name, a in feeds.items()}
        mine["tails"] = state.tails[row : row + 1]
        k, v = state.k[row], state.v[row]
        for cache, names in ((k, self._k_names), (v, self._v_names)):
            frames, scales = cache.feeds()
            mine.update(zip(names, frames, strict=True))
            if scales:  # a graph that reads int8 frames
                mine.update((name + CACHE_SCALE_SUFFIX, scale) for name, scale in zip(names, scales, strict=True))
        velocity, tails, new_k, new_v = self._estimator.run(None, mine)
        if keep:
            k.append(new_k, dropping)
            v.append(new_v, dropping)
        state.tails[row] = tails[0]
        return np.asarray(velocity[0], dtype=np.float32)

    def solve_steps(
        self,
        mu: np.ndarray,
        spks: np.ndarray,
        cond: np.ndarray,
        start: int,
        steps: Sequence[EstimatorState],
        shared: Mapping[str, np.ndarray],
        between_steps: Callable[[], None] | None = None,
        keep: bool = True,
        *,
        wide: bool = True,
        dropping: tuple[int, int] = (0, 0),
    ) -> np.ndarray:
        """Euler CFM with classifier-free guidance for new frames start..start+M-1 -> mel (80, M).

        mu, cond (80, M), spks (80,); the initial x is the fixed noise buffer's frames at the same positions. Row 0 of
        each estimator call is conditioned, row 1 sees zeros for mu, spks and cond; the velocity is (1 + cfg_rate) * v0
        - cfg_rate * v1. Step s reads and extends `steps[s]` (its keys and values only with `keep`); `shared` feeds go
        to both rows (the attention chunk, a position). `wide`: the guidance rows may run side by side (`estimate`).
        `dropping`: the frames every step's caches let go of as the new ones go in (a window, FrameCache.append).
        """
        frames = mu.shape[1]
        if start + frames > self.noise.shape[1]:
            raise ValueError(f"the flow's noise covers {self.noise.shape[1]} frames; this sequence needs {start + frames}")
        n_timesteps = len(steps)
        cfg = np.float32(self.constants.cfg_rate)
        zero = np.zeros_like(mu)
        feeds = {"mu": np.stack([mu, zero]), "spks": np.stack([spks, np.zeros_like(spks)]), "cond": np.stack([cond, zero])}
        feeds.update(shared)
        x = self.noise[:, start : start + frames] * np.float32(self.constants.temperature)
        times, steps_dt = euler_times(n_timesteps)
        for step in range(1, n_timesteps + 1):
            t, dt = times[step - 1], steps_dt[step - 1]
            feeds["x"] = np.stack([x, x])
            feeds["t"] = np.full(2, t, dtype=np.float32)
            v = self.estimate(feeds, steps[step - 1], keep, wide=wide, dropping=dropping)
            x = x + dt * ((np.float32(1.0) + cfg) * v[0] - cfg * v[1])
            if step < n_timesteps and between_steps is not None:
                between_steps()
        return np.asarray(x, dtype=np.float32)
