"""The chunk schedule as a pure policy: plain state in, next hop out, driven step by step without threads or a clock."""

from __future__ import annotations

import dataclasses

import pytest

from service.bundle import ModelConstants
from service.engine.chunking import ChunkSchedule, Progress, RateMeter, Rates, first_audio
from service.families.cosyvoice1.schedule import ScheduleConfig, chunk_audio_s, chunk_cost_s, next_hop
from service.layers.chunk_schedule import HopSchedule

C = ModelConstants()
ADAPTIVE = ScheduleConfig.default(C)
# seconds per unit of work on a host that is about twice as fast as real time, and on one slower than real time
FAST = Rates(token_s=0.007, solver_frame_s=0.002, vocoder_frame_s=0.0006)
SLOW = Rates(token_s=0.02, solver_frame_s=0.02, vocoder_frame_s=0.005)


def start(**kw: object) -> Progress:
    return Progress(**({"chunks": 0, "last_hop": 0, "buffered": 0, "llm_done": False, "audio_s": 0.0} | kw))  # type: ignore[arg-type]


def hops(config: ScheduleConfig, rates: Rates | None, n_chunks: int, **kw: object) -> list[int]:
    """Hops of a sentence's first `n_chunks` chunks when the LLM keeps up (tokens arrive as needed)."""
    out, audio = [], 0.0
    for k in range(n_chunks):
        p = start(chunks=k, last_hop=out[-1] if out else 0, buffered=C.token_overlap_len if k else 0, audio_s=audio, **kw)
        out.append(next_hop(config, p, rates, C))
        audio += chunk_audio_s(out[-1], C)
    return out


def test_official_schedule_reproduces_the_official_boundaries() -> None:
    official = ScheduleConfig.official(C)
    assert (official.first_hop, official.min_hop, official.max_hop, official.adaptive) == (100, 100, 200, False)
    assert hops(official, FAST, 4) == [100, 100, 100, 100]  # measured rates change nothing
    scaled = ScheduleConfig.official(dataclasses.replace(C, stream_scale_factor=2.0))
    assert hops(scaled, None, 4) == [100, 200, 200, 200]  # the official growth, capped at token_max_hop_len


def test_first_audio_is_decided_in_one_place() -> None:
    assert first_audio(start())
    assert not first_audio(start(chunks=1))  # a later chunk of the first sentence
    assert not first_audio(start(audio_s=0.5))  # the first chunk of a later sentence: the listener has audio
    assert next_hop(ADAPTIVE.with_first_hop(33), start(), SLOW, C) == 33  # the first hop whatever the rates
    assert ADAPTIVE.first_audio_tokens(0) == 21 + 20 and ADAPTIVE.with_first_hop(33).first_audio_tokens(0) == 53


def test_a_later_sentence_does_not_restart_with_the_first_hop() -> None:
    fixed = ScheduleConfig.official(C).with_first_hop(21)
    assert next_hop(fixed, start(audio_s=1.0), None, C) == 100
    assert next_hop(ADAPTIVE, start(audio_s=1.0, llm_done=True, buffered=200), FAST, C) < 100


def test_adaptive_schedule_before_any_measurement_takes_short_hops_growing_to_the_official_one() -> None:
    """1 s of speech after the first chunk, then the audio delivered so far, up to the official hop."""
    assert ADAPTIVE.short_hop == 50 and ADAPTIVE.steady_hop == C.token_hop_len == 100
    assert hops(ADAPTIVE, None, 5) == [21, 50, 71, 100, 100]  # 21 + 50 tokens' audio out: 71, then capped
    assert hops(dataclasses.replace(ADAPTIVE, short_hop=0), None, 3) == [21, 100, 100]  # without short hops


def test_each_chunk_covers_the_time_the_next_takes() -> None:
    """The property the schedule exists for: a chunk's audio lasts at least as long as making the next chunk of its
    size, and no smaller hop would do."""
    for rates in (FAST, dataclasses.replace(FAST, solver_frame_s=0.004)):
        for prompt_frames in (0, 86, 172):
            for k, hop in enumerate(hops(ADAPTIVE, rates, 5, prompt_frames=prompt_frames)[1:], start=1):
                assert hop < ADAPTIVE.max_hop, (rates, prompt_frames, k)  # these hosts can keep up
                assert chunk_audio_s(hop, C) >= chunk_cost_s(hop, ADAPTIVE, rates, C, prompt_frames)
                smaller = hop - 1
                if smaller >= ADAPTIVE.min_hop:
                    assert chunk_audio_s(smaller, C) < chunk_cost_s(smaller, ADAPTIVE, rates, C, prompt_frames)


def test_costlier_work_means_longer_chunks() -> None:
    mid = dataclasses.replace(FAST, solver_frame_s=0.006)
    base = hops(ADAPTIVE, mid, 3)[1]
    assert ADAPTIVE.min_hop < base < ADAPTIVE.max_hop
    assert hops(ADAPTIVE, mid, 3, prompt_frames=86)[1] > base  # a cloned voice's prompt frames are solved each time
    assert hops(ADAPTIVE, dataclasses.replace(mid, solver_frame_s=0.007), 3)[1] > base
    assert hops(ADAPTIVE, mid, 3, speed=1.5)[1] > base  # faster speech: a chunk's audio is shorter
    assert hops(ADAPTIVE, FAST, 3)[1] <= base


def test_waiting_for_tokens_counts_unless_the_llm_is_done() -> None:
    slow_llm = dataclasses.replace(FAST, token_s=0.03)  # slower than real time (50 tokens/s)
    waiting = next_hop(ADAPTIVE, start(chunks=1, last_hop=21, buffered=20), slow_llm, C)
    done = next_hop(ADAPTIVE, start(chunks=1, last_hop=21, buffered=500, llm_done=True), slow_llm, C)
    assert waiting == ADAPTIVE.short_hop  # nothing covers, and only the first chunk is out: a short hop
    assert done < waiting  # everything decoded: only the acoustic cost counts


