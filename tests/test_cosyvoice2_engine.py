"""CosyVoice2 engine numerics against our torch modules: LLM steps and batching, the cached streaming flow, the vocoder."""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from servers import wait_until

from export.checkpoint import read_state_dict
from export.cosyvoice2.config import load_config
from export.cosyvoice2.modules.flow import CausalMaskedDiffWithXvec, flow_noise
from export.cosyvoice2.modules.llm import Qwen2LM, drop_unused
from service.bundle import ModelBundle
from service.engine.llm import LLMRequest
from service.engine.memory import StateBudget
from service.engine.options import RuntimeOptions
from service.engine.sampling import SamplingParams
from service.engine.scheduler import BatchScheduler
from service.engine.types import LLMPrompt, SynthesisOptions
from service.families.cosyvoice2.engine import CosyVoice2Engine
from service.families.cosyvoice2.voice import Voice2
from service.layers.chunk_schedule import HopSchedule
from service.layers.vocoder import sine_phase

pytestmark = pytest.mark.export
WAIT_S = 30.0  # how long a test waits for another thread to reach a state (a bound, never a measured speed)


ONE_THREAD = RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0, stream_schedule="official")


@pytest.fixture(scope="module")
def engine(cv2_bundle: Path) -> CosyVoice2Engine:
    return CosyVoice2Engine.load(cv2_bundle, ONE_THREAD)


@pytest.fixture(scope="module")
def torch_llm(cv2_checkpoint: Path) -> Qwen2LM:
    model = Qwen2LM(load_config(cv2_checkpoint).llm).eval()
    model.load_state_dict(drop_unused(read_state_dict(cv2_checkpoint / "llm.pt")), strict=True)
    return model


@pytest.fixture(scope="module")
def torch_flow(cv2_checkpoint: Path) -> CausalMaskedDiffWithXvec:
    model = CausalMaskedDiffWithXvec(load_config(cv2_checkpoint).flow).eval()
    model.load_state_dict(read_state_dict(cv2_checkpoint / "flow.pt"), strict=True)
    return model


def random_voice(prompt_tokens: int, seed: int, text_ids: tuple[int, ...] = ()) -> Voice2:
    rng = np.random.default_rng(seed)
    tokens = tuple(int(t) for t in rng.integers(0, 6561, prompt_tokens))
    mel = rng.standard_normal((2 * prompt_tokens, 80)).astype(np.float32) - 5
    return Voice2.cloned("v", rng.standard_normal(192).astype(np.float32), tokens, mel, text_ids)


# ---- LLM ----------------------------------------------------------------------------------------


def test_teacher_forced_log_probs_match_torch(engine: CosyVoice2Engine, torch_llm: Qwen2LM) -> None:
    prompt = LLMPrompt(None, (11, 12, 300), (5, 6561 - 1, 7, 8))
    text, forced = [1000, 2000, 151000], [3, 4, 5, 6, 7, 6560]
    got = engine.runner.teacher_force(text, prompt, forced)
    with torch.no_grad():
        lm_input = torch.cat(
            [torch_llm.prompt(torch.tensor([[11, 12, 300, *text]])), torch_llm.embed_tokens(torch.tensor([[5, 6560, 7, 8]]))], 1
        )
        want = torch_llm.teacher_force(lm_input[0], torch.tensor(forced)).numpy()
    assert got.shape == (len(forced) + 1, 6564)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)


def test_rows_of_a_batch_step_like_single_requests(engine: CosyVoice2Engine) -> None:
    runner = engine.runner
    cases = [([7, 8, 9], LLMPrompt(None)), ([1, 2], LLMPrompt(None, (3, 4, 5, 6), (9, 9, 9))), ([4] * 9, LLMPrompt(None, (2,)))]
    forced = [10, 11, 12, 13, 14]
    batch = runner.new_batch()
    requests = [runner.start_forced(text, prompt, forced) for text, prompt in cases]
    for request in requests:
        batch.add(request)
    while len(batch):
        runner.step(batch)
    for (text, prompt), request in zip(cases, requests, strict=True):
        np.testing.assert_allclose(np.stack(request.record or []), runner.teacher_force(text, prompt, forced), atol=1e-5, rtol=0)


