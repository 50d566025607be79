"""The v1 token2wav state machine: replay of the official streaming run (stream.npz) and the chunk schedule."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle, ModelConstants
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.families.cosyvoice1.flow import FlowRunner
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import RequestContext, default_first_hop, stream_sentence, whole_sentence
from service.families.cosyvoice1.token2wav import GeneratorNoise, NoiseSource, ReplayNoise, SentenceState, Token2Wav, WavChunk
from service.layers.hift import HiFTNoise, HiFTRunner
from service.layers.mel_stream import TAIL_WAIT_S

ACOUSTIC_GRAPHS = ("flow_encoder", "flow_lr", "flow_estimator", "hift_f0", "hift_source", "hift_decode")


@pytest.fixture(scope="module")
def t2w(tiny_bundle: Path) -> Token2Wav:
    bundle = ModelBundle.load(tiny_bundle)
    sessions = open_sessions(bundle, RuntimeOptions(intra_op_threads=1), names=ACOUSTIC_GRAPHS)
    c = bundle.constants
    return Token2Wav(FlowRunner(sessions, c), HiFTRunner(sessions, c), c)


@pytest.fixture(scope="module")
def ref(ref_dir: Path) -> Any:
    return np.load(ref_dir / "stream.npz")


def fixed(c: ModelConstants, noise: NoiseSource, first_hop: int = 100, **kw: Any) -> RequestContext:
    """A request on its own with the fixed schedule: `first_hop`, then the official hops."""
    return RequestContext.alone(noise, ScheduleConfig.official(c).with_first_hop(first_hop), c.sample_rate, **kw)


def _replay(ref: Any) -> ReplayNoise:
    n = int(ref["n_chunks"])
    flow = [ref[f"chunk{k}_flow_noise"][0] for k in range(n)]
    hift = [HiFTNoise(ref[f"chunk{k}_hift_phase_used"][0, :, 0], ref[f"chunk{k}_hift_sine_noise"][0]) for k in range(n)]
    return ReplayNoise(flow, hift)


class RecordingT2W(Token2Wav):
    """Token2Wav that logs (first token, token count, finalize) of each call."""

    def __init__(self, inner: Token2Wav) -> None:
        super().__init__(inner.flow, inner.hift, inner.constants)
        self.calls: list[tuple[int, bool]] = []

    def __call__(self, tokens: Sequence[int] | np.ndarray, *args: Any, finalize: bool, **kwargs: Any) -> WavChunk:
        self.calls.append((len(tokens), finalize))
        return super().__call__(tokens, *args, finalize=finalize, **kwargs)


def test_replay_official_stream(t2w: Token2Wav, ref: Any) -> None:
    rec = RecordingT2W(t2w)
    chunks = list(stream_sentence(ref["tokens"].tolist(), ref["embedding"], rec, fixed(rec.constants, _replay(ref))))
    n = int(ref["n_chunks"])
    assert rec.calls == list(zip(ref["chunk_token_len"].tolist(), ref["chunk_finalize"].tolist(), strict=True))
    assert [len(ch.audio) for ch in chunks] == ref["chunk_yield_samples"].tolist()
    assert [ch.is_last for ch in chunks] == [False] * (n - 1) + [True]
    for k, ch in enumerate(chunks):
        np.testing.assert_allclose(ch.audio, ref[f"chunk{k}_yielded"][0], atol=1e-4, rtol=0, err_msg=f"chunk {k}")
    np.testing.assert_allclose(np.concatenate([ch.audio for ch in chunks]), ref["audio"][0], atol=1e-4, rtol=0)


def test_replay_caches_chunk_by_chunk(t2w: Token2Wav, ref: Any) -> None:
    state, noise = t2w.new_state(), _replay(ref)
    starts, lens, finals = ref["chunk_token_start"], ref["chunk_token_len"], ref["chunk_finalize"]
    for k in range(int(ref["n_chunks"])):
        _check_state_before(state, ref, k)
        tokens = ref["tokens"][starts[k] : starts[k] + lens[k]]
        np.testing.assert_array_equal(tokens, ref[f"chunk{k}_token"])
        t2w(tokens, ref["embedding"], state, noise, finalize=bool(finals[k]))
        flow_cache = np.stack([state.flow_cache.z, state.flow_cache.mu], axis=-1)
        np.testing.assert_allclose(flow_cache, ref[f"chunk{k}_flow_cache_out"][0], atol=1e-4, rtol=0)
        if not finals[k]:
            assert state.hift is not None
            np.testing.assert_allclose(state.mel_overlap, ref[f"chunk{k}_mel_overlap_out"][0], atol=1e-3, rtol=0)
            np.testing.assert_allclose(state.hift.mel, ref[f"chunk{k}_hift_cache_out_mel"][0], atol=1e-3, rtol=0)
            np.testing.assert_allclose(state.hift.source, ref[f"chunk{k}_hift_cache_out_source"][0, 0], atol=1e-4, rtol=0)
            np.testing.assert_allclose(state.hift.speech, ref[f"chunk{k}_hift_cache_out_speech"][0], atol=1e-4, rtol=0)


def _check_state_before(state: SentenceState, ref: Any, k: int) -> None:
    assert state.flow_cache.frames == ref[f"chunk{k}_flow_cache_in"].shape[2]
    np.testing.assert_allclose(state.mel_overlap, ref[f"chunk{k}_mel_overlap_in"][0], atol=1e-3, rtol=0)
    if k == 0:
        assert state.hift is None
    else:
        assert state.hift is not None
        np.testing.assert_allclose(state.hift.source, ref[f"chunk{k}_hift_cache_in_source"][0, 0], atol=1e-4, rtol=0)


def test_small_first_hop_gives_early_short_chunk(t2w: Token2Wav, ref: Any) -> None:
    c = t2w.constants
    rec = RecordingT2W(t2w)
    noise = GeneratorNoise(np.random.default_rng(0))
    chunks = list(stream_sentence(ref["tokens"].tolist(), ref["embedding"], rec, fixed(c, noise, 30)))
    assert rec.calls == [(50, False), (120, False), (100, True)]  # windows [0,50), [30,150), [130,230)
    first = (c.tokens_to_mel_frames(50) - c.mel_overlap_len - c.mel_cache_len) * c.mel_hop_samples
    assert len(chunks[0].audio) == first == 8192
    assert len(chunks[1].audio) == (c.tokens_to_mel_frames(120) - c.mel_overlap_len) * c.mel_hop_samples
    for ch in chunks:
        assert ch.audio.dtype == np.float32 and np.abs(ch.audio).max() <= c.audio_limit
        assert ch.flow_s > 0 and ch.hift_s > 0 and ch.llm_s >= 0


def test_short_sentence_streams_as_one_final_chunk(t2w: Token2Wav, ref: Any) -> None:
    tokens = ref["tokens"][:45].tolist()  # < first_hop + overlap: no streaming chunk, like the official code
    c = t2w.constants
    streamed = list(stream_sentence(tokens, ref["embedding"], t2w, fixed(c, GeneratorNoise(np.random.default_rng(4)), 30)))
    whole = list(whole_sentence(tokens, ref["embedding"], t2w, fixed(c, GeneratorNoise(np.random.default_rng(4)))))
    assert len(streamed) == len(whole) == 1 and streamed[0].is_last
    np.testing.assert_array_equal(streamed[0].audio, whole[0].audio)
    assert len(whole[0].audio) == t2w.constants.tokens_to_mel_frames(45) * t2w.constants.mel_hop_samples


def test_speed_stretches_whole_sentence(t2w: Token2Wav, ref: Any) -> None:
    tokens = ref["tokens"][:60].tolist()
    frames = t2w.constants.tokens_to_mel_frames(60)
    for speed in (2.0, 0.5):
        ctx = fixed(t2w.constants, GeneratorNoise(np.random.default_rng(1)), speed=speed)
        (chunk,) = whole_sentence(tokens, ref["embedding"], t2w, ctx)
        assert len(chunk.audio) == int(frames / speed) * t2w.constants.mel_hop_samples


def test_speed_needs_fresh_state(t2w: Token2Wav, ref: Any) -> None:
    state, noise = t2w.new_state(), GeneratorNoise(np.random.default_rng(0))
    t2w(ref["tokens"][:120], ref["embedding"], state, noise, finalize=False)
    with pytest.raises(ValueError, match="speed"):
        t2w(ref["tokens"][100:130], ref["embedding"], state, noise, finalize=True, speed=1.5)


# ---- chunk schedule, checked with a fake vocoder (no graphs) ---------------------------------------


class FakeT2W(Token2Wav):
    """Returns one sample per token so the schedule is visible; records each window."""

    def __init__(self, constants: ModelConstants) -> None:  # no graphs needed
        self.constants = constants
        self.windows: list[list[int]] = []

    def __call__(
        self,
        tokens: Sequence[int] | np.ndarray,
        embedding: np.ndarray,
        state: SentenceState,
        noise: NoiseSource,
        *,
        finalize: bool,
        speed: float = 1.0,
        n_timesteps: int | None = None,
        between_steps: Any = None,
        **cores: Any,
    ) -> WavChunk:
        self.windows.append(list(tokens))
        return WavChunk(np.asarray(tokens, dtype=np.float32), 0.0, 0.0)


def _windows(constants: ModelConstants, n_tokens: int, first_hop: int) -> list[tuple[int, int]]:
    fake, noise = FakeT2W(constants), GeneratorNoise(np.random.default_rng())
    list(stream_sentence(range(n_tokens), np.zeros(192, np.float32), fake, fixed(constants, noise, first_hop)))
    return [(w[0], w[-1] + 1) for w in fake.windows]


def test_official_schedule_and_small_first_hop() -> None:
    c = ModelConstants()
    assert _windows(c, 230, 100) == [(0, 120), (100, 220), (200, 230)]
    assert _windows(c, 230, 30) == [(0, 50), (30, 150), (130, 230)]
    assert _windows(c, 119, 100) == [(0, 119)]
    assert _windows(c, 50, 30) == [(0, 50), (30, 50)]  # exactly hop + overlap: one chunk plus the 20-token final


class EndingTokens:
    """A token stream that can tell its end without taking a token (as the scheduler's TokenStream does); records the
    waits it was asked for."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self._tokens = list(tokens)
        self._taken = 0
        self.waits: list[float] = []

    def __iter__(self) -> EndingTokens:
        return self

    def __next__(self) -> int:
        if self._taken == len(self._tokens):
            raise StopIteration
        self._taken += 1
        return self._tokens[self._taken - 1]

    def ended(self, wait_s: float = 0.0) -> bool:
        self.waits.append(wait_s)
        return self._taken == len(self._tokens)


class DecodedAhead(EndingTokens):
    """The same, every token already decoded when the first is taken (the LLM ran ahead of the flow)."""

    def ready(self) -> int:
        return len(self._tokens) - self._taken


def _adaptive_windows(n_tokens: int, *, tail: bool, ahead: bool = False) -> tuple[list[tuple[int, int]], list[float]]:
    """Windows of the adaptive schedule with nothing measured, without short hops (hops 21, then 100), over a stream
    that tells its end."""
    c = ModelConstants()
    fake, tokens = FakeT2W(c), (DecodedAhead if ahead else EndingTokens)(range(n_tokens))
    schedule = dataclasses.replace(ScheduleConfig.default(c, tail=tail), short_hop=0)
    ctx = RequestContext.alone(GeneratorNoise(np.random.default_rng()), schedule, c.sample_rate)
    list(stream_sentence(tokens, np.zeros(192, np.float32), fake, ctx))
    return [(w[0], w[-1] + 1) for w in fake.windows], tokens.waits


def test_a_sentence_ending_within_one_overlap_after_a_chunk_is_that_chunk() -> None:
    """The look-ahead tail: a chunk cut with at most two overlaps (40 tokens) after its hop, when the stream has ended,
    is the sentence's last and takes them along; one more token and the last call keeps them (official split)."""
    assert _adaptive_windows(141, tail=True)[0] == [(0, 41), (21, 141)]  # exactly hop + overlap after the first
    assert _adaptive_windows(141, tail=False)[0] == [(0, 41), (21, 141), (121, 141)]
    assert _adaptive_windows(161, tail=True)[0] == [(0, 41), (21, 141), (121, 161)]  # 20 more, not decoded yet
    assert _adaptive_windows(161, tail=True, ahead=True)[0] == [(0, 41), (21, 161)]  # 40 after the hop, decoded
    assert _adaptive_windows(162, tail=True, ahead=True)[0] == [(0, 41), (21, 141), (121, 162)]
    windows, waits = _adaptive_windows(41, tail=True)
    assert windows == [(0, 41)] and waits == [0.0]  # a sentence's first chunk never waits to learn the end
    windows, waits = _adaptive_windows(300, tail=True)
    assert windows == [(0, 41), (21, 141), (121, 241), (221, 300)]
    assert waits == [0.0, TAIL_WAIT_S, TAIL_WAIT_S]  # asked at every cut, waiting one decode step after the first
    assert _adaptive_windows(300, tail=True, ahead=True)[1] == []  # more than the tail after each cut: nothing asked
    assert _windows(ModelConstants(), 50, 30) == [(0, 50), (30, 50)]  # a plain iterator cannot tell: no tail


def test_the_tail_gives_the_audio_length_of_the_official_split(t2w: Token2Wav, ref: Any) -> None:
    """Taken along, the tail's frames are the last chunk's instead of a last call's: the sentence's audio has the
    length the official split gives it, in one call fewer."""
    c = t2w.constants
    tokens = ref["tokens"][:141].tolist()
    lengths, calls = [], []
    for tail in (True, False):
        rec = RecordingT2W(t2w)
        schedule = dataclasses.replace(ScheduleConfig.default(c, tail=tail), short_hop=0)  # hops 21, then 100
        ctx = RequestContext.alone(GeneratorNoise(np.random.default_rng(3)), schedule, c.sample_rate)
        chunks = list(stream_sentence(EndingTokens(tokens), ref["embedding"], rec, ctx))
        assert chunks[-1].is_last and sum(ch.tokens for ch in chunks) == len(tokens)
        lengths.append(sum(len(ch.audio) for ch in chunks))
        calls.append(rec.calls)
    assert calls == [[(41, False), (120, True)], [(41, False), (120, False), (20, True)]]
    assert lengths[0] == lengths[1] == c.tokens_to_mel_frames(141) * c.mel_hop_samples


def test_hop_growth_follows_stream_scale_factor() -> None:
    c = dataclasses.replace(ModelConstants(), stream_scale_factor=2.0)
    # hops: 30 (first), then official 100 * 2 = 200 (capped at token_max_hop_len), then 200
    assert _windows(c, 700, 30) == [(0, 50), (30, 250), (230, 450), (430, 650), (630, 700)]


def test_first_hop_must_exceed_overlap() -> None:
    c = ModelConstants()
    assert default_first_hop(c) == c.token_overlap_len + 1 == 21
    with pytest.raises(ValueError, match="first_hop_tokens"):
        _windows(c, 100, c.token_overlap_len)


def test_cancel_stops_between_tokens() -> None:
    c = ModelConstants()
    fake, cancel, pulled = FakeT2W(c), threading.Event(), []

    def tokens() -> Any:
        for t in range(1000):
            pulled.append(t)
            if t == 60:
                cancel.set()
            yield t

    noise = GeneratorNoise(np.random.default_rng())
    chunks = list(stream_sentence(tokens(), np.zeros(192, np.float32), fake, fixed(c, noise, 30, cancel=cancel)))
    assert len(chunks) == 1 and not chunks[0].is_last  # the chunk at 50 tokens, then nothing (no final chunk)
    assert len(pulled) == 61


def test_replay_noise_checks_shapes() -> None:
    noise = ReplayNoise([np.zeros((80, 5), np.float32)], [HiFTNoise(np.zeros(9, np.float32), np.zeros((9, 10), np.float32))])
    with pytest.raises(ValueError, match="frames"):
        noise.flow_noise(80, 6)
    with pytest.raises(ValueError, match="hift"):
        noise.hift_noise(9, 11)
    with pytest.raises(ValueError, match="no recorded"):
        noise.flow_noise(80, 5)
