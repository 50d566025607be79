"""Synthesizer facade on the tiny bundle: chunking per sentence, streaming order, seeds, cancel, validation."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle, ModelConstants
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import AudioChunk, SynthesisOptions
from service.errors import EmptyTextError, InvalidInputError, UnknownSpeakerError
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.llm import CosyVoice1LLM
from service.families.cosyvoice1.schedule import ScheduleConfig
from service.families.cosyvoice1.streaming import MIN_FIRST_AUDIO_FRAMES, default_first_hop, first_hop_for_speed
from service.families.cosyvoice1.token2wav import ReplayNoise
from service.layers.hift import HiFTNoise

SENTENCES = [[15947, 1002, 13], [40, 716, 13]]  # "Hello world." and a second short sentence


def fixed_schedule(c: ModelConstants) -> ScheduleConfig:
    """The first hop 21, then the official hops: chunk windows that do not depend on measured rates."""
    return ScheduleConfig.official(c).with_first_hop(default_first_hop(c))


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> ModelBundle:
    return ModelBundle.load(tiny_bundle)


@pytest.fixture(scope="module")
def sessions(bundle: ModelBundle) -> Mapping[str, Any]:
    return open_sessions(bundle, RuntimeOptions(intra_op_threads=1))


@pytest.fixture(scope="module")
def synth(bundle: ModelBundle, sessions: Mapping[str, Any]) -> Synthesizer:
    return Synthesizer(bundle, sessions)


class CountingLLM:
    """Wraps a token generator; records per sentence how many tokens were pulled and in which order."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.log: list[tuple[int, int]] = []  # (sentence number, tokens pulled so far)
        self.counts: list[int] = []

    def generate(self, text_ids: Sequence[int], embedding: np.ndarray, rng: np.random.Generator, **kw: Any) -> Iterator[int]:
        self.counts.append(0)
        index = len(self.counts) - 1
        for tok in self.inner.generate(text_ids, embedding, rng, **kw):
            self.counts[index] += 1
            self.log.append((index, self.counts[index]))
            yield tok


class FakeLLM:
    """Deterministic stand-in: `n` tokens per sentence drawn from the request's rng (or endless)."""

    def __init__(self, n: int | None) -> None:
        self.n = n

    def generate(self, text_ids: Sequence[int], embedding: np.ndarray, rng: np.random.Generator, **kw: Any) -> Iterator[int]:
        i = 0
        while self.n is None or i < self.n:
            cancel = kw.get("cancel")
            if cancel is not None and cancel.is_set():
                return
            yield int(rng.integers(0, 4096))
            i += 1


def _audio(chunks: list[AudioChunk]) -> np.ndarray:
    return np.concatenate([c.audio for c in chunks])


def test_load_exposes_bundle_facts(tiny_bundle: Path, bundle: ModelBundle) -> None:
    s = Synthesizer.load(tiny_bundle, RuntimeOptions(intra_op_threads=1))
    assert s.sample_rate == bundle.constants.sample_rate == 22050
    assert s.speakers == tuple(bundle.speakers) and "中文女" in s.speakers


