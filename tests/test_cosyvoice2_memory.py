"""Where a CosyVoice2 stream's bytes go and their bounds, on the committed tiny bundle: the window on the estimator's
caches (CosyVoice3's mechanism, in the shared layer), a voice's prompt caches kept once for all of its streams
(read by every stream, never copied), every sentence's caches gone when it ends, the footprint admission reserves, and
the acoustic sessions' arena lever."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.sessions import ShrinkingSession, make_session_options, open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice2.engine import DEFAULT_WINDOW_S, CosyVoice2Engine
from service.families.cosyvoice2.flow import FlowState
from service.families.cosyvoice2.voice import Voice2
from service.layers.chunk_schedule import HopSchedule
from service.layers.frame_cache import FrameCache, PromptStates

ONE_THREAD = RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0)
STREAM = SynthesisOptions(stream=True, seed=0)


@pytest.fixture(scope="module")
def sessions(tiny_v2_bundle: Path) -> tuple[ModelBundle, dict[str, object]]:
    bundle = ModelBundle.load(tiny_v2_bundle)
    return bundle, open_sessions(bundle, ONE_THREAD)


def engine(sessions: tuple[ModelBundle, dict[str, object]], **kwargs: object) -> CosyVoice2Engine:
    bundle, graphs = sessions
    kwargs.setdefault("schedule", HopSchedule.early(25, 3, bundle.constants))
    return CosyVoice2Engine(bundle, graphs, **kwargs)  # type: ignore[arg-type]


def random_voice(prompt_tokens: int, seed: int) -> Voice2:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 6561, prompt_tokens))
    mel = rng.standard_normal((2 * prompt_tokens, 80)).astype(np.float32) - 5
    return Voice2.cloned("v", rng.standard_normal(192).astype(np.float32), tokens, mel)


def mels(eng: CosyVoice2Engine, tokens: list[int], voice: Voice2, fingerprint: str | None = None) -> list[np.ndarray]:
    return [c.mel for c in eng.mel_chunks(iter(tokens), voice.flow, STREAM, fingerprint=fingerprint, max_tokens=len(tokens))]


# ---- the window ------------------------------------------------------------------------------------


def test_the_window_lever_is_the_family_default_all_is_the_official_computation(tiny_v2_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_v2_bundle)
    graphs = open_sessions(bundle, ONE_THREAD)
    auto = CosyVoice2Engine.from_sessions(bundle, graphs, RuntimeOptions(max_batch=0, acoustic_slots=0, flow_window_s="auto"))
    assert auto.chunks.window == round(DEFAULT_WINDOW_S * 50) == 100  # 50 mel frames a second, whole chunks of 50
    official = CosyVoice2Engine.from_sessions(bundle, graphs, RuntimeOptions(max_batch=0, acoustic_slots=0, flow_window_s=None))
    assert official.chunks.window is None
    three = CosyVoice2Engine.from_sessions(bundle, graphs, RuntimeOptions(max_batch=0, acoustic_slots=0, flow_window_s=3.0))
    assert three.chunks.window == 150


def test_a_window_wider_than_the_sentence_changes_nothing(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    voice, tokens = random_voice(28, seed=1), np.random.default_rng(1).integers(0, 6561, 60).tolist()
    unbounded = mels(engine(sessions), tokens, voice)
    wide = mels(engine(sessions, window_s=60.0), tokens, voice)
    assert len(unbounded) == len(wide) and all(np.array_equal(a, b) for a, b in zip(unbounded, wide, strict=True))


def test_the_window_bounds_a_long_streams_caches_and_keeps_the_prompt(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    """12 s of speech: with a 2 s window the caches never hold more than the prompt and the window (a call's frames go
    in after the window let go of what they push out); without it they grow with the sentence. The audio keeps every
    frame, and differs only where frames lost context."""
    voice, tokens = random_voice(28, seed=2), np.random.default_rng(2).integers(0, 6561, 300).tolist()
    bounded, unbounded = StateBudget(None), StateBudget(None)
    windowed = engine(sessions, window_s=2.0, state_budget=bounded)
    got = mels(windowed, tokens, voice)
    full = mels(engine(sessions, state_budget=unbounded), tokens, voice)
    assert sum(m.shape[1] for m in got) == 2 * len(tokens) == sum(m.shape[1] for m in full)
    per_frame = windowed.flow.empty_state(10, capacity=1).bytes_per_frame()
    encoder = windowed.flow.prompt_state(voice.flow, 10).encoder
    per_token = encoder.nbytes() // encoder.tokens  # the encoder keeps every token (and copies its caches per call)
    encoder_bytes = 2 * per_token * (28 + len(tokens) + windowed.schedule.look_ahead)
    assert bounded.peak <= (2 * 28 + 100) * per_frame + encoder_bytes
    # both hold the same encoder caches: the difference is the generated frames the window let go
    assert unbounded.peak - bounded.peak >= (2 * len(tokens) - 100) * per_frame
    assert np.array_equal(got[0], full[0]) and np.array_equal(got[1], full[1])  # before the window fills: the same


# ---- a voice's prompt caches, once ---------------------------------------------------------------------


def test_streams_of_one_voice_read_its_prompt_caches_once_and_let_go_when_they_end(
    sessions: tuple[ModelBundle, dict[str, object]],
) -> None:
    eng = engine(sessions)
    voice = random_voice(64, seed=3)  # (64 - 3) // 25 = 2 whole chunks: 100 frames depend on the prompt alone
    tokens = np.random.default_rng(3).integers(0, 6561, 60).tolist()
    alone = mels(engine(sessions), tokens, voice)  # no fingerprint: a state of its own
    first = eng.mel_chunks(iter(tokens), voice.flow, STREAM, fingerprint=voice.fingerprint, max_tokens=60)
    second = eng.mel_chunks(iter(tokens), voice.flow, STREAM, fingerprint=voice.fingerprint, max_tokens=60)
    heads = [next(first), next(second)]  # both streams hold their caches now
    (state,) = [eng.prompt_states.get((voice.fingerprint, 10, 64))]
    assert state is not None and state.frames == 100
    kept = [c for s in state.steps for c in (*s.k, *s.v)]
    assert all(c.frozen and c.frames == 100 for c in kept)
    readers = [r for r in gc.get_referrers(*kept) if isinstance(r, FrameCache)]
    assert len(readers) == 2 * len(kept)  # every cache of both streams reads the state's frames ...
    for reader in readers:  # ... as its head, and holds only the frames after them
        assert any(reader.head is c for c in kept) and reader.base == 100 and reader.frames > 100
        assert not any(np.shares_memory(reader.buffer, c.buffer) for c in kept)
    rest = [[c.mel for c in first], [c.mel for c in second]]
    for got in ([heads[0].mel, *rest[0]], [heads[1].mel, *rest[1]]):
        assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(alone, got, strict=True))
    del first, second, readers, reader
    gc.collect()
    assert not [r for r in gc.get_referrers(*kept) if isinstance(r, FrameCache)]
    with pytest.raises(ValueError, match="frozen"):
        kept[0].append(np.zeros((1, 1, 1, 1, 1), np.float32))


def test_a_state_dropped_while_a_stream_views_it_lives_until_the_stream_ends(
    sessions: tuple[ModelBundle, dict[str, object]],
) -> None:
    eng = engine(sessions)
    eng.chunks.prompt_states = PromptStates(1 << 30, max_states=1)
    one, other = random_voice(64, seed=4), random_voice(64, seed=5)
    tokens = np.random.default_rng(4).integers(0, 6561, 60).tolist()
    want = mels(engine(sessions), tokens, one)
    stream = eng.mel_chunks(iter(tokens), one.flow, STREAM, fingerprint=one.fingerprint, max_tokens=60)
    head = next(stream)
    mels(eng, tokens, other, other.fingerprint)  # the other voice's state takes the only place
    assert eng.chunks.prompt_states.get((one.fingerprint, 10, 64)) is None
    got = [head.mel, *(c.mel for c in stream)]
    assert all(np.allclose(a, b, atol=1e-5) for a, b in zip(want, got, strict=True))


# ---- a sentence's caches end with it --------------------------------------------------------------------


def live_flow_states() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, FlowState))


def test_every_sentences_caches_are_gone_once_it_ends(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    budget = StateBudget(None)
    eng = engine(sessions, state_budget=budget)
    voice = random_voice(28, seed=6)
    before = live_flow_states()
    chunks: Iterator[object] = eng.synthesize([[1, 2, 3, 4], [5, 6, 7, 8]], voice, STREAM, threading.Event())
    sentence = 0
    for chunk in chunks:
        index = chunk.sentence_index  # type: ignore[attr-defined]
        if index != sentence:  # the second sentence's first chunk: the first's caches have gone
            assert live_flow_states() - before <= 2  # the voice's prompt state and this sentence's
            assert budget.used == budget.held(object()) or budget.used < budget.peak
            sentence = index
    assert sentence == 1 and budget.used == 0
    assert live_flow_states() - before <= 1  # only the voice's prompt state stays (for its next request)


# ---- what a request may hold ------------------------------------------------------------------------------


def test_the_footprint_bounds_what_a_streamed_sentence_reserves(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    budget = StateBudget(None)
    eng = engine(sessions, window_s=2.0, state_budget=budget)
    voice = random_voice(28, seed=7)
    options = SynthesisOptions(stream=True, seed=0, max_sentence_speech_s=12.0)
    footprint = eng.request_footprint(voice, [20], options)
    tokens = np.random.default_rng(7).integers(0, 6561, 300).tolist()  # the 12 s the cap allows
    list(eng.mel_chunks(iter(tokens), voice.flow, options, max_tokens=300))
    caches = dict(footprint.parts)
    assert budget.peak <= caches["estimator caches"] + caches["encoder caches"]
    assert footprint.total > caches["estimator caches"] and footprint.speech_s == 12.0
    whole = eng.request_footprint(voice, [20], SynthesisOptions(stream=False, max_sentence_speech_s=12.0))
    assert dict(whole.parts)["flow attention"] == 7 * 4 * 8 * (2 * (28 + 300)) ** 2
    worst = eng.worst_footprint(options)
    assert worst.total >= footprint.total and "estimator caches" in worst.describe()


# ---- the acoustic arena ---------------------------------------------------------------------------------


def test_the_acoustic_arena_lever_shrinks_keeps_or_turns_off_the_flow_and_hift_arenas(tiny_v2_bundle: Path) -> None:
    bundle = ModelBundle.load(tiny_v2_bundle)
    for arena, shrinking, on in (("shrink", True, True), ("keep", False, True), ("off", False, False)):
        opts = RuntimeOptions(intra_op_threads=1, acoustic_arena=arena, native_kernels="off")  # type: ignore[arg-type]
        graphs = open_sessions(bundle, opts, names=("hift_f0", "llm_embed"))
        assert isinstance(graphs["hift_f0"], ShrinkingSession) is shrinking
        assert make_session_options(opts, "hift_f0").enable_cpu_mem_arena is on
        assert make_session_options(opts, "llm_embed").enable_cpu_mem_arena  # the LLM's stays