def test_a_host_slower_than_real_time_gets_short_hops_not_the_largest() -> None:
    """No hop covers: one max_hop chunk right after the short first one would be the largest wait a listener can get;
    a short one is made while the listener plays what is out, and the hops grow with the audio delivered."""
    assert hops(ADAPTIVE, SLOW, 5) == [21, 50, 71, 100, 100]
    at_double_speed = start(chunks=2, last_hop=50, buffered=20, audio_s=0.71, speed=2.0)  # 71 tokens' audio at twice the tempo
    assert next_hop(ADAPTIVE, at_double_speed, SLOW, C) == 71
    assert next_hop(ADAPTIVE, start(chunks=3, audio_s=10.0, buffered=20), SLOW, C) == ADAPTIVE.steady_hop < ADAPTIVE.max_hop


def test_a_covering_hop_longer_than_the_official_one_waits_for_as_much_audio_delivered() -> None:
    """A host that keeps up only with long chunks: right after the short first chunk the hop stays the official one
    (a longer chunk would keep the listener waiting for all of it); once the audio out is longer, the covering hop."""
    tight = Rates(token_s=0.007, solver_frame_s=0.0095, vocoder_frame_s=0.0006)  # covers from about 140 tokens
    after_first = next_hop(ADAPTIVE, start(chunks=1, last_hop=21, buffered=20, audio_s=0.19), tight, C)
    later = next_hop(ADAPTIVE, start(chunks=3, last_hop=100, buffered=20, audio_s=5.0), tight, C)
    assert after_first == ADAPTIVE.short_hop  # none up to the official hop covers: a short one
    assert ADAPTIVE.steady_hop < later < ADAPTIVE.max_hop
    assert chunk_audio_s(later, C) >= chunk_cost_s(later, ADAPTIVE, tight, C, 0)


def test_the_adaptive_schedule_takes_a_tail_of_up_to_two_overlaps_the_official_none() -> None:
    """takes_tail(left): a chunk cut with `left` tokens after its hop (its 20-token overlap and what more is decoded)."""
    assert [ADAPTIVE.takes_tail(left) for left in (20, 39, 40, 41)] == [True, True, True, False]
    assert not any(ScheduleConfig.official(C).takes_tail(left) for left in (0, 20, 40))  # the official split
    assert not ScheduleConfig.default(C, tail=False).takes_tail(20)  # the lever off
    assert ADAPTIVE.with_first_hop(33).tail == ADAPTIVE.tail == 2 * C.token_overlap_len


def test_every_chunk_may_take_the_cores() -> None:
    """Whether it does is the engine's cores_free (no decode step and no other acoustic call beside it)."""
    assert [ADAPTIVE.takes_cores(100, first=f, final=last) for f, last in [(1, 0), (0, 0), (0, 1)]] == [True, True, True]
    vocoder = [ADAPTIVE.vocoder_takes_cores(100, before=b, final=last) for b, last in [(0, False), (21, False), (121, True)]]
    assert vocoder == [True, True, True]


def test_every_familys_schedule_answers_the_shared_interface() -> None:
    asked = [name for name in vars(ChunkSchedule) if not name.startswith("_")]
    assert {"next_hop", "takes_tail", "takes_cores", "vocoder_takes_cores"} <= set(asked)
    for schedule in (ADAPTIVE, ScheduleConfig.official(C), HopSchedule()):
        assert all(callable(getattr(schedule, name, None)) for name in asked), schedule


def test_schedule_config_is_validated() -> None:
    with pytest.raises(ValueError, match="first_hop_tokens must be > token_overlap_len"):
        ScheduleConfig.default(C, first_hop=20)
    with pytest.raises(ValueError, match="min_hop"):
        dataclasses.replace(ADAPTIVE, min_hop=20)
    with pytest.raises(ValueError, match="max_hop"):
        dataclasses.replace(ADAPTIVE, max_hop=10)


def test_rate_meter_learns_every_part_before_it_answers() -> None:
    meter = RateMeter(smoothing=0.5)
    meter.token_interval(0.01)
    meter.flow_call(100, 0.2)
    assert meter.rates() is None
    meter.vocoder_call(50, 0.05)
    assert meter.rates() == Rates(token_s=0.01, solver_frame_s=0.002, vocoder_frame_s=0.001)
    meter.flow_call(100, 0.4)
    meter.token_interval(0.0)  # nothing to learn from
    rates = meter.rates()
    assert rates is not None and rates.solver_frame_s == pytest.approx(0.003) and rates.token_s == 0.01


def test_rate_meter_keeps_chunks_made_beside_the_decode_apart_from_those_made_after() -> None:
    """A chunk made while its tokens are still decoded shares the cores with the decode; one made after has both. A mix
    of the two made a chunk planned beside the decode look about twice as cheap as it is."""
    meter = RateMeter(smoothing=0.5)
    meter.token_interval(0.01)
    meter.flow_call(100, 0.8, beside_decode=False)
    meter.vocoder_call(100, 0.1, beside_decode=False)
    after = Rates(token_s=0.01, solver_frame_s=0.008, vocoder_frame_s=0.001)
    assert meter.rates(beside_decode=True) == meter.rates(beside_decode=False) == after  # only one kind seen yet
    meter.flow_call(100, 2.0)
    meter.vocoder_call(100, 0.3)
    assert meter.rates() == Rates(token_s=0.01, solver_frame_s=0.02, vocoder_frame_s=0.003)  # beside is the default
    assert meter.rates(beside_decode=False) == after
