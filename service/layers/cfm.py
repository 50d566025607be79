"""Conditional flow matching, as every CosyVoice flow solves it: the Euler time grid."""

from __future__ import annotations

import math

import numpy as np


def cosine_t_span(n_timesteps: int) -> np.ndarray:
    """Time grid 1 - cos(linspace(0, 1, n + 1) * pi / 2) in float32, (n + 1,)."""
    lin = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    return np.asarray((np.float32(1.0) - np.cos(lin * np.float32(0.5 * math.pi))).astype(np.float32), dtype=np.float32)
