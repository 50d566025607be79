"""Recording without editing the official code: methods wrapped on object instances, torch RNG calls observed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np


def to_numpy(value: Any) -> np.ndarray:
    """A detached float32/int copy of a tensor or array (bool and integer dtypes kept)."""
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.is_floating_point():
            value = value.float()
        value = value.numpy()
    array = np.array(value, copy=True)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return array


@contextmanager
def wrapped(obj: Any, name: str, wrapper: Callable[..., Any]) -> Iterator[None]:
    """Set `obj.name` to `wrapper(original_bound_method, *args, **kwargs)` on this instance only, then remove it."""
    original = getattr(obj, name)
    had_own = name in vars(obj)

    def call(*args: Any, **kwargs: Any) -> Any:
        return wrapper(original, *args, **kwargs)

    setattr(obj, name, call)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)


@contextmanager
def observed_rng(log: list[tuple[str, np.ndarray]]) -> Iterator[None]:
    """Record every torch.rand / torch.randn_like draw (values unchanged) while the block runs."""
    import torch

    originals = {"rand": torch.rand, "randn_like": torch.randn_like}

    def recorder(kind: str) -> Callable[..., Any]:
        def draw(*args: Any, **kwargs: Any) -> Any:
            value = originals[kind](*args, **kwargs)
            log.append((kind, to_numpy(value)))
            return value

        return draw

    torch.rand, torch.randn_like = recorder("rand"), recorder("randn_like")
    try:
        yield
    finally:
        torch.rand, torch.randn_like = originals["rand"], originals["randn_like"]


class ForcedTokens:
    """A stand-in for Qwen2LM.sampling_ids: records the log-probs it is shown, returns the forced tokens, then EOS."""

    def __init__(self, tokens: list[int], eos: int) -> None:
        self.tokens = tokens
        self.eos = eos
        self.logp: list[np.ndarray] = []
        self.ignore_eos: list[bool] = []

    def __call__(self, weighted_scores: Any, decoded_tokens: list[int], sampling: int, ignore_eos: bool = True) -> int:
        self.logp.append(to_numpy(weighted_scores))  # before the official EOS masking
        self.ignore_eos.append(bool(ignore_eos))
        step = len(decoded_tokens)
        return self.tokens[step] if step < len(self.tokens) else self.eos