def test_stop_tokens_after_eos_end_a_request() -> None:
    logp = np.full(6564, -1e9, dtype=np.float32)
    logp[6562] = 0.0  # the second stop token is the only choice
    request = LLMRequest(text_len=1, min_len=0, max_len=10, rng=np.random.default_rng(0))
    request.accept(logp, SamplingParams(), eos=6561)
    assert request.finished and request.stop_reason == "eos" and request.tokens == []


def test_scheduler_batches_cosyvoice2_requests_like_direct_decoding(engine: CosyVoice2Engine) -> None:
    jobs = [([5, 6, 7], LLMPrompt(None, (1, 2), (3, 4, 5)), 3), ([9, 10], LLMPrompt(None), 4)]

    def direct(text: list[int], prompt: LLMPrompt, seed: int) -> list[int]:
        return list(engine.runner.generate(text, prompt, np.random.default_rng(seed), max_tokens=12))

    want = [direct(*job) for job in jobs]
    scheduler = BatchScheduler(engine.runner, max_batch=4)
    try:
        streams = [scheduler.generate(t, p, np.random.default_rng(s), max_tokens=12) for t, p, s in jobs]
        got: list[list[int]] = [[], []]
        threads = [threading.Thread(target=lambda i=i: got[i].extend(streams[i])) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        scheduler.close()
    assert got == want and all(len(g) == 12 for g in got)
    assert scheduler.stats.max_rows == 2


# ---- flow ---------------------------------------------------------------------------------------


def test_hop_schedule_pads_the_first_hop_to_a_chunk_boundary() -> None:
    schedule = HopSchedule()
    assert [schedule.first_hop(p) for p in (0, 25, 37, 80)] == [25, 25, 38, 45]
    assert [schedule.after(h, 25 * h) for h in (25, 50, 100)] == [(50, 50), (100, 100), (100, 100)]


def official_chunks(prompt: int, tokens: int) -> tuple[list[tuple[int, int]], int]:
    """(offset, hop) of every non-final chunk of the official stream loop, and the final chunk's offset."""
    hop, offset, pad, chunks = 25, 0, math.ceil(prompt / 25) * 25 - prompt, []
    while tokens - offset >= (hop + pad if offset == 0 else hop) + 3:
        this = hop + pad if offset == 0 else hop
        chunks.append((offset, this))
        offset += this
        hop = min(100, hop * 2)
    return chunks, offset


def torch_reference(
    flow: CausalMaskedDiffWithXvec, voice: Voice2, speech: list[int], *, final_streaming: bool
) -> list[np.ndarray]:
    """What the official stream computes with our torch modules: each chunk's flow over everything so far."""
    prompt = torch.tensor([voice.flow.tokens], dtype=torch.long)
    feat = torch.from_numpy(voice.flow.mel)[None]
    emb = torch.from_numpy(voice.flow.embedding)[None]
    tokens = torch.tensor([speech], dtype=torch.long)
    chunks, last = official_chunks(len(voice.flow.tokens), len(speech))
    out = []
    with torch.no_grad():
        for offset, hop in chunks:
            mel = flow.inference(tokens[:, : offset + hop + 3], prompt, feat, emb, flow_noise(), True, False)
            out.append(mel[0, :, 2 * offset :].numpy())
        out.append(flow.inference(tokens, prompt, feat, emb, flow_noise(), final_streaming, True)[0, :, 2 * last :].numpy())
    return out


@pytest.mark.parametrize(("prompt_tokens", "speech_tokens"), [(37, 220), (80, 120), (0, 60)])
def test_cached_stream_equals_the_recomputing_stream(
    engine: CosyVoice2Engine, torch_flow: CausalMaskedDiffWithXvec, prompt_tokens: int, speech_tokens: int
) -> None:
    voice = random_voice(prompt_tokens, seed=prompt_tokens)
    speech = np.random.default_rng(1).integers(0, 6561, speech_tokens).tolist()
    got = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True))]
    want = torch_reference(torch_flow, voice, speech, final_streaming=True)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
    assert sum(g.shape[1] for g in got) == 2 * speech_tokens  # every frame once


def test_exact_final_is_the_official_full_attention_chunk(engine: CosyVoice2Engine, torch_flow: CausalMaskedDiffWithXvec) -> None:
    voice = random_voice(30, seed=2)
    speech = np.random.default_rng(2).integers(0, 6561, 100).tolist()
    got = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True), exact_final=True)]
    want = torch_reference(torch_flow, voice, speech, final_streaming=False)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)
    causal = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True))]
    assert np.abs(causal[-1] - got[-1]).max() > 1e-3  # the official last chunk is not the chunk-causal one


