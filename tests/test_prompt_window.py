"""The flow's prompt window: streamed chunks of a cloned voice see the last frames of its prompt; None keeps all."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.flow import FlowRunner
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import RequestContext, stream_sentence, whole_sentence
from service.families.cosyvoice1.token2wav import GeneratorNoise, Token2Wav, WavChunk
from service.families.cosyvoice1.voice import FlowPrompt
from service.layers.hift import HiFTRunner

PROMPT_TOKENS, PROMPT_FRAMES = 150, 258  # a 3 s recording: 50 tokens and 86 mel frames per second


def prompt(seed: int = 0) -> FlowPrompt:
    g = np.random.default_rng(seed)
    mel = g.standard_normal((PROMPT_FRAMES, 80)).astype(np.float32) - 5
    return FlowPrompt(g.standard_normal(192).astype(np.float32), tuple(int(t) for t in g.integers(0, 4096, PROMPT_TOKENS)), mel)


def test_window_keeps_the_last_frames_with_their_share_of_tokens() -> None:
    p = prompt()
    assert p.window(None) is p and p.window(PROMPT_FRAMES) is p and p.window(10_000) is p
    w = p.window(86)
    assert w.frames == 86 and w.mel is not None and p.mel is not None
    np.testing.assert_array_equal(w.mel, p.mel[-86:])
    assert w.tokens == p.tokens[-50:]  # 86 of 258 frames: a third of the 150 tokens
    np.testing.assert_array_equal(w.embedding, p.embedding)
    empty = p.window(0)
    assert empty.frames == 0 and empty.tokens == () and empty.mel is None


class Recording(Token2Wav):
    def __init__(self, inner: Token2Wav) -> None:
        super().__init__(inner.flow, inner.hift, inner.constants)
        self.solver_frames: list[int] = []

    def __call__(self, tokens: Sequence[int] | np.ndarray, *args: Any, **kwargs: Any) -> WavChunk:
        wav = super().__call__(tokens, *args, **kwargs)
        self.solver_frames.append(wav.solver_frames)
        return wav


@pytest.fixture(scope="module")
def t2w(tiny_bundle: Path) -> Recording:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1))
    c = bundle.constants
    return Recording(Token2Wav(FlowRunner(sessions, c), HiFTRunner(sessions, c), c))


def _context(t2w: Token2Wav, window: int | None) -> RequestContext:
    c = t2w.constants
    ctx = RequestContext.alone(GeneratorNoise(np.random.default_rng(1)), ScheduleConfig.official(c), c.sample_rate)
    ctx.prompt_window_frames = window
    return ctx


def test_streamed_chunks_solve_only_the_window(t2w: Recording) -> None:
    c = t2w.constants
    tokens = list(range(1, 231))  # official hops: chunks of 120, 120 and 30 tokens
    for window, seen in ((None, PROMPT_FRAMES), (86, 86)):
        t2w.solver_frames.clear()
        chunks = list(stream_sentence(tokens, prompt(), t2w, _context(t2w, window)))
        assert len(chunks) == 3 and all(ch.audio.size for ch in chunks)
        want = [seen + c.tokens_to_mel_frames(n) for n in (120, 120, 30)]
        assert t2w.solver_frames == want


def test_non_streamed_sentences_see_the_whole_prompt(t2w: Recording) -> None:
    t2w.solver_frames.clear()
    (chunk,) = whole_sentence(list(range(1, 61)), prompt(), t2w, _context(t2w, 86))
    assert chunk.audio.size and t2w.solver_frames == [PROMPT_FRAMES + t2w.constants.tokens_to_mel_frames(60)]
