"""What a Fun-CosyVoice3 request reserves, on the committed tiny bundle: its footprint bounds what a streamed sentence
of a saved voice makes its DiT caches hold (and is not far above it), and the full-attention calls of a whole sentence
and of the official recompute stream; the worst case is stated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.footprint import attention_bytes
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice3.contract import GRAPH_IO
from service.families.cosyvoice3.engine import CosyVoice3Engine
from service.families.cosyvoice3.footprint import tails_bytes
from service.families.cosyvoice3.voice import Voice3
from service.layers.chunk_schedule import HopSchedule
from service.layers.frame_cache import CachePrecision, FrameCache, frame_bytes

ONE = RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0)
PROMPT_TOKENS = 28  # a 1.1 s recording: one whole chunk the voice's prompt state holds, 3 tokens each call solves
CAP_S = 12.0  # the sentence cap: 300 speech tokens at 25 a second
SPEECH = 300


class FramesSeen:
    """The tiny DiT estimator, recording the most frames one call attends over (its new frames and its cached ones)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.session = getattr(inner, "session", inner)  # what cfm.frame_dtype reads the cache type from
        self.most = 0

    def run(self, names: Any, feeds: dict[str, np.ndarray]) -> Any:
        self.most = max(self.most, feeds["x"].shape[-1] + feeds["past_k_0"].shape[1])
        return self.inner.run(names, feeds)


@pytest.fixture(scope="module")
def sessions(tiny_v3_bundle: Path) -> tuple[ModelBundle, dict[str, Any]]:
    bundle = ModelBundle.load(tiny_v3_bundle)
    return bundle, open_sessions(bundle, ONE, names=tuple(GRAPH_IO))


def saved_voice(seed: int) -> Voice3:
    """A cloned voice as a saved one is: prompt tokens, their mel, an x-vector and a transcript (its fingerprint names
    it, so its prompt state is kept and every stream continues from a copy)."""
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 6561, PROMPT_TOKENS))
    mel = rng.standard_normal((2 * PROMPT_TOKENS, 80)).astype(np.float32) - 5
    return Voice3.cloned("saved", rng.standard_normal(192).astype(np.float32), tokens, mel, (5, 6, 7), (1, 2))


def speech(seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 6561, SPEECH).tolist()  # no silent-token runs: all reach the flow


def test_the_footprint_bounds_the_dit_caches_a_streamed_sentence_of_a_saved_voice_holds(
    sessions: tuple[ModelBundle, dict[str, Any]],
) -> None:
    """12 s of speech through a 2 s window: what the stream reserves (its caches' bytes after each call, the prompt's
    frames included) stays under the footprint's DiT parts and within 10 % of them."""
    bundle, opened = sessions
    budget = StateBudget(None)
    eng = CosyVoice3Engine(bundle, opened, schedule=HopSchedule.early(25, 3, bundle.constants), window_s=2.0,
                           state_budget=budget)  # fmt: skip
    voice = saved_voice(1)
    options = SynthesisOptions(stream=True, seed=0, max_sentence_speech_s=CAP_S)
    found = eng.request_footprint(voice, [20], options)
    chunks = eng.mel_chunks(iter(speech(1)), voice.flow, options, fingerprint=voice.fingerprint, max_tokens=SPEECH)
    assert sum(c.mel.shape[1] for c in chunks) == 2 * SPEECH
    parts = dict(found.parts)
    held = parts["DiT caches"] + parts["DiT tails"]
    assert 0.9 * held <= budget.peak <= held
    assert eng.flow.empty_state(10, capacity=0).nbytes() == parts["DiT tails"] == tails_bytes(eng.extra, 10)
    assert found.speech_s == CAP_S and found.total > held and "LLM K/V" in parts and "vocoder" in parts
    fewer = eng.request_footprint(voice, [20], SynthesisOptions(stream=True, n_timesteps=5, max_sentence_speech_s=CAP_S))
    assert dict(fewer.parts)["DiT caches"] == parts["DiT caches"] // 2  # the caches are per Euler step
    unbounded = CosyVoice3Engine(bundle, opened, schedule=HopSchedule.early(25, 3, bundle.constants))
    assert dict(unbounded.request_footprint(voice, [20], options).parts)["DiT caches"] > 2 * parts["DiT caches"]


@pytest.mark.parametrize("recompute", [False, True], ids=["whole", "official-stream"])
def test_the_footprint_bounds_the_full_attention_of_a_whole_sentence_and_of_the_official_stream(
    sessions: tuple[ModelBundle, dict[str, Any]], recompute: bool
) -> None:
    """Without the caches (a whole file, or `stream_schedule=official`) a call attends over the whole prompt and the
    sentence so far: the footprint's attention is that of the longest call the engine made, and it reserves no caches."""
    bundle, opened = sessions
    seen = FramesSeen(opened["flow_estimator"])
    budget = StateBudget(None)
    schedule = HopSchedule.official(25, 3, bundle.constants)
    eng = CosyVoice3Engine(bundle, {**opened, "flow_estimator": seen}, schedule=schedule, recompute=recompute,
                           state_budget=budget)  # fmt: skip
    voice = saved_voice(2)
    options = SynthesisOptions(stream=recompute, seed=0, max_sentence_speech_s=CAP_S)
    found = dict(eng.request_footprint(voice, [20], options).parts)
    chunks = list(eng.mel_chunks(iter(speech(2)), voice.flow, options, fingerprint=voice.fingerprint, max_tokens=SPEECH))
    assert sum(c.mel.shape[1] for c in chunks) == 2 * SPEECH
    assert seen.most == 2 * (PROMPT_TOKENS + SPEECH)
    assert found["flow attention"] == attention_bytes(eng.extra.estimator_heads, seen.most)
    assert budget.peak == 0 and "DiT caches" not in found


def test_the_worst_case_is_stated_for_streams_and_whole_files(sessions: tuple[ModelBundle, dict[str, Any]]) -> None:
    bundle, opened = sessions
    eng = CosyVoice3Engine(bundle, opened, schedule=HopSchedule.early(25, 3, bundle.constants), window_s=4.0)
    options = SynthesisOptions(stream=True, max_sentence_speech_s=CAP_S)
    worst = eng.worst_footprint(options)
    assert worst.total >= eng.request_footprint(saved_voice(3), [20], options).total
    assert "DiT caches" in worst.describe() and "LLM K/V" in worst.describe()
    whole = dict(eng.worst_footprint(SynthesisOptions(stream=False, max_sentence_speech_s=CAP_S)).parts)
    assert whole["flow attention"] == attention_bytes(eng.extra.estimator_heads, 2 * (750 + SPEECH))  # a 30 s prompt


@pytest.mark.parametrize("precision", ["graph", "float16", "int8"])
def test_a_frame_caches_bytes_are_its_filled_frames_of_every_block(precision: CachePrecision) -> None:
    """What the budget counts for a cache is what its filled frames take in its arrays, every block's (the DiT has 22
    blocks at full size: a count of one block's bytes let the streams' caches hold 22 times their budget)."""
    cache = FrameCache.empty(3, 4, 16, np.float16, 8, precision)
    cache.append(np.ones((3, 1, 5, 4, 16), dtype=np.float32))
    filled = sum(a[:, : cache.frames].nbytes for a in cache.arrays())
    assert cache.nbytes() == filled == 5 * cache.bytes_per_frame()
    assert cache.bytes_per_frame() == frame_bytes(3, 4, 16, np.float16, precision)