def test_non_streaming_flow_matches_torch(engine: CosyVoice2Engine, torch_flow: CausalMaskedDiffWithXvec) -> None:
    voice = random_voice(20, seed=3)
    speech = np.random.default_rng(3).integers(0, 6561, 47).tolist()
    (chunk,) = list(engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=False)))
    args = (
        torch.tensor([voice.flow.tokens]),
        torch.from_numpy(voice.flow.mel)[None],
        torch.from_numpy(voice.flow.embedding)[None],
    )
    with torch.no_grad():
        want = torch_flow.inference(torch.tensor([speech]), *args, flow_noise(), False, True)[0].numpy()
    np.testing.assert_allclose(chunk.mel, want, atol=1e-4, rtol=0)


def test_an_early_first_chunk_is_the_official_chunk_masked_flow_over_what_exists(
    cv2_bundle: Path, torch_flow: CausalMaskedDiffWithXvec
) -> None:
    """The default schedule's first chunk ends inside an attention chunk: it equals the official streaming flow over
    the tokens so far (its last chunk partial, the look-ahead cut), and every later chunk ends on a boundary."""
    early = CosyVoice2Engine.load(cv2_bundle, replace(ONE_THREAD, stream_schedule="adaptive", prompt_window_s=1.0))
    voice = random_voice(80, seed=6)
    speech = np.random.default_rng(6).integers(0, 6561, 90).tolist()
    chunks = list(early.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True)))
    assert early.prompt_window_tokens == 28 and [c.tokens for c in chunks] == [10, 12, 25, 25, 18]
    window = voice.flow.window(28)
    prompt = (torch.tensor([window.tokens]), torch.from_numpy(window.mel)[None], torch.from_numpy(window.embedding)[None])
    with torch.no_grad():
        want = torch_flow.inference(torch.tensor([speech[:13]]), *prompt, flow_noise(), True, False)[0].numpy()
    np.testing.assert_allclose(chunks[0].mel, want, atol=1e-4, rtol=0)
    assert sum(c.mel.shape[1] for c in chunks) == 2 * len(speech)


class _EndingTokens:
    """A token iterator that, like the scheduler's TokenStream, can say that the sentence has ended."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens, self.at = tokens, 0
        self.waits: list[float] = []

    def __iter__(self) -> _EndingTokens:
        return self

    def __next__(self) -> int:
        if self.at == len(self.tokens):
            raise StopIteration
        self.at += 1
        return self.tokens[self.at - 1]

    def ended(self, wait_s: float = 0.0) -> bool:
        self.waits.append(wait_s)
        return self.at == len(self.tokens)


def test_a_sentence_ending_a_look_ahead_past_a_cut_solves_it_with_that_chunk(cv2_bundle: Path) -> None:
    """Early schedule: a sentence whose last tokens are exactly the look-ahead of a chunk's cut gives them to that
    chunk once the stream says it has ended (no last chunk of 3 tokens); the frames are the two calls' frames."""
    early = CosyVoice2Engine.load(cv2_bundle, replace(ONE_THREAD, stream_schedule="adaptive", prompt_window_s=1.0))
    voice = random_voice(80, seed=8)
    speech = np.random.default_rng(8).integers(0, 6561, 100).tolist()  # 28 + 100 = 4 chunks + a look-ahead
    options = SynthesisOptions(stream=True)
    apart = list(early.mel_chunks(iter(speech), voice.flow, options))
    ending = _EndingTokens(speech)
    merged = list(early.mel_chunks(ending, voice.flow, options))
    assert [c.tokens for c in apart] == [10, 12, 25, 25, 25, 3] and [c.final for c in apart][-2:] == [False, True]
    assert [c.tokens for c in merged] == [10, 12, 25, 25, 28] and merged[-1].final
    assert ending.waits[0] == 0.0 and all(w > 0 for w in ending.waits[1:])  # the first cut never waits
    np.testing.assert_allclose(
        np.concatenate([c.mel for c in merged], 1), np.concatenate([c.mel for c in apart], 1), atol=1e-5, rtol=0
    )
    official = CosyVoice2Engine.load(cv2_bundle, replace(ONE_THREAD, prompt_window_s=1.0))
    assert [c.tokens for c in official.mel_chunks(_EndingTokens(speech), voice.flow, options)][-1] == 3


