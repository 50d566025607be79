"""What a listener hears of a stream: first audio, time to continuous audio (TTCA) and stall seconds, from arrivals."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Listening:
    """One streamed request as a player hears it (seconds from the request's start unless said otherwise).

    first_audio_s: arrival of the first piece that carries audio.
    ttca_s: time to continuous audio, the earliest start at which a player never waits: the maximum over
        received pieces of (arrival time - seconds of audio received before it). Never below first_audio_s.
    stall_s: seconds a player that starts at the first audio sits silent, waiting for the next piece.
    audio_s: seconds of audio received; wall_s: arrival of the last piece.
    """

    first_audio_s: float
    ttca_s: float
    stall_s: float
    audio_s: float
    wall_s: float

    @property
    def rtf(self) -> float:
        """Streamed real-time factor: wall seconds per audio second."""
        return self.wall_s / self.audio_s if self.audio_s else float("inf")


def listen(pieces: Iterable[tuple[float, float]]) -> Listening:
    """The listener's figures from (arrival seconds, audio seconds) per received piece, in arrival order.

    Pieces without audio (headers, empty reads) are ignored; a stream with no audio raises ValueError.
    """
    heard = [(t, a) for t, a in pieces if a > 0]
    if not heard:
        raise ValueError("the stream carried no audio")
    if any(t1 < t0 for (t0, _), (t1, _) in itertools.pairwise(heard)):
        raise ValueError("pieces must be in arrival order")
    before = 0.0  # audio received before the current piece
    ttca = 0.0
    stall = 0.0
    playable_until = heard[0][0]  # a player starting at the first audio has played everything up to here
    for t, a in heard:
        ttca = max(ttca, t - before)
        if t > playable_until:
            stall += t - playable_until
            playable_until = t
        playable_until += a
        before += a
    return Listening(heard[0][0], ttca, stall, before, heard[-1][0])


def pcm_pieces(arrivals: Sequence[tuple[float, int]], bytes_per_s: float) -> list[tuple[float, float]]:
    """(arrival, audio seconds) from (arrival, bytes) of a raw PCM stream."""
    return [(t, n / bytes_per_s) for t, n in arrivals]
