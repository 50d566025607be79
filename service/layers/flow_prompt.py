"""What a chunk-causal flow is conditioned on by a cloned voice: its prompt speech tokens, their mel and the x-vector."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, eq=False)
class FlowPrompt:
    """The flow's side: prompt speech tokens (P,), prompt mel (2P, 80) at 50 frames/s, raw x-vector (192,).

    A built-in (spk2info) speaker has no tokens and no mel. The official frontend cuts the mel to exactly
    two frames per token; the families' cloned voices do the same.
    """

    embedding: np.ndarray
    tokens: tuple[int, ...] = ()
    mel: np.ndarray = field(default_factory=lambda: np.zeros((0, 80), dtype=np.float32))

    def __post_init__(self) -> None:
        object.__setattr__(self, "embedding", np.ascontiguousarray(self.embedding, dtype=np.float32).reshape(-1))
        object.__setattr__(self, "mel", np.ascontiguousarray(self.mel, dtype=np.float32))
        if self.mel.ndim != 2 or self.mel.shape[0] != 2 * len(self.tokens):
            n = len(self.tokens)
            raise ValueError(f"a prompt of {n} tokens needs a ({2 * n}, 80) mel, got {self.mel.shape}")

    def window(self, tokens: int | None) -> FlowPrompt:
        """The last `tokens` prompt tokens with their mel frames and the same x-vector (itself when the prompt is no
        longer, or `tokens` is None)."""
        if tokens is None or tokens >= len(self.tokens):
            return self
        cut = len(self.tokens) - tokens
        return FlowPrompt(self.embedding, self.tokens[cut:], self.mel[2 * cut :])
