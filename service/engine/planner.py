"""The batching planner: what the LLM's scheduler thread does next, as a pure function of plain state.

The thread (service/engine/scheduler.py) only gathers this state and carries out the answers: it prefills the
`admissions`, then runs one batched decode step unless the batch `pauses`. Tests drive both step by step without
threads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One request in the decode batch, as its consumer stands."""

    waiting: bool  # its consumer is blocked until the next tokens arrive
    sent: int  # tokens decoded and handed over
    taken: int  # tokens its consumer has taken
    urgent: int  # its first `urgent` tokens feed the request's first audio


@dataclass(frozen=True)
class State:
    """What the scheduler knows before a step (after this round's prefills)."""

    pending: int  # requests still queued for their prefill
    rows: tuple[Row, ...]  # requests in the batch
    first_audio_running: bool = False  # a first chunk is being made (yield_to): the cores are asked for
    acoustic_busy: bool = False  # an acoustic call runs or waits
    lead_tokens: int = 0  # pause while acoustic calls run once every row is this far ahead of its consumer (0: never)


def admissions(pending: int, in_batch: int, max_batch: int) -> int:
    """How many queued requests to prefill now: as many as the batch has room for, oldest first."""
    return min(pending, max(0, max_batch - in_batch))


def pauses(state: State) -> bool:
    """Decoding yields the cores while a first chunk is made and no first-audio consumer waits for tokens, or while
    acoustic calls run and every row is `lead_tokens` ahead of its consumer; never with a prefill queued."""
    if state.pending:
        return False
    rows = state.rows
    lead = state.lead_tokens > 0 and state.acoustic_busy and bool(rows)
    if lead and all(not r.waiting and r.sent - r.taken >= state.lead_tokens for r in rows):
        return True
    if not state.first_audio_running:
        return False
    return not any(r.waiting and r.sent < r.urgent for r in rows)