def test_non_stream_one_chunk_per_sentence(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    llm = CountingLLM(CosyVoice1LLM(sessions, bundle.constants))
    synth = Synthesizer(bundle, sessions, llm=llm)
    chunks = list(synth.synthesize(SENTENCES, "中文女", SynthesisOptions(seed=1)))
    c = bundle.constants
    assert [ch.sentence_index for ch in chunks] == [0, 1]
    assert [ch.is_final for ch in chunks] == [False, True]
    for ch, n_tokens in zip(chunks, llm.counts, strict=True):
        assert n_tokens >= c.min_token_text_ratio * 3
        assert len(ch.audio) == c.mel_hop_samples * c.tokens_to_mel_frames(n_tokens)
        assert ch.audio.dtype == np.float32 and np.abs(ch.audio).max() <= c.audio_limit
        assert ch.timings.llm_s > 0 and ch.timings.flow_s > 0 and ch.timings.hift_s > 0


def test_same_seed_same_audio(synth: Synthesizer) -> None:
    for stream in (False, True):
        opts = SynthesisOptions(seed=11, stream=stream)
        a = _audio(list(synth.synthesize(SENTENCES[:1], "英文男", opts)))
        b = _audio(list(synth.synthesize(SENTENCES[:1], "英文男", opts)))
        np.testing.assert_array_equal(a, b)
    c = _audio(list(synth.synthesize(SENTENCES[:1], "英文男", SynthesisOptions(seed=12))))
    assert len(c) != len(a) or not np.array_equal(a, c)


class TokenRecorder(CountingLLM):
    """Also keeps the tokens of every sentence."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.tokens: list[list[int]] = []

    def generate(self, text_ids: Sequence[int], embedding: np.ndarray, rng: np.random.Generator, **kw: Any) -> Iterator[int]:
        self.tokens.append([])
        for tok in super().generate(text_ids, embedding, rng, **kw):
            self.tokens[-1].append(tok)
            yield tok


def test_stream_and_non_stream_share_tokens_and_vocoder_path_reproduces(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    llm = TokenRecorder(CosyVoice1LLM(sessions, bundle.constants))
    synth = Synthesizer(bundle, sessions, llm=llm)
    for stream in (False, True):
        opts = SynthesisOptions(seed=21, stream=stream)
        audio = _audio(list(synth.synthesize(SENTENCES[:1], "日语男", opts)))
        again = _audio(list(synth.synthesize_tokens(llm.tokens[-1], "日语男", opts)))
        np.testing.assert_array_equal(audio, again)
    assert llm.tokens[0] == llm.tokens[1]  # LLM randomness does not depend on the stream flag


def test_stream_yields_first_chunk_before_last_sentence_starts(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    llm = CountingLLM(FakeLLM(160))
    synth = Synthesizer(bundle, sessions, llm=llm, schedule=fixed_schedule(bundle.constants))
    gen = synth.synthesize([[1], [2], [3]], "中文男", SynthesisOptions(stream=True, seed=0))
    first = next(gen)
    assert llm.counts == [41]  # first hop 21 + overlap 20; sentences 1 and 2 not started
    assert first.sentence_index == 0 and not first.is_final and len(first.audio) > 0
    rest = list(gen)
    per_sentence = [sum(1 for ch in [first, *rest] if ch.sentence_index == i) for i in range(3)]
    # token windows [0, 41), [21, 141), final [121, 160) for the first audio; later sentences are not first audio
    # (the listener has audio already) and start with the official hop: [0, 120), final [100, 160)
    assert per_sentence == [3, 2, 2]
    assert [ch.is_final for ch in rest].count(True) == 1 and rest[-1].is_final


def test_stream_with_speed_streams_chunk_by_chunk(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    """speed != 1 keeps streaming: same chunk schedule and first-chunk tokens as speed 1, audio 1/speed as long."""
    runs = {}
    for speed in (1.0, 1.25, 0.8):
        llm = CountingLLM(FakeLLM(260))
        synth = Synthesizer(bundle, sessions, llm=llm, schedule=fixed_schedule(bundle.constants))
        chunks = []
        for ch in synth.synthesize([[1]], "中文男", SynthesisOptions(stream=True, speed=speed, seed=0)):
            if not chunks:
                first_tokens = llm.counts[0]  # tokens decoded before the first audio existed
            chunks.append(ch)
        runs[speed] = (first_tokens, [len(ch.audio) for ch in chunks])
    hop = bundle.constants.mel_hop_samples
    base_first, base_sizes = runs[1.0]
    for speed in (1.25, 0.8):
        first_tokens, sizes = runs[speed]
        assert first_tokens == base_first  # first audio waits for no more tokens than at speed 1
        assert len(sizes) == len(base_sizes) > 2 and all(n > 0 for n in sizes)
        assert sum(sizes) == int(sum(base_sizes) / hop / speed) * hop  # the official frame count, int(frames / speed)
        assert sizes[0] != base_sizes[0]


def test_stream_with_high_speed_grows_the_first_hop(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    c = bundle.constants
    llm = CountingLLM(FakeLLM(300))
    synth = Synthesizer(bundle, sessions, llm=llm)
    it = synth.synthesize([[1]], "中文男", SynthesisOptions(stream=True, speed=2.0, seed=0))
    first = next(it)
    assert llm.counts[0] == first_hop_for_speed(synth.first_hop_tokens, 2.0, c) + c.token_overlap_len
    assert first.audio.size >= MIN_FIRST_AUDIO_FRAMES * c.mel_hop_samples
    it.close()


def test_short_sentence_with_speed_is_the_official_whole_sentence(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    synth = Synthesizer(bundle, sessions, llm=FakeLLM(30))  # shorter than a first chunk: one finalize call
    options = {"speed": 1.5, "seed": 3}
    streamed = _audio(list(synth.synthesize([[1]], "中文男", SynthesisOptions(stream=True, **options))))
    whole = _audio(list(synth.synthesize([[1]], "中文男", SynthesisOptions(stream=False, **options))))
    np.testing.assert_array_equal(streamed, whole)


def test_cancel_stops_within_a_chunk(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    llm = CountingLLM(FakeLLM(None))  # would never stop on its own
    synth = Synthesizer(bundle, sessions, llm=llm)
    cancel = threading.Event()
    got = []
    for ch in synth.synthesize([[1], [2]], "中文女", SynthesisOptions(stream=True), cancel=cancel):
        got.append(ch)
        cancel.set()
    assert len(got) == 1 and not got[0].is_final
    assert llm.counts == [41]


def test_validation_happens_before_any_work(bundle: ModelBundle, sessions: Mapping[str, Any]) -> None:
    llm = CountingLLM(FakeLLM(10))
    synth = Synthesizer(bundle, sessions, llm=llm)
    with pytest.raises(UnknownSpeakerError):
        synth.synthesize([[1]], "nobody")
    with pytest.raises(EmptyTextError):
        synth.synthesize([], "中文女")
    with pytest.raises(EmptyTextError):
        synth.synthesize([[1], []], "中文女")
    with pytest.raises(InvalidInputError):
        synth.synthesize([[1]], "中文女", SynthesisOptions(first_hop_tokens=bundle.constants.token_overlap_len))
    with pytest.raises(InvalidInputError):
        synth.synthesize([[1]], "中文女", SynthesisOptions(speed=0.0))
    with pytest.raises(InvalidInputError):
        synth.synthesize([[1]], "中文女", SynthesisOptions(n_timesteps=0))
    with pytest.raises(InvalidInputError):
        synth.synthesize([[1]], "中文女", SynthesisOptions(seed=-1))
    with pytest.raises(InvalidInputError):
        synth.synthesize_tokens([5000], "中文女")
    assert llm.counts == []


def test_synthesize_tokens_replays_official_stream(synth: Synthesizer, sessions: Mapping[str, Any], ref_dir: Path) -> None:
    ref = np.load(ref_dir / "stream.npz")
    n = int(ref["n_chunks"])
    noise = ReplayNoise(
        [ref[f"chunk{k}_flow_noise"][0] for k in range(n)],
        [HiFTNoise(ref[f"chunk{k}_hift_phase_used"][0, :, 0], ref[f"chunk{k}_hift_sine_noise"][0]) for k in range(n)],
    )
    official = Synthesizer(synth.bundle, sessions, schedule=ScheduleConfig.official(synth.bundle.constants))
    opts = SynthesisOptions(stream=True)
    chunks = list(official.synthesize_tokens(ref["tokens"].tolist(), "中文男", opts, noise=noise))
    assert [len(ch.audio) for ch in chunks] == ref["chunk_yield_samples"].tolist()
    assert [ch.is_final for ch in chunks] == [False, False, True]
    np.testing.assert_allclose(_audio(chunks), ref["audio"][0], atol=1e-4, rtol=0)


def test_threads_share_one_synthesizer(synth: Synthesizer, ref_dir: Path) -> None:
    tokens = np.load(ref_dir / "stream.npz")["tokens"][:90].tolist()
    opts = SynthesisOptions(stream=True, seed=5)
    expected = _audio(list(synth.synthesize_tokens(tokens, "粤语女", opts)))
    results: dict[int, np.ndarray] = {}

    def work(i: int) -> None:
        results[i] = _audio(list(synth.synthesize_tokens(tokens, "粤语女", opts)))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        np.testing.assert_allclose(results[i], expected, atol=1e-5, rtol=0)
