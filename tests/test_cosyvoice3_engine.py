"""The Fun-CosyVoice3 engine on the committed tiny bundle: the silent-token filter, the causal HiFT streamed over a
bounded window (the official re-run's samples), the DiT caches' window (bounded bytes, the prompt kept, nothing
changed while a sentence fits), the official switch, the voices' system prompt and <|endofprompt|>, 24 kHz chunks."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.acoustic_gate import Pacer
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.sessions import open_sessions
from service.engine.types import SynthesisOptions
from service.families.cosyvoice3.assembly import SilenceFilter, window_frames
from service.families.cosyvoice3.contract import END_OF_PROMPT_ID, GRAPH_IO, INSTRUCT_PRESETS, constants_of, instruction_text
from service.families.cosyvoice3.engine import CosyVoice3Engine
from service.families.cosyvoice3.vocoder import CONTEXT_FRAMES, OfficialStream, WindowedStream
from service.families.cosyvoice3.voice import Voice3
from service.layers.chunk_schedule import HopSchedule
from service.layers.flow_prompt import FlowPrompt

REF = Path(__file__).resolve().parents[1] / "tests" / "reference" / "tiny-cosyvoice3"
SILENT = frozenset((1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323))
ONE = RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0)


@pytest.fixture(scope="module")
def sessions(tiny_v3_bundle: Path) -> tuple[ModelBundle, dict[str, object]]:
    bundle = ModelBundle.load(tiny_v3_bundle)
    return bundle, open_sessions(bundle, ONE, names=tuple(GRAPH_IO))


def engine(sessions: tuple[ModelBundle, dict[str, object]], **kwargs: object) -> CosyVoice3Engine:
    bundle, opened = sessions
    return CosyVoice3Engine(bundle, opened, **kwargs)  # type: ignore[arg-type]


def prompt_of(case: str = "case0_") -> FlowPrompt:
    npz = np.load(REF / "zero_shot.npz")
    return FlowPrompt(
        npz[case + "mi_embedding"], tuple(npz[case + "mi_flow_prompt_speech_token"].tolist()), npz[case + "mi_prompt_speech_feat"]
    )


def test_a_silent_token_after_five_in_a_row_is_dropped() -> None:
    tokens = [7, 1, 2, 28, 29, 55, 248, 494, 9, 1, 1]
    assert list(SilenceFilter(iter(tokens), SILENT, 5)) == [7, 1, 2, 28, 29, 55, 9, 1, 1]
    npz = np.load(REF / "zero_shot.npz")  # the official llm_job dropped 3 of case 1's 8 silent tokens
    assert list(SilenceFilter(iter(npz["case1_forced_tokens"].tolist()), SILENT, 5)) == npz["case1_flow_tokens"].tolist()


def test_the_windowed_vocoder_gives_the_official_rerun_samples_over_a_long_sentence(
    sessions: tuple[ModelBundle, dict[str, object]],
) -> None:
    # on the float32 graph: the vocoder twin's bf16 rounding turns last-bit differences of ONNX Runtime's own kernels
    # at other lengths into ~1e-4 (tests/test_native_conv.py holds the twin to the float graph)
    bundle = sessions[0]
    vocoder = engine((bundle, open_sessions(bundle, replace(ONE, native_kernels="off"), names=tuple(GRAPH_IO)))).vocoder
    mel = (np.random.default_rng(3).standard_normal((80, 6 * CONTEXT_FRAMES)) * 2 - 5).astype(np.float32)
    cuts = [0, 20, 50, 100, 150, 200, mel.shape[1]]
    windowed, official = WindowedStream.start(vocoder), OfficialStream.start(vocoder)
    pieces: list[tuple[np.ndarray, np.ndarray]] = []
    for a, b in itertools.pairwise(cuts):
        final = b == mel.shape[1]
        pieces.append((windowed.push(mel[:, a:b], final=final), official.push(mel[:, a:b], final=final)))
    for got, want in pieces:
        assert got.shape == want.shape
        assert got.size == 0 or np.abs(got - want).max() < 1e-5
    assert sum(p[0].shape[0] for p in pieces) == mel.shape[1] * 480
    assert windowed.mel.shape[1] < 2 * CONTEXT_FRAMES  # what it keeps stays bounded


def _stream(eng: CosyVoice3Engine, tokens: list[int], budget: StateBudget | None = None) -> list[np.ndarray]:
    if budget is not None:
        eng.chunks.budget = budget
    options = SynthesisOptions(stream=True)
    return [c.mel for c in eng.mel_chunks(iter(tokens), prompt_of(), options, pace=Pacer(None, 24000))]


def test_a_window_wider_than_the_sentence_changes_nothing(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    schedule = HopSchedule.early(25, 3, sessions[0].constants)
    tokens = np.random.default_rng(5).integers(0, 6561, 60).tolist()
    unbounded = _stream(engine(sessions, schedule=schedule), tokens)
    wide = _stream(engine(sessions, schedule=schedule, window_s=60.0), tokens)
    assert len(unbounded) == len(wide) and all(np.array_equal(a, b) for a, b in zip(unbounded, wide, strict=True))


def test_the_dit_window_bounds_a_long_streams_caches_and_keeps_the_prompt(
    sessions: tuple[ModelBundle, dict[str, object]],
) -> None:
    bundle = sessions[0]
    extra = constants_of(bundle.manifest)
    schedule = HopSchedule.early(25, 3, bundle.constants)
    tokens = np.random.default_rng(6).integers(0, 6561, 300).tolist()  # 12 s of speech
    eng = engine(sessions, schedule=schedule, window_s=2.0)
    window = window_frames(2.0, extra, 50)
    assert window == 100
    budget = StateBudget(None)
    mels = _stream(eng, tokens, budget)
    assert sum(m.shape[1] for m in mels) == 2 * len(tokens)
    state = eng.flow.prompt_state(prompt_of(), 10)
    per_frame = state.bytes_per_frame()
    most = 2 * len(prompt_of().tokens) + window  # a call's frames go in after the window let go of what they push out
    assert budget.peak <= state.nbytes() + most * per_frame
    unbounded = StateBudget(None)
    _stream(engine(sessions, schedule=schedule), tokens, unbounded)
    assert unbounded.peak > 2 * budget.peak  # without the window the caches grow with the sentence


def test_dropping_keeps_the_prompts_frames_and_whole_chunks(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    flow = engine(sessions).flow
    prompt = prompt_of()
    state = flow.prompt_state(prompt, 2)
    state.window = 100
    seq = np.random.default_rng(7).integers(0, 6561, 240)
    start, counts, kept = 0, [], None
    while start + 28 <= len(seq):
        flow.advance(seq[start : start + 25], seq[start + 25 : start + 28], prompt, state)
        start += 25
        counts.append(state.cached)
        if kept is None and state.cached >= state.prompt_frames:
            kept = state.steps[1].v[1].buffer[:, : state.prompt_frames].copy()
    assert kept is not None and max(counts) <= state.prompt_frames + 100
    assert counts[-1] < state.frames  # frames were dropped ...
    assert (state.frames - state.cached) % 50 == 0  # ... in whole attention chunks
    assert np.array_equal(state.steps[1].v[1].buffer[:, : state.prompt_frames], kept)  # and never the prompt's


def test_the_official_switch_streams_by_recomputing(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    bundle, opened = sessions
    official = CosyVoice3Engine.from_sessions(
        bundle, opened, ONE.__class__(intra_op_threads=1, max_batch=0, acoustic_slots=0, stream_schedule="official")
    )  # type: ignore[arg-type]
    default = CosyVoice3Engine.from_sessions(bundle, opened, ONE)  # type: ignore[arg-type]
    assert official.recompute and not default.recompute
    assert official.schedule.aligned_first and not default.schedule.aligned_first
    assert official.prompt_window_tokens is None and official.chunks.window is None


def test_a_sentence_with_the_marker_keeps_its_own_and_the_voice_adds_none() -> None:
    system = (2610, 525, 264, 10950, 17847, 13, END_OF_PROMPT_ID)
    embedding, mel = np.ones(192, np.float32), np.zeros((4, 80), np.float32)
    crossing = Voice3.cloned("x", embedding, (1, 2), mel, (), system)
    assert crossing.kind == "cross_lingual" and crossing.llm_prompt([5, 6]).prompt_text_ids == system
    assert crossing.llm_prompt([*system, 5, 6]).prompt_text_ids == ()
    zero = Voice3.cloned("z", embedding, (1, 2), mel, (42, 43), system)
    assert zero.kind == "zero_shot" and zero.llm.prompt_text_ids == (*system, 42, 43) and zero.llm.speech_tokens == (1, 2)
    official = Voice3.cloned("o", embedding, (1, 2), mel, (*system, 42), system)
    assert official.llm.prompt_text_ids == (*system, 42)


def test_the_presets_are_the_official_instructions() -> None:
    assert len(INSTRUCT_PRESETS) == 26
    assert instruction_text(INSTRUCT_PRESETS[14]) == "You are a helpful assistant. 请用四川话表达。<|endofprompt|>"
    assert instruction_text("You are a helpful assistant. Speak up.<|endofprompt|>").count("<|endofprompt|>") == 1


def test_synthesis_yields_24khz_chunks_streamed_and_whole(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    eng = engine(sessions, schedule=HopSchedule.early(25, 3, sessions[0].constants))
    voice = Voice3.builtin("n", np.full(192, 192**-0.5, np.float32), (2610, 525, END_OF_PROMPT_ID))
    for stream in (False, True):
        chunks = list(eng.synthesize([[9707, 1879], [14990]], voice, SynthesisOptions(stream=stream, seed=4), threading.Event()))
        assert all(c.sample_rate == 24000 and np.isfinite(c.audio).all() for c in chunks)
        assert [c.is_final for c in chunks].count(True) == 1 and chunks[-1].is_final and chunks[-1].sentence_end
        assert sum(c.audio.shape[0] for c in chunks) % 480 == 0


class NoTokens:
    """An LLM that ends every sentence at once (the official CosyVoice3 sampler can draw a stop id at the first step:
    its min_len masks sos, not eos)."""

    def generate(self, *args: object, **kwargs: object) -> object:
        return iter(())


@pytest.mark.parametrize("stream", [False, True])
def test_a_sentence_the_llm_ends_at_once_is_an_empty_chunk(sessions: tuple[ModelBundle, dict[str, object]], stream: bool) -> None:
    eng = engine(sessions, llm=NoTokens())
    voice = Voice3.builtin("n", np.full(192, 192**-0.5, np.float32), (2610, END_OF_PROMPT_ID))
    chunks = list(eng.synthesize([[9707], [14990]], voice, SynthesisOptions(stream=stream), threading.Event()))
    assert [c.audio.shape for c in chunks] == [(0,), (0,)]
    assert [c.sentence_end for c in chunks] == [True, True] and chunks[-1].is_final


def test_the_float64_f0_predictor_stays_on_onnx_runtime(monkeypatch: pytest.MonkeyPatch, tiny_v3_bundle: Path) -> None:
    """OpenVINO would run it in bf16 on a bf16 CPU (engine lever acoustic_backend auto or openvino); the official runs it in
    float64 because the causal source's phase sums its errors."""
    from service.families.cosyvoice3 import assembly
    from service.layers import acoustic_plan

    backends: dict[str, str] = {}

    def record(bundle: ModelBundle, runtime: RuntimeOptions, names: tuple[str, ...]) -> dict[str, object]:
        backends.update(dict.fromkeys(names, runtime.acoustic_backend))
        return dict.fromkeys(names)

    monkeypatch.setattr(assembly, "open_sessions", record)
    monkeypatch.setattr(acoustic_plan, "open_sessions", record)
    assembly.open_engine_sessions(ModelBundle.load(tiny_v3_bundle), RuntimeOptions(acoustic_backend="openvino"), wide=False)
    assert backends["hift_f0"] == "ort" and backends["hift_decode"] == "openvino" and set(backends) == set(GRAPH_IO)


def test_a_voices_prompt_state_is_solved_once_and_shared_by_its_streams(sessions: tuple[ModelBundle, dict[str, object]]) -> None:
    eng = engine(sessions, schedule=HopSchedule.early(25, 3, sessions[0].constants), prompt_window_tokens=53)
    p = prompt_of()
    voice = Voice3.cloned("v", p.embedding, p.tokens, p.mel, (), (2610, END_OF_PROMPT_ID))
    tokens = np.random.default_rng(8).integers(0, 6561, 40).tolist()
    first = list(eng.synthesize_tokens(tokens, voice, SynthesisOptions(stream=True)))
    second = list(eng.synthesize_tokens(tokens, voice, SynthesisOptions(stream=True)))
    assert len(eng.chunks.prompt_states) == 1  # one state for the voice's 53-token window (two whole chunks)
    assert all(np.array_equal(a, b) for a, b in zip(first, second, strict=True))
