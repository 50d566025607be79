"""A pass-through engine that can hold a stream after each chunk: timing preconditions by construction, not by speed.

A test that must see "the first audio arrived while the rest was still being made" closes the gate: the engine then
stops after each chunk until the test opens it again, so the stream cannot end early however fast the machine is.
`ThreadGate` serves an app in the test's own process; `FileGate` serves an app in a child process
(tests/gated_server.py), where the gate is open while a file exists.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Protocol

from service.engine.types import AudioChunk, SynthesisOptions
from service.families.cosyvoice1.voice import Voice
from service.speech.service import Engine

GATE_TIMEOUT_S = 60.0
CANCEL_POLL_S = 0.05  # how often a paused request that `releases_cancelled` looks at its cancel event


class Gate(Protocol):
    def set(self) -> None: ...

    def clear(self) -> None: ...

    def wait(self, timeout: float | None = None) -> bool: ...


class ThreadGate(threading.Event):
    """Open while set (an Event that starts open)."""

    def __init__(self) -> None:
        super().__init__()
        self.set()


class FileGate:
    """Open while `path` exists: a test process opens and closes the gate of a server process."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def set(self) -> None:
        self.path.touch()

    def clear(self) -> None:
        self.path.unlink(missing_ok=True)

    def wait(self, timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (GATE_TIMEOUT_S if timeout is None else timeout)
        while not self.path.exists():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


class GatedEngine:
    """The real synthesizer, paused after each chunk while `gate` is closed; records every request's cancel event.

    `releases_cancelled`: a paused request whose cancel event is set goes on at once (and the real engine then stops at
    its next step), so a test can hold work past a server's deadline without holding the server's exit after it."""

    def __init__(self, inner: Engine, gate: Gate | None = None, *, releases_cancelled: bool = False) -> None:
        self.inner = inner
        self.gate: Gate = gate if gate is not None else ThreadGate()
        self.releases_cancelled = releases_cancelled
        self.first_chunk = threading.Event()
        self.cancels: list[threading.Event] = []
        self.chunks = 0

    @property
    def sample_rate(self) -> int:
        return self.inner.sample_rate

    @property
    def speakers(self) -> Sequence[str]:
        return self.inner.speakers

    def voice(self, speaker: str) -> Voice:
        return self.inner.voice(speaker)

    @property
    def state_budget(self) -> object:
        """The wrapped engine's bound on its streams' growing state (None where it has none), for the metrics."""
        return getattr(self.inner, "state_budget", None)

    def synthesize(
        self, sentences: list[list[int]], voice: Voice, options: SynthesisOptions, cancel: threading.Event
    ) -> Iterator[AudioChunk]:
        self.cancels.append(cancel)
        return self._paced(self.inner.synthesize(sentences, voice, options, cancel), cancel)

    def close(self) -> None:
        """Stop the wrapped engine's threads (the model closes its engine through this wrapper)."""
        close_inner = getattr(self.inner, "close", None)
        if callable(close_inner):
            close_inner()

    def _paced(self, chunks: Iterator[AudioChunk], cancel: threading.Event) -> Iterator[AudioChunk]:
        for chunk in chunks:
            self.chunks += 1
            yield chunk
            self.first_chunk.set()
            if not self._wait_open(cancel):
                raise TimeoutError("the test never opened the gate")

    def _wait_open(self, cancel: threading.Event) -> bool:
        if not self.releases_cancelled:
            return self.gate.wait(timeout=GATE_TIMEOUT_S)
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not self.gate.wait(timeout=CANCEL_POLL_S):
            if cancel.is_set():
                return True
            if time.monotonic() > deadline:
                return False
        return True
