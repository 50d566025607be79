"""The batching planner is a pure function of plain state: admissions and pauses, driven step by step."""

from __future__ import annotations

from service.engine.planner import Row, State, admissions, pauses

WAITING_FOR_FIRST_AUDIO = Row(waiting=True, sent=5, taken=5, urgent=13)
AHEAD = Row(waiting=False, sent=30, taken=4, urgent=13)


def test_admissions_fill_the_batch_oldest_first() -> None:
    assert admissions(pending=3, in_batch=0, max_batch=16) == 3
    assert admissions(pending=5, in_batch=14, max_batch=16) == 2
    assert admissions(pending=5, in_batch=16, max_batch=16) == 0
    assert admissions(pending=0, in_batch=2, max_batch=16) == 0


def test_a_first_chunk_takes_the_cores_unless_a_first_audio_consumer_waits() -> None:
    assert pauses(State(pending=0, rows=(AHEAD,), first_audio_running=True))
    assert not pauses(State(pending=0, rows=(AHEAD, WAITING_FOR_FIRST_AUDIO), first_audio_running=True))
    assert not pauses(State(pending=0, rows=(AHEAD,), first_audio_running=False))


def test_a_queued_prefill_is_never_held_back() -> None:
    assert not pauses(State(pending=1, rows=(AHEAD,), first_audio_running=True, acoustic_busy=True, lead_tokens=10))


def test_decoding_pauses_beside_acoustic_work_once_every_row_is_far_enough_ahead() -> None:
    behind = Row(waiting=False, sent=8, taken=4, urgent=0)
    assert pauses(State(pending=0, rows=(AHEAD,), acoustic_busy=True, lead_tokens=25))
    assert not pauses(State(pending=0, rows=(AHEAD, behind), acoustic_busy=True, lead_tokens=25))
    assert not pauses(State(pending=0, rows=(AHEAD,), acoustic_busy=False, lead_tokens=25))
    assert not pauses(State(pending=0, rows=(AHEAD,), acoustic_busy=True, lead_tokens=0))


def test_a_stream_of_steps() -> None:
    """One request arrives while another decodes: admitted at once, then both decode; a first chunk of the new one
    pauses decoding only once its first-audio tokens are there."""
    rows: tuple[Row, ...] = (AHEAD,)
    assert admissions(pending=1, in_batch=len(rows), max_batch=2) == 1
    new = Row(waiting=True, sent=1, taken=0, urgent=13)
    rows = (AHEAD, new)
    assert not pauses(State(0, rows, first_audio_running=True))  # the new request waits for its first tokens
    rows = (AHEAD, Row(waiting=False, sent=13, taken=13, urgent=13))
    assert pauses(State(0, rows, first_audio_running=True))  # its first chunk is being made: the cores go to it