def test_cfg_lanes_compute_the_batched_rows(cv2_bundle: Path) -> None:
    """Two concurrent batch-1 estimator calls give a batch-2 call's numbers (fp32)."""
    voice = random_voice(37, seed=7)
    speech = np.random.default_rng(7).integers(0, 6561, 80).tolist()
    mels = []
    for lanes in (False, True):
        engine = CosyVoice2Engine.load(cv2_bundle, ONE_THREAD, cfg_lanes=lanes)
        mels.append([c.mel for c in engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True))])
        engine.close()
    for a, b in zip(*mels, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_small_middle_chunk_leaves_a_core_to_the_decode_steps(cv2_bundle: Path) -> None:
    """Early schedule: the first chunk, every whole attention chunk and the last take both cores (guidance rows side
    by side, the gate busy: decode steps pause); the rest of the first attention chunk runs on one core with the gate
    not busy (decode steps go on). The vocoder calls of the first whole chunk and of the last take both cores (the
    wide HiFT session, gate busy), the others one. The audio is the same either way (fp32 lanes, fp32 HiFT)."""
    runtime = RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=1, stream_schedule="adaptive")
    engine = CosyVoice2Engine.load(cv2_bundle, runtime, cfg_lanes=True)
    assert engine.gate is not None
    gate, flow, vocoder = engine.gate, engine.flow, engine.vocoder
    calls: list[tuple[str, bool, bool]] = []  # (what, wide, gate busy)
    estimate, inference = flow.estimate, vocoder.inference

    def spy_estimate(*args: Any, wide: bool = True, **kwargs: Any) -> np.ndarray:
        calls.append(("flow", wide, gate.busy()))
        return estimate(*args, wide=wide, **kwargs)

    def spy_inference(*args: Any, wide: bool = False, **kwargs: Any) -> tuple[np.ndarray, np.ndarray]:
        calls.append(("vocoder", wide, gate.busy()))
        return inference(*args, wide=wide, **kwargs)

    flow.estimate = spy_estimate  # type: ignore[method-assign]
    vocoder.inference = spy_inference  # type: ignore[method-assign]
    voice = random_voice(37, seed=3)
    speech = np.random.default_rng(3).integers(0, 6561, 80).tolist()
    try:
        pieces = list(engine.synthesize_tokens(speech, voice, SynthesisOptions(stream=True, seed=5)))
        chunks = []  # per flow chunk: (wide, busy) of its Euler steps
        for what, wide, busy in calls:
            if what == "flow":
                chunks.append((wide, busy))
        steps = engine.constants.n_timesteps
        per_chunk = [set(chunks[i : i + steps]) for i in range(0, len(chunks), steps)]
        # first the prompt-only state (the window's whole chunk, outside the gate), then the sentence's chunks
        assert per_chunk == [{(True, False)}, {(True, True)}, {(False, False)}, {(True, True)}, {(True, True)}, {(True, True)}]
        assert engine.vocoder.wide is not None
        wide = (True, True)
        assert [(w, busy) for what, w, busy in calls if what == "vocoder"] == [(False, False)] * 2 + [wide, (False, False), wide]
    finally:
        flow.estimate, vocoder.inference = estimate, inference  # type: ignore[method-assign]
        engine.close()
    alone = CosyVoice2Engine.load(cv2_bundle, replace(runtime, acoustic_slots=0), cfg_lanes=False)
    try:
        want = list(alone.synthesize_tokens(speech, voice, SynthesisOptions(stream=True, seed=5)))
    finally:
        alone.close()
    for a, b in zip(pieces, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_a_whole_sentence_flow_keeps_no_keys_or_values(engine: CosyVoice2Engine) -> None:
    """The non-streaming flow (one full-attention call over prompt and sentence) is never continued, so it keeps no
    estimator keys/values (full size: 2.3 MB per frame); a streamed chunk keeps its frames' (the next chunk reads them)."""
    voice = random_voice(30, seed=9)
    seq = np.asarray([*voice.flow.tokens, *np.random.default_rng(9).integers(0, 6561, 40).tolist()], dtype=np.int64)
    flow = engine.flow
    whole = flow.empty_state(3)
    mel = flow.advance(seq, seq[:0], voice.flow, whole, full_attention=True)
    assert mel.shape[1] == 2 * len(seq)
    assert [c.frames for s in whole.steps for c in (*s.k, *s.v)] == [0] * 12
    streamed = flow.empty_state(3)
    flow.advance(seq[:50], seq[50:53], voice.flow, streamed)
    assert [c.frames for s in streamed.steps for c in (*s.k, *s.v)] == [100] * 12


def test_streams_over_the_flow_cache_budget_wait_for_the_oldest_and_give_it_all_back(cv2_bundle: Path) -> None:
    """Under a budget that one stream already fills, a second stream waits before its first chunk until the first
    ends (the oldest always goes on), then makes the audio it makes alone; a waiting stream whose request is
    cancelled ends without audio; every reservation is given back."""
    budget = StateBudget(1)
    engine = CosyVoice2Engine.load(cv2_bundle, ONE_THREAD, state_budget=budget)
    voice = random_voice(30, seed=11)
    speech = np.random.default_rng(11).integers(0, 6561, 60).tolist()
    options = SynthesisOptions(stream=True)
    alone = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options)]
    assert budget.used == 0 and budget.peak > 1

    first = engine.mel_chunks(iter(speech), voice.flow, options)
    head = next(first)  # the first stream holds its caches' bytes now
    second: list[np.ndarray] = []
    thread = threading.Thread(target=lambda: second.extend(c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options)))
    thread.start()
    wait_until(lambda: budget.waiting == 1, WAIT_S, "the second stream to wait for the budget", 0.002)
    rest = [c.mel for c in first]  # the oldest goes on over the limit
    thread.join(WAIT_S)
    assert not thread.is_alive() and budget.used == 0
    for a, b, c in zip(alone, [head.mel, *rest], second, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)

    holder = engine.mel_chunks(iter(speech), voice.flow, options)
    next(holder)
    cancel = threading.Event()
    cancelled: list[np.ndarray] = []
    late = threading.Thread(
        target=lambda: cancelled.extend(c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options, cancel=cancel))
    )
    late.start()
    wait_until(lambda: budget.waiting == 1, WAIT_S, "the late stream to wait for the budget", 0.002)
    cancel.set()
    late.join(WAIT_S)
    assert not late.is_alive() and cancelled == [] and budget.waiting == 0
    holder.close()
    assert budget.used == 0


