"""The listener's figures of a stream (loadtest/listener.py): first audio, time to continuous audio, stall seconds."""

from __future__ import annotations

import pytest

from loadtest.listener import listen, pcm_pieces


def test_a_stream_that_keeps_ahead_never_stalls() -> None:
    heard = listen([(0.5, 1.0), (1.0, 1.0), (1.9, 2.0)])
    assert (heard.first_audio_s, heard.ttca_s, heard.stall_s, heard.audio_s, heard.wall_s) == (0.5, 0.5, 0.0, 4.0, 1.9)


def test_ttca_is_the_start_at_which_a_player_never_waits() -> None:
    # 0.19 s of audio at 1.0 s, then the next piece at 3.0 s: a player starting at 1.0 s waits 1.81 s; one that
    # starts at 3.0 - 0.19 = 2.81 s plays through
    heard = listen([(1.0, 0.19), (3.0, 2.0), (4.0, 2.0)])
    assert heard.first_audio_s == 1.0
    assert heard.ttca_s == pytest.approx(2.81)
    assert heard.stall_s == pytest.approx(1.81)
    assert heard.rtf == pytest.approx(4.0 / 4.19)


def test_stalls_add_up_and_pieces_without_audio_are_ignored() -> None:
    heard = listen([(0.0, 0.0), (1.0, 0.5), (2.0, 0.5), (3.0, 0.5)])  # headers first, then 0.5 s every second
    assert heard.first_audio_s == 1.0 and heard.stall_s == pytest.approx(1.0) and heard.ttca_s == pytest.approx(2.0)


def test_bad_streams_are_refused() -> None:
    with pytest.raises(ValueError, match="no audio"):
        listen([(0.1, 0.0)])
    with pytest.raises(ValueError, match="order"):
        listen([(1.0, 0.1), (0.5, 0.1)])


def test_pcm_bytes_become_seconds() -> None:
    assert pcm_pieces([(0.1, 44100), (0.2, 0)], 44100.0) == [(0.1, 1.0), (0.2, 0.0)]


def test_a_forced_length_not_honoured_is_counted_as_short() -> None:
    from loadtest.bench_listen import row

    full = listen(pcm_pieces([(0.1, 48_000 * 5)], 48_000))  # 5 s of 24 kHz int16: 125 tokens at 25 Hz
    early = listen(pcm_pieces([(0.1, 48_000 * 3)], 48_000))  # 3 s: 75 tokens
    out = row("v", 1, [full, early, None], 1.0, forced=(125, 25))
    assert out["short"] == 1 and out["tokens_heard"] == [75, 125] and out["failures"] == 1
    assert row("v", 1, [full], 1.0, forced=(125, 25))["short"] == 0
