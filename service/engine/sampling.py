"""Repetition-aware sampling (RAS, VALL-E 2) of speech tokens, as the official LLMs of every served family do it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """ras_sampling parameters (the bundle's constants carry the official values)."""

    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1


def softmax(scores: np.ndarray) -> np.ndarray:
    """float32 softmax of a 1-D score vector; -inf entries get probability exactly 0."""
    s = np.asarray(scores, dtype=np.float32)
    e = np.exp(s - s.max())
    return np.asarray((e / e.sum(dtype=np.float32)).astype(np.float32, copy=False), dtype=np.float32)


def draw_index(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw: the index whose cumulative mass first exceeds `u * total` (u in [0, 1)).

    Weights need not sum to 1 (like torch.multinomial); zero-weight entries are never chosen.
    """
    cdf = np.cumsum(probs, dtype=np.float64)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    return min(idx, len(cdf) - 1)


def nucleus_candidates(probs: np.ndarray, top_p: float, top_k: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and probabilities kept by nucleus filtering, in stable descending order.

    Tokens are taken from the top while the running float32 sum is still below `top_p` and fewer
    than `top_k` are kept, so the token that crosses `top_p` is included.
    """
    k = min(top_k, probs.size)
    # Only the k largest can be kept; selecting them first avoids a full sort of the vocabulary.
    # Ties at the k-th value are resolved by index, exactly like a stable sort of everything.
    kth = np.partition(probs, probs.size - k)[probs.size - k]
    cand = np.flatnonzero(probs >= kth)
    order = cand[np.argsort(-probs[cand], kind="stable")][:k]
    kept_p = probs[order]
    running = np.cumsum(kept_p, dtype=np.float32)
    before = np.concatenate(([np.float32(0.0)], running[:-1]))
    n = int(np.count_nonzero(before < np.float32(top_p)))
    return order[:n], kept_p[:n]


def ras_sampling(
    logp: np.ndarray,
    history: Sequence[int],
    rng: np.random.Generator,
    params: SamplingParams,
    *,
    eos: int,
    ignore_eos: bool,
) -> int:
    """Sample one token from log-probs `logp` (V,) given the tokens decoded so far.

    Every stop token (the ids from `eos` up: EOS and any stop tokens after it) is masked first when `ignore_eos`
    (before min_len) and stays masked for the fallback draw, as the official vLLM path's `min_tokens` does (its plain
    torch path masks EOS alone and stops on a later stop token drawn before min_len; with one stop token the two agree).
    If the nucleus pick occurs in the last `win_size` tokens at least `win_size * tau_r` times,
    it is masked and the token is redrawn from the full distribution. `logp` is not modified.
    """
    scores = np.array(logp, dtype=np.float32, copy=True)
    if ignore_eos:
        scores[eos:] = -np.inf
    ids, probs = nucleus_candidates(softmax(scores), params.top_p, params.top_k)
    token = int(ids[draw_index(probs, float(rng.random()))])
    window = history[-params.win_size :] if params.win_size > 0 else ()
    repeats = sum(1 for t in window if t == token)
    if params.win_size > 0 and repeats >= params.win_size * params.tau_r:
        scores[token] = -np.inf
        token = draw_index(softmax(scores), float(rng.random()))
    return token
