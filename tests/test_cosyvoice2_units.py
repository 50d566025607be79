"""CosyVoice2 engine pieces that need no bundle: voices, the hop schedule, the prompt-state cache, the vocoder window."""

from __future__ import annotations

import numpy as np
import pytest

from service.engine.options import RuntimeOptions
from service.errors import BundleError
from service.families.cosyvoice2.assembly import one_thread_calls
from service.families.cosyvoice2.contract import CosyVoice2Constants
from service.families.cosyvoice2.flow import EncoderState, FlowState, check_time_first
from service.families.cosyvoice2.voice import FlowPrompt2, Voice2
from service.layers.chunk_schedule import HopSchedule, window_tokens
from service.layers.frame_cache import CachePrecision, EstimatorState, FrameCache, PromptStates


def rows(frames: int, width: int, capacity: int | None = None) -> list[FrameCache]:
    """Two guidance rows' caches of one block and one head, each holding `frames` frames valued by frame index."""
    caches = [FrameCache.empty(1, 1, width, np.float32, frames if capacity is None else capacity) for _ in (0, 1)]
    for c in caches:
        c.append(np.arange(frames, dtype=np.float32).reshape(1, 1, frames, 1, 1) * np.ones(width, dtype=np.float32))
    return caches


def state(frames: int, width: int = 4) -> FlowState:
    encoder = EncoderState(np.zeros((1, 2, 2)), np.zeros((1, 2, 2)), [], [], [], [], tokens=frames // 2)
    return FlowState(
        encoder, [EstimatorState(np.zeros((2, 3, 2), dtype=np.float32), rows(frames, width), rows(frames, width))], frames=frames
    )


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
        hop, base = schedule.after(base, end)
        hops.append(hop)
        end += hop
    assert hops == [25, 50, 100, 100, 100]


def hops(schedule: HopSchedule, prompt: int, tokens: int) -> list[int]:
    """Every non-final hop of a sentence of `tokens` speech tokens, as the engine's loop cuts them."""
    hop, base, offset, out = schedule.first_hop(prompt), schedule.first, 0, []
    while tokens - offset >= hop + schedule.look_ahead:
        out.append(hop)
        offset += hop
        hop, base = schedule.after(base, prompt + offset)
    return out


def test_early_schedule_splits_only_the_first_attention_chunk() -> None:
    early = HopSchedule(first=10, scale=1, aligned_first=False)
    assert hops(early, 28, 125) == [10, 12, 25, 25, 25, 25]  # then 3 final tokens
    assert hops(early, 0, 60) == [10, 15, 25]
    assert hops(HopSchedule(first=10, scale=2, aligned_first=False), 28, 200) == [10, 12, 25, 50, 100]
    for prompt in (0, 3, 28, 37, 53):  # every hop after the first ends on a chunk boundary
        cut = hops(early, prompt, 300)
        ends = [prompt + sum(cut[: i + 1]) for i in range(len(cut))]
        assert all(end % 25 == 0 for end in ends[1:])
    assert early.first_audio_tokens(28) == 13 and HopSchedule().first_audio_tokens(28) == 25 + 22 + 3


def test_only_the_early_schedule_takes_a_look_ahead_tail_into_the_last_chunk() -> None:
    early = HopSchedule(first=10, scale=1, aligned_first=False)
    assert [early.takes_tail(left) for left in (0, 1, 3, 4)] == [True, True, True, False]
    assert not HopSchedule().takes_tail(3)  # official: the look-ahead tokens are a last call of their own


def test_only_the_rest_of_an_early_first_attention_chunk_shares_the_cores() -> None:
    early = HopSchedule(first=10, scale=1, aligned_first=False)
    cut = hops(early, 28, 125)
    wide = [early.takes_cores(hop, first=i == 0, final=False) for i, hop in enumerate(cut)]
    assert wide == [True, False, True, True, True, True]
    assert early.takes_cores(3, first=False, final=True)  # the last chunk: nothing is left to decode beside it
    official = HopSchedule()
    assert all(official.takes_cores(hop, first=i == 0, final=False) for i, hop in enumerate(hops(official, 37, 300)))


def test_the_first_whole_chunk_and_the_last_vocode_on_both_cores() -> None:
    def wide(schedule: HopSchedule, cut: list[int], last: int) -> list[bool]:
        before = [sum(cut[:i]) for i in range(len(cut) + 1)]
        middle = [schedule.vocoder_takes_cores(hop, before=b, final=False) for hop, b in zip(cut, before, strict=False)]
        return [*middle, schedule.vocoder_takes_cores(last, before=before[-1], final=True)]

    early = HopSchedule(first=10, scale=1, aligned_first=False)
    assert wide(early, hops(early, 28, 125), 3) == [False, False, True, False, False, False, True]
    assert wide(early, hops(early, 28, 24), 14) == [False, True]  # a short sentence: 10 tokens, then the last 14
    assert early.vocoder_takes_cores(
        25, before=0, final=False
    )  # a first hop of a whole chunk (TTS_ENGINE_PROFILE=first_hop_tokens=25)
    official = HopSchedule()  # growing hops: the next chunk waits for the decode steps, only the last takes the cores
    assert wide(official, hops(official, 37, 300), 12) == [False, False, False, False, True]
    assert official.vocoder_takes_cores(125, before=0, final=True)  # a whole non-streamed sentence


def test_official_schedule_pads_the_first_hop_then_doubles() -> None:
    assert hops(HopSchedule(), 37, 300) == [38, 50, 100, 100]
    assert hops(HopSchedule(), 0, 300) == [25, 50, 100, 100]


def test_prompt_window_ends_three_tokens_past_a_chunk() -> None:
    schedule = HopSchedule()
    assert window_tokens(None, schedule, 25) is None
    assert [window_tokens(s, schedule, 25) for s in (0.0, 0.04, 1.0, 1.2, 2.0)] == [0, 3, 28, 53, 53]
    prompt = FlowPrompt2(np.zeros(192), tuple(range(40)), np.arange(80 * 80, dtype=np.float32).reshape(80, 80))
    window = prompt.window(28)
    assert window.tokens == tuple(range(12, 40)) and np.array_equal(window.mel, prompt.mel[24:])
    assert prompt.window(None) is prompt and prompt.window(40) is prompt


def test_acoustic_budget_becomes_one_thread_calls() -> None:
    plan = one_thread_calls(RuntimeOptions(intra_op_threads=2, acoustic_slots=1))
    assert (plan.acoustic_threads, plan.acoustic_slots) == (1, 2)
    chosen = RuntimeOptions(acoustic_threads=2)
    assert one_thread_calls(chosen) is chosen
    unlimited = RuntimeOptions(acoustic_slots=0)
    assert one_thread_calls(unlimited) is unlimited


def test_prompt_states_keep_the_most_recent_within_the_budget() -> None:
    one = state(10).nbytes()
    cache = PromptStates(max_bytes=2 * one + one // 2)
    for name in ("a", "b", "c"):
        cache.put((name, 10, 0), state(10))
    assert cache.get(("a", 10, 0)) is None and cache.get(("b", 10, 0)) is not None and len(cache) == 2
    cache.put(("huge", 10, 0), state(1000))  # larger than the whole budget: not kept, nothing evicted
    assert cache.get(("huge", 10, 0)) is None and len(cache) == 2


def test_a_state_copy_owns_its_caches_and_the_original_is_untouched() -> None:
    original = state(6)
    twin = original.copy(capacity=20)
    twin.steps[0].k[0].append(np.full((1, 1, 4, 1, 4), 99.0, dtype=np.float32))
    twin.frames += 4
    assert original.frames == 6 and original.steps[0].k[0].frames == 6
    assert np.array_equal(original.steps[0].k[0].view(0)[0, :, 0, 0], np.arange(6))
    assert twin.steps[0].k[0].view(0)[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 99, 99, 99, 99]
    assert twin.steps[0].k[0].buffer.shape[1] == 20 and twin.steps[0].tails is not original.steps[0].tails
    assert not np.shares_memory(twin.steps[0].k[0].buffer, original.steps[0].k[0].buffer)


def test_a_frame_cache_appends_in_place_and_grows_past_its_capacity() -> None:
    cache = rows(0, 2, capacity=4)[0]
    buffer = cache.buffer
    for start in (0, 3):
        cache.append(np.arange(start, start + 3, dtype=np.float32).reshape(1, 1, 3, 1, 1) * np.ones(2, dtype=np.float32))
    assert cache.frames == 6 and cache.buffer.shape[1] == 8 and cache.buffer is not buffer  # grown once, kept
    view = cache.view(0)
    assert view.shape == (1, 6, 1, 2) and view.flags.c_contiguous  # fed to the graph without a copy
    assert view[0, :, 0, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert cache.nbytes() == 6 * 2 * 4
    half = FrameCache.empty(1, 1, 2, np.float16, 4)
    half.append(np.full((1, 1, 2, 1, 2), 0.5, dtype=np.float32))  # a float32 graph output into a float16 cache
    assert half.view(0).dtype == np.float16 and half.view(0).shape == (1, 2, 1, 2)


@pytest.mark.parametrize("precision", ["graph", "int8"])
@pytest.mark.parametrize("dropping", [(2, 0), (2, 3), (2, 4), (2, 7), (0, 9)])
def test_a_window_lets_go_before_new_frames_come_in(precision: CachePrecision, dropping: tuple[int, int]) -> None:
    """Appending with `dropping` keeps what appending and then dropping keeps, bit for bit (the dropped frames may be
    old, new or both), and writes no frame past those it keeps: a window's caches never touch more pages than it
    holds."""
    rng = np.random.default_rng(11)
    old, new = (rng.standard_normal((3, 1, n, 2, 8)).astype(np.float16) for n in (6, 4))
    first, count = dropping
    after = FrameCache.empty(3, 2, 8, np.float16, 10, precision)
    after.append(old)
    after.append(new)
    after.drop(first, count)
    before = FrameCache.empty(3, 2, 8, np.float16, 10, precision)
    before.append(old)
    for array in before.arrays():
        array[:, 6:] = 7  # frames nobody wrote yet
    before.append(new, dropping)
    assert before.frames == after.frames == 10 - count
    for mine, theirs in zip(before.arrays(), after.arrays(), strict=True):
        np.testing.assert_array_equal(mine[:, : before.frames], theirs[:, : after.frames])
        assert (mine[:, max(6, before.frames) :] == 7).all()  # nothing written past the kept frames
    with pytest.raises(ValueError):
        before.append(new, (2, before.frames + 3))


@pytest.mark.parametrize("precision", ["graph", "float16", "int8"])
def test_a_copy_of_a_frozen_cache_reads_its_frames_and_feeds_what_a_copy_would(precision: CachePrecision) -> None:
    rng = np.random.default_rng(12)
    prompt, later = (rng.standard_normal((3, 1, n, 2, 8)).astype(np.float16) for n in (5, 7))
    frozen = FrameCache.empty(3, 2, 8, np.float16, 0, precision)
    frozen.append(prompt)
    frozen.freeze()
    alone = FrameCache.empty(3, 2, 8, np.float16, 12, precision)
    alone.append(prompt)
    reader = frozen.copy(capacity=12)
    assert reader.head is frozen and reader.buffer.shape[1] == 7  # room for its own frames only
    for cache in (reader, alone):
        cache.append(later[:, :, :4])
        cache.append(later[:, :, 4:], (5, 2))  # a window lets go of two of its own frames
    assert reader.frames == alone.frames == 10
    for b in range(3):
        np.testing.assert_array_equal(reader.view(b).view(np.uint16), alone.view(b).view(np.uint16))
    with pytest.raises(ValueError):
        reader.drop(3, 2)  # the head's frames are not its own
    with pytest.raises(ValueError, match="frozen"):
        frozen.append(later)
    assert frozen.frames == 5 and reader.copy(20).head is frozen  # a copy of a reader reads the same head


class _Input:
    def __init__(self, name: str, shape: list[object]) -> None:
        self.name, self.shape = name, shape


class _Graph:
    def __init__(self, shape: list[object]) -> None:
        self.inputs = [_Input("x", ["B", 80, "M"]), _Input("past_k_0", shape)]

    def get_inputs(self) -> list[_Input]:
        return self.inputs


def test_an_estimator_with_heads_first_caches_is_refused_with_a_re_export_hint() -> None:
    extra = CosyVoice2Constants()
    check_time_first(_Graph(["B", "C", extra.estimator_heads, extra.estimator_head_dim]), extra)  # time-first: fine
    with pytest.raises(BundleError, match="re-export the bundle"):
        check_time_first(_Graph(["B", extra.estimator_heads, "C", extra.estimator_head_dim]), extra)
