"""The Euler solver's time grid, which the bundle's constants define (t_scheduler "cosine", n_timesteps): shared by the
flow solvers (service.layers.cfm, the U-Net flow's) and the exporter (a native twin's time table, export/time_table.py)."""

from __future__ import annotations

import math

import numpy as np


def cosine_t_span(n_timesteps: int) -> np.ndarray:
    """Time grid 1 - cos(linspace(0, 1, n + 1) * pi / 2) in float32, (n + 1,)."""
    lin = np.linspace(0.0, 1.0, n_timesteps + 1, dtype=np.float32)
    return np.asarray((np.float32(1.0) - np.cos(lin * np.float32(0.5 * math.pi))).astype(np.float32), dtype=np.float32)


def euler_times(n_timesteps: int) -> tuple[np.ndarray, np.ndarray]:
    """The time t each of the n Euler steps feeds its estimator and the step dt it takes, both (n,) float32, as the
    flow solvers walk them (`GuidedEuler.solve_steps`, the U-Net flow's own batch solve): t_span[0], then t + dt in
    float32 and dt = t_span[next] - t (so a step's t may differ from t_span[step] in its last bit). A native twin
    tabulates what its estimator computes from t alone at these times (export/time_table.py): the solves and the table
    use this one function."""
    t_span = cosine_t_span(n_timesteps)
    times = np.empty(n_timesteps, dtype=np.float32)
    steps = np.empty(n_timesteps, dtype=np.float32)
    t, dt = t_span[0], t_span[1] - t_span[0]
    for step in range(1, n_timesteps + 1):
        times[step - 1], steps[step - 1] = t, dt
        t = t + dt
        if step < n_timesteps:
            dt = t_span[step + 1] - t
    return times, steps
