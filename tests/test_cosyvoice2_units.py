"""CosyVoice2 engine pieces that need no bundle: voices, the hop schedule, the prompt-state cache, the vocoder window."""

from __future__ import annotations

import numpy as np
import pytest

from service.families.cosyvoice2.engine import HopSchedule, PromptStates
from service.families.cosyvoice2.flow import EncoderState, EstimatorState, FlowState
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2


def state(frames: int, width: int = 4) -> FlowState:
    kv = [np.zeros((2, 1, frames, width), dtype=np.float32)]
    encoder = EncoderState(np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), [], [], [], [], tokens=frames // 2)
    return FlowState(encoder, [EstimatorState(np.zeros((2, 3, 2), dtype=np.float32), list(kv), list(kv))], frames=frames)


def test_cloned_voice_trims_to_two_frames_a_token_and_picks_its_mode() -> None:
    rng = np.random.default_rng(0)
    emb, mel = rng.standard_normal(192), rng.standard_normal((41, 80))
    zero_shot = Voice2.cloned("a", emb, tuple(range(30)), mel, (5, 6))
    assert len(zero_shot.flow.tokens) == 20 and zero_shot.flow.mel.shape == (40, 80)
    assert zero_shot.kind == "zero_shot" and zero_shot.llm.speech_tokens == zero_shot.flow.tokens
    assert zero_shot.llm.prompt_text_ids == (5, 6) and zero_shot.llm.embedding is None
    cross = Voice2.cloned("a", emb, tuple(range(30)), mel)
    assert cross.kind == "cross_lingual" and cross.llm.speech_tokens == () and cross.llm.prompt_text_ids == ()
    instructed = cross.with_instruction((7, 8, 151646))
    assert instructed.kind == "instruct2" and instructed.llm.prompt_text_ids == (7, 8, 151646)
    assert instructed.llm.speech_tokens == () and instructed.flow is cross.flow
    assert len({zero_shot.fingerprint, cross.fingerprint, instructed.fingerprint}) == 3
    assert Voice2.builtin("s", emb).kind == "sft" and Voice2.builtin("s", emb).flow.tokens == ()


def test_a_flow_prompt_needs_its_mel() -> None:
    with pytest.raises(ValueError, match=r"needs a \(6, 80\) mel"):
        FlowPrompt2(np.zeros(192), (1, 2, 3), np.zeros((5, 80)))


def test_hop_schedule_doubles_to_its_cap() -> None:
    schedule = HopSchedule()
    hops, base, end = [25], 25, 25
    while len(hops) < 5:
        hop, base = schedule.next_hop(base, end)
        hops.append(hop)
        end += hop
    assert hops == [25, 50, 100, 100, 100]


def test_prompt_states_keep_the_most_recent_within_the_budget() -> None:
    one = state(10).nbytes()
    cache = PromptStates(max_bytes=2 * one + one // 2)
    for name in ("a", "b", "c"):
        cache.put((name, 10, 0), state(10))
    assert cache.get(("a", 10, 0)) is None and cache.get(("b", 10, 0)) is not None and len(cache) == 2
    cache.put(("huge", 10, 0), state(1000))  # larger than the whole budget: not kept, nothing evicted
    assert cache.get(("huge", 10, 0)) is None and len(cache) == 2


def test_a_state_copy_shares_arrays_but_not_lists() -> None:
    original = state(6)
    twin = original.copy()
    twin.steps[0].k.append(np.ones(1))
    twin.frames += 4
    assert len(original.steps[0].k) == 1 and original.frames == 6
    assert twin.steps[0].k[0] is original.steps[0].k[0]  # the prompt's keys are not copied per request
