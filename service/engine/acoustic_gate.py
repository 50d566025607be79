"""The acoustic gate: at most `slots` flow/HiFT calls at once, first audio first, then earliest deadline first."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from service.engine.host import lower_thread_priority

_MISSING = object()
P = TypeVar("P")
R = TypeVar("R")
T = TypeVar("T")


@dataclass(eq=False)
class _Pooled:
    """One caller of AcousticGate.pooled: its payload, and the result another thread may produce for it."""

    key: Hashable
    payload: Any
    taken: bool = False  # some caller holds a slot and runs this payload
    result: Any = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


def _deliver(group: list[_Pooled], results: Iterable[Any]) -> None:
    """Hand results to their callers as they come; whoever got none gets the error (or a RuntimeError)."""
    error: BaseException | None = None
    try:
        it = iter(results)
        for member in group:
            member.result = next(it, _MISSING)
            if member.result is _MISSING:
                raise RuntimeError("the pooled call returned fewer results than it was given payloads")
            member.done.set()
    except BaseException as e:  # passed to every caller still waiting, re-raised here if not an Exception
        error = e
    if error is None:
        return
    for member in group:
        if not member.done.is_set():
            member.error = error if isinstance(error, Exception) else RuntimeError("pooled call interrupted")
            member.done.set()
    if not isinstance(error, Exception):
        raise error


def _never_step_aside() -> None:
    """step_aside of a gate without slots: nobody waits, so there is nobody to make room for."""


class SynthesisCancelled(Exception):
    """A request's cancel event was seen at a stop point of an acoustic call (before it, between two solver steps):
    the call is abandoned there. Engines end the request's generator quietly (`until_cancelled`)."""


def until_cancelled(chunks: Iterator[T]) -> Iterator[T]:
    """`chunks` until one of them raises SynthesisCancelled: then the generator simply ends, as a cancelled request's
    does."""
    try:
        yield from chunks
    except SynthesisCancelled:
        return


class AcousticGate:
    """Lets at most `slots` flow/HiFT calls run at once; first chunks go first, then earliest deadline first.

    A call's deadline is when its listener runs out of audio: the request's arrival plus the audio it
    has already received, so a stream that is seconds ahead yields to one about to stall. Calls for a
    request's first audio come before all others (in arrival order): under overload every running
    stream is behind, and plain EDF would make a newcomer wait until they all finished, while a
    listener who has heard nothing yet is the worst off. `slots=0` admits everyone at once. `nice` > 0
    lowers the priority of the threads that pass through (the LLM thread keeps the cores when it needs them).
    """

    def __init__(self, slots: int = 1, *, nice: int = 0) -> None:
        if slots < 0:
            raise ValueError("slots must be >= 0")
        self.slots = slots
        self.nice = nice
        self._cond = threading.Condition()
        self._busy = 0
        self._first_busy = 0
        self._pausing = 0  # slots held by calls that pause the decode steps (busy)
        self._waiting: list[tuple[int, float, int]] = []
        self._pooled: dict[tuple[int, float, int], _Pooled] = {}
        self._tickets = itertools.count()

    @contextmanager
    def slot(self, deadline: float, *, first: bool = False, pauses_llm: bool = True) -> Iterator[Callable[[], None]]:
        """Hold one slot for the duration of the block (waits while all are busy or a more urgent call waits).

        `pauses_llm` False marks a call that leaves a core to the decode steps (a one-thread call: a vocoder call, a
        flow call on one guidance lane): it counts neither as first audio running (first_audio_running) nor as
        acoustic work the decode steps step aside for (busy). A `first` call that pauses the LLM counts as both.

        The block receives a `step_aside()` callable for long calls that run in steps (the flow's Euler
        steps): between two steps it hands the slot to a waiting first-audio call, if there is one, and
        returns once this call's turn has come again. A listener who has heard nothing then waits for one
        estimator step, not for a whole middle chunk. It does nothing in a first-audio call itself.
        """
        lower_thread_priority(self.nice)
        first_audio = first and pauses_llm  # counted by first_audio_running
        pausing = int(pauses_llm)  # counted by busy
        if self.slots == 0:
            with self._cond:
                self._first_busy += first_audio
                self._pausing += pausing
            try:
                yield _never_step_aside
            finally:
                with self._cond:
                    self._first_busy -= first_audio
                    self._pausing -= pausing
            return
        ticket = (0 if first else 1, deadline, next(self._tickets))
        with self._cond:
            self._acquire(ticket)
            self._first_busy += first_audio
            self._pausing += pausing

        def step_aside() -> None:
            if first or not self._waiting or self._waiting[0][0] != 0:  # unlocked peek: a stale answer costs one step
                return
            with self._cond:
                if not self._waiting or self._waiting[0][0] != 0:
                    return
                self._busy -= 1
                self._pausing -= pausing
                self._cond.notify_all()
                self._acquire(ticket)
                self._pausing += pausing

        try:
            yield step_aside
        finally:
            with self._cond:
                self._busy -= 1
                self._first_busy -= first_audio
                self._pausing -= pausing
                self._cond.notify_all()

    def _acquire(self, ticket: tuple[int, float, int]) -> None:
        """With the lock held: queue `ticket`, wait until it is first and a slot is free, take the slot."""
        heapq.heappush(self._waiting, ticket)
        while self._busy >= self.slots or self._waiting[0] != ticket:
            self._cond.wait()
        heapq.heappop(self._waiting)
        self._busy += 1

    def pooled(
        self, deadline: float, key: Hashable, payload: P, execute: Callable[[list[P]], Iterable[R]], *, max_group: int = 16
    ) -> R:
        """A first-audio call that may run together with other waiting ones: returns `execute`'s result for `payload`.

        The caller queues like `slot(first=True)`. Whoever gets the slot takes every waiting pooled call
        with an equal `key` (up to `max_group`, in queue order), runs `execute` once on all their payloads
        and hands each caller its result as soon as `execute` yields it; the others never take a slot.
        An exception from `execute` is raised in every caller of the group still without a result.
        """
        lower_thread_priority(self.nice)
        me = _Pooled(key, payload)
        ticket = (0, deadline, next(self._tickets))
        with self._cond:
            if self.slots:
                heapq.heappush(self._waiting, ticket)
                self._pooled[ticket] = me
                while not me.taken and (self._busy >= self.slots or self._waiting[0] != ticket):
                    self._cond.wait()
            group = [] if me.taken else self._take_group(ticket, me, max_group)
            if group:
                self._busy += 1
                self._first_busy += 1
                self._pausing += 1
                self._cond.notify_all()  # the callers just taken stop waiting for a slot
        if group:
            try:
                _deliver(group, execute([g.payload for g in group]))
            finally:
                with self._cond:
                    self._busy -= 1
                    self._first_busy -= 1
                    self._pausing -= 1
                    self._cond.notify_all()
        me.done.wait()
        if me.error is not None:
            raise me.error
        return cast(R, me.result)

    def _take_group(self, ticket: tuple[int, float, int], me: _Pooled, max_group: int) -> list[_Pooled]:
        """With the lock held: `me` plus the waiting pooled calls of its key, all marked taken and unqueued."""
        self._pooled.pop(ticket, None)
        me.taken = True
        mates = sorted(t for t, p in self._pooled.items() if p.key == me.key)[: max(0, max_group - 1)]
        group = [me]
        for t in mates:
            mate = self._pooled.pop(t)
            mate.taken = True
            group.append(mate)
        gone = {ticket, *mates}
        self._waiting = [t for t in self._waiting if t not in gone]
        heapq.heapify(self._waiting)
        return group

    def busy(self) -> bool:
        """True while a call that pauses the decode steps (`pauses_llm`) holds a slot (read without the lock)."""
        return self._pausing > 0

    def idle(self) -> bool:
        """True while no call holds a slot or waits for one (read without the lock); a gate without slots (`slots=0`)
        counts nobody, so it is never idle."""
        return self.slots > 0 and self._busy == 0 and not self._waiting

    def alone(self) -> bool:
        """True while at most one call holds a slot (the caller's own, asked from inside it) and none waits (read without
        the lock); a gate without slots counts nobody, so it is never alone."""
        return self.slots > 0 and self._busy <= 1 and not self._waiting

    def first_audio_running(self) -> bool:
        """True while a call for some request's first audio holds a slot (read without the lock)."""
        return self._first_busy > 0