def test_a_voice_prompt_state_is_computed_once_and_shared(cv2_bundle: Path) -> None:
    engine = CosyVoice2Engine.load(cv2_bundle, ONE_THREAD)
    voice = random_voice(64, seed=4)  # (64 - 3) // 25 = 2 chunks depend on the prompt alone
    speech = np.random.default_rng(4).integers(0, 6561, 90).tolist()
    options = SynthesisOptions(stream=True)
    first = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options, fingerprint=voice.fingerprint)]
    cached = engine.prompt_states.get((voice.fingerprint, 10, 64))
    assert cached is not None and cached.frames == 100 and cached.encoder.tokens == 50 and len(engine.prompt_states) == 1
    again = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options, fingerprint=voice.fingerprint)]
    fresh = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, options)]
    for a, b, c in zip(first, again, fresh, strict=True):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(a, c, atol=1e-5, rtol=0)
    assert cached.frames == 100 and cached.steps[0].k[0].frames == 100  # requests never extend the shared state


# ---- vocoder ------------------------------------------------------------------------------------


def official_sine_phase(f0: np.ndarray, rate: int, up: int, harmonics: int) -> np.ndarray:
    """SineGen2's phase with torch ops (per-sample cycles, down-sampled, summed, scaled, linearly up-sampled)."""
    f0_up = torch.repeat_interleave(torch.from_numpy(f0), up)[None, :, None]
    cycles = (f0_up * torch.arange(1, harmonics + 1, dtype=torch.float32)[None, None, :] / rate) % 1
    down = F.interpolate(cycles.transpose(1, 2), scale_factor=1 / up, mode="linear").transpose(1, 2)
    phase = torch.cumsum(down, dim=1) * 2 * np.pi
    return F.interpolate(phase.transpose(1, 2) * up, scale_factor=up, mode="linear").transpose(1, 2)[0].numpy()


