"""Voices in the engine: official parity of the zero-shot, cross-lingual and instruct paths, and prompted rows
mixed among built-in speakers in continuous batching and first-chunk pooling."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from service.bundle import ModelBundle
from service.engine.llm import LLMRunner
from service.engine.options import RuntimeOptions
from service.engine.scheduler import BatchScheduler
from service.engine.types import LLMPrompt, SynthesisOptions
from service.errors import InvalidInputError
from service.families.cosyvoice1.engine import Synthesizer
from service.families.cosyvoice1.token2wav import POOLED_SOLVER_FRAMES, ChunkJob, GeneratorNoise
from service.families.cosyvoice1.verify.modes import verify_modes
from service.families.cosyvoice1.verify.stages import Engines
from service.families.cosyvoice1.voice import FlowPrompt, Voice


@pytest.fixture(scope="module")
def bundle(tiny_bundle: Path) -> ModelBundle:
    return ModelBundle.load(tiny_bundle)


@pytest.fixture(scope="module")
def direct(bundle: ModelBundle) -> Iterator[Synthesizer]:
    synth = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=0, acoustic_slots=0))
    yield synth
    synth.close()


@pytest.fixture(scope="module")
def cloned(ref_dir: Path) -> Voice:
    """A zero-shot voice with the official model inputs of zero_shot case 0 (prompt zh_16k)."""
    with np.load(ref_dir / "zero_shot.npz") as z, np.load(ref_dir / "prompts.npz") as p:
        return Voice.cloned(
            "zh_16k",
            z["case0_mi_llm_embedding"],
            tuple(int(t) for t in z["case0_mi_llm_prompt_speech_token"]),
            p["zh_16k_mel80"],
            tuple(int(t) for t in z["case0_mi_prompt_text"]),
        )


def test_every_mode_fixture_is_within_tolerance(bundle: ModelBundle, ref_dir: Path) -> None:
    checks = list(verify_modes(Engines.open(bundle, RuntimeOptions(intra_op_threads=1)), ref_dir))
    stages = {c.stage.split()[0] for c in checks}
    assert {"zero_shot", "cross_lingual", "instruct"} <= stages
    assert any(c.stage == "zero_shot stream" for c in checks) and any("legacy" in c.stage for c in checks)
    bad = [f"{c.stage} {c.name}: {c.error:.3g} > {c.tolerance}" for c in checks if not c.ok]
    assert not bad, bad


def test_voice_kinds_and_fingerprints(bundle: ModelBundle, cloned: Voice) -> None:
    sft = Voice.builtin("中文女", bundle.speakers["中文女"])
    cross = Voice.cloned("x", cloned.flow.embedding, cloned.flow.tokens, cloned.flow.mel)  # type: ignore[arg-type]
    instruct = sft.with_instruction((1, 2, 3))
    assert [v.kind for v in (sft, cloned, cross, instruct)] == ["sft", "zero_shot", "cross_lingual", "instruct"]
    assert len({v.fingerprint for v in (sft, cloned, cross, instruct)}) == 4
    assert Voice.builtin("other name", bundle.speakers["中文女"]).fingerprint == sft.fingerprint  # numbers, not names
    assert cross.llm.speech_tokens == () and cross.llm.prompt_text_ids == ()
    with pytest.raises(ValueError):
        FlowPrompt(sft.flow.embedding, (1, 2), None)  # tokens without a mel


def test_prompted_llm_limits_count_the_tts_text_only(bundle: ModelBundle, direct: Synthesizer, cloned: Voice) -> None:
    runner = direct.llm
    assert isinstance(runner, LLMRunner)
    request = runner.start([1, 2, 3], cloned.llm, np.random.default_rng(0))
    assert (request.min_len, request.max_len) == (6, 60)
    assert request.prefill_len == 1 + 1 + len(cloned.llm.prompt_text_ids) + 3 + 1 + len(cloned.llm.speech_tokens)
    instruct = runner.start([1, 2, 3], LLMPrompt(None, (7, 8)), np.random.default_rng(0))
    assert instruct.prefill_len == 1 + 2 + 3 + 1  # no speaker row


def test_cloned_voice_streams_and_cuts_the_prompt_frames(direct: Synthesizer, cloned: Voice) -> None:
    c = direct.bundle.constants
    chunks = list(direct.synthesize([[15947, 1002, 13]], cloned, SynthesisOptions(seed=1, stream=True)))
    whole = list(direct.synthesize([[15947, 1002, 13]], cloned, SynthesisOptions(seed=1)))
    streamed = sum(ch.audio.size for ch in chunks)
    assert len(chunks) > 1 and streamed == whole[0].audio.size
    assert streamed % c.mel_hop_samples == 0 and streamed < 60 * c.mel_hop_samples * 2  # no prompt frames in the output


def test_prompted_and_builtin_rows_batch_together(bundle: ModelBundle, direct: Synthesizer, cloned: Voice) -> None:
    batched = Synthesizer.load(bundle, RuntimeOptions(intra_op_threads=1, max_batch=4, acoustic_slots=1))
    voices: list[Voice | str] = [cloned, "中文男", cloned.with_instruction((40, 716)), "英文女"]
    opts = SynthesisOptions(seed=5, stream=True)
    try:
        want = [[c.audio for c in direct.synthesize([[15947, 1002, 13]], v, opts)] for v in voices]
        got: dict[int, list[np.ndarray]] = {}

        def run(k: int) -> None:
            got[k] = [c.audio for c in batched.synthesize([[15947, 1002, 13]], voices[k], opts)]

        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(voices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert isinstance(batched.llm, BatchScheduler) and batched.llm.stats.max_rows > 1
        for k in range(len(voices)):
            assert len(got[k]) == len(want[k])
            for a, b in zip(got[k], want[k], strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    finally:
        batched.close()


def test_first_chunks_of_long_prompts_are_solved_alone(direct: Synthesizer, cloned: Voice) -> None:
    """A pooled solve covers at most POOLED_SOLVER_FRAMES frames: built-in first chunks pool many at a time, first
    chunks behind a 10 s prompt (861 prompt frames) one at a time, since the estimator's memory grows with frames^2."""
    t2w = direct.token2wav
    tokens = tuple(range(41))
    sft = direct.voice("中文女").flow
    long_prompt = FlowPrompt(sft.embedding, tokens=tuple(range(500)), mel=np.zeros((861, t2w.constants.n_mels), np.float32))
    assert t2w.pool_limit(tokens, sft) >= 8
    assert t2w.pool_limit(tokens, long_prompt) == 1
    frames = t2w.flow.solver_frames(len(tokens), cloned.flow)
    assert t2w.pool_limit(tokens, cloned.flow) == max(1, POOLED_SOLVER_FRAMES // frames) < t2w.pool_limit(tokens, sft)


def test_pool_keys_keep_prompted_first_chunks_apart(direct: Synthesizer, cloned: Voice) -> None:
    t2w = direct.token2wav
    tokens = tuple(range(41))
    sft = direct.voice("中文女").flow
    assert t2w.pool_key(tokens, sft, None) != t2w.pool_key(tokens, cloned.flow, None)
    assert t2w.pool_key(tokens, sft, None) == t2w.pool_key(tokens, direct.voice("英文男").flow, None)

    def jobs() -> list[ChunkJob]:
        return [ChunkJob(tokens, cloned.flow, t2w.new_state(), GeneratorNoise(np.random.default_rng(k)), 10) for k in range(2)]

    alone_jobs, pooled_jobs = jobs(), jobs()
    alone = [t2w(j.tokens, j.prompt, j.state, j.noise, finalize=False, n_timesteps=10) for j in alone_jobs]
    pooled = list(t2w.first_chunks(pooled_jobs))
    for a, b in zip(alone, pooled, strict=True):
        np.testing.assert_allclose(b.audio, a.audio, atol=1e-5, rtol=0)
    mixed = [ChunkJob(tokens, sft, t2w.new_state(), GeneratorNoise(np.random.default_rng(9)), 10), jobs()[0]]
    with pytest.raises(ValueError):
        list(t2w.first_chunks(mixed))


def test_a_voice_with_the_wrong_sizes_is_refused(direct: Synthesizer, bundle: ModelBundle) -> None:
    bad: Any = Voice("bad", LLMPrompt(np.zeros(5, np.float32)), FlowPrompt(np.zeros(5, np.float32)))
    with pytest.raises(InvalidInputError):
        direct.synthesize([[1, 2]], bad)
    mel = np.zeros((10, 7), np.float32)
    emb = bundle.speakers["中文女"]
    with pytest.raises(InvalidInputError):
        direct.synthesize([[1, 2]], Voice("bad", LLMPrompt(emb), FlowPrompt(emb, (1, 2), mel)))