class Pacer:
    """Per-request deadline keeping at the AcousticGate: arrival time plus audio seconds delivered so far.

    Without a gate (`gate=None`) every call runs at once and pooled calls run alone; the Pacer still counts the
    request's audio, which the chunk schedule reads. With the request's `cancel` event, a call in `turn` stops at its
    next stop point once the event is set (before it starts, between two solver steps: SynthesisCancelled), so a
    client that goes away stops a long flow solve (a whole sentence's is one call) within one Euler step.
    """

    def __init__(
        self, gate: AcousticGate | None, sample_rate: int, start: float | None = None, cancel: threading.Event | None = None
    ) -> None:
        self.gate = gate
        self.sample_rate = sample_rate
        self.start = time.monotonic() if start is None else start
        self.audio_s = 0.0
        self.cancel = cancel

    @property
    def deadline(self) -> float:
        return self.start + self.audio_s

    @contextmanager
    def turn(self, *, first: bool, pauses_llm: bool = True) -> Iterator[Callable[[], None]]:
        """Run one acoustic call when the gate gives this request its turn; `first` (the call carries the request's
        first audio, as the chunk schedule decides) makes it urgent (and pauses the LLM unless `pauses_llm` is False).

        The block gets the slot's `step_aside` (see AcousticGate.slot) to call between solver steps; it raises
        SynthesisCancelled there once the request is cancelled (and so does entering the turn).
        """
        self.stop_point()
        if self.gate is None:
            yield self._stopping(_never_step_aside)
            return
        with self.gate.slot(self.deadline, first=first, pauses_llm=pauses_llm) as step_aside:
            self.stop_point()  # cancelled while it waited for the slot
            yield self._stopping(step_aside)

    def stop_point(self) -> None:
        """Raise SynthesisCancelled if the request has been cancelled."""
        if self.cancel is not None and self.cancel.is_set():
            raise SynthesisCancelled

    def _stopping(self, step_aside: Callable[[], None]) -> Callable[[], None]:
        def between_steps() -> None:
            self.stop_point()
            step_aside()

        return between_steps

    def pooled(self, key: Hashable, payload: P, execute: Callable[[list[P]], Iterable[R]], *, max_group: int) -> R:
        """This request's first-audio call, run together with at most `max_group - 1` other requests' (AcousticGate.pooled)."""
        if self.gate is None:
            return next(iter(execute([payload])))
        return self.gate.pooled(self.deadline, key, payload, execute, max_group=max_group)

    def delivered(self, samples: int) -> None:
        self.audio_s += samples / self.sample_rate