@pytest.mark.parametrize("frames", [3, 150, 1500])
def test_sine_phase_matches_torch_bit_for_bit_scale(engine: CosyVoice2Engine, frames: int) -> None:
    rng = np.random.default_rng(frames)
    f0 = np.abs(rng.normal(160, 90, frames)).astype(np.float32)
    f0[rng.random(frames) < 0.2] = 0.0
    c = engine.constants
    want = official_sine_phase(f0, c.sample_rate, 480, c.nb_harmonics + 1)
    got = sine_phase(f0, c)
    assert np.abs(np.sin(got) - np.sin(want)).max() < 1e-5  # a float32 version without the fused rounding: ~1e-3 here


def test_stream_pieces_add_up_to_the_frames(engine: CosyVoice2Engine) -> None:
    voice = random_voice(37, seed=5)
    speech = np.random.default_rng(5).integers(0, 6561, 160).tolist()
    pieces = list(engine.synthesize_tokens(speech, voice, SynthesisOptions(stream=True, seed=1)))
    chunks, _ = official_chunks(37, 160)
    keep = 8 * 480
    # each piece holds back the audio of its last 8 frames and starts with the previous piece's (re-vocoded, faded)
    expected = [2 * hop * 480 - (keep if i == 0 else 0) for i, (_, hop) in enumerate(chunks)]
    assert [p.shape[0] for p in pieces[:-1]] == expected
    assert sum(p.shape[0] for p in pieces) == 2 * 160 * 480
    assert all(np.abs(p).max() <= engine.constants.audio_limit for p in pieces)


def test_speed_streams_and_resizes(engine: CosyVoice2Engine) -> None:
    voice = random_voice(10, seed=6)
    speech = np.random.default_rng(6).integers(0, 6561, 80).tolist()
    whole = np.concatenate(list(engine.synthesize_tokens(speech, voice, SynthesisOptions(speed=2.0, seed=1))))
    streamed = np.concatenate(list(engine.synthesize_tokens(speech, voice, SynthesisOptions(stream=True, speed=2.0, seed=1))))
    assert whole.shape[0] == int(160 / 2.0) * 480
    assert abs(streamed.shape[0] - whole.shape[0]) <= 480


# ---- whole requests -----------------------------------------------------------------------------


def test_synthesis_is_seeded_and_streams(engine: CosyVoice2Engine) -> None:
    voice = random_voice(30, seed=7, text_ids=(5, 6, 7))
    texts = [[100, 200, 300], [400]]
    a = list(engine.synthesize(texts, voice, SynthesisOptions(stream=True, seed=3)))
    b = list(engine.synthesize(texts, voice, SynthesisOptions(stream=True, seed=3)))
    assert [c.sentence_index for c in a if c.sentence_end] == [0, 1] and a[-1].is_final
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.audio, y.audio)
    assert sum(c.audio.shape[0] for c in a) > 0 and all(c.audio.dtype == np.float32 for c in a)


def test_cancel_stops_between_chunks(engine: CosyVoice2Engine) -> None:
    cancel = threading.Event()
    chunks = engine.synthesize([[1, 2, 3], [4, 5]], random_voice(5, seed=8), SynthesisOptions(stream=True, seed=0), cancel)
    next(chunks)
    cancel.set()
    assert all(not c.is_final for c in chunks)


def test_int8_twin_runs_with_half_caches(cv2_bundle: Path, engine: CosyVoice2Engine) -> None:
    twin = CosyVoice2Engine.load(cv2_bundle.with_name(cv2_bundle.name + "-int8"), ONE_THREAD)
    assert twin.flow.est_dtype == np.float16 and twin.runner.kv_dtype == np.float16
    voice = random_voice(30, seed=9)
    speech = np.random.default_rng(9).integers(0, 6561, 60).tolist()
    got = [c.mel for c in twin.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True))]
    want = [c.mel for c in engine.mel_chunks(iter(speech), voice.flow, SynthesisOptions(stream=True))]
    assert all(np.abs(g - w).max() < 0.5 for g, w in zip(got, want, strict=True))
    assert ModelBundle.load(cv2_bundle.with_name(cv2_bundle.name + "-int8")).manifest.precision == "int8"
