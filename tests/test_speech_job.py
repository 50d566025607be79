"""SpeechJob's hand-over between the worker and the reader: the end of a job that ran ahead of its reader."""

from __future__ import annotations

import itertools
import threading
from typing import Any, cast

from service.speech.job import SpeechJob


def test_the_end_of_a_job_that_filled_its_queue_is_not_lost() -> None:
    """A WebSocket sentence synthesized one ahead fills its output queue before its reader starts (pieces and caption
    marks); its end mark used to be dropped then (the job taken for abandoned), so the reader waited forever."""
    job = SpeechJob(prepared=cast(Any, None))
    capacity = job._out.maxsize
    for _ in range(capacity):
        job.emit(b"audio")
    closer = threading.Thread(target=job.close)
    closer.start()  # the queue is full: the end waits for the reader
    pieces = job.events()
    assert list(itertools.islice(pieces, capacity)) == [b"audio"] * capacity
    closer.join()
    assert not job.cancel_event.is_set()
    assert list(pieces) == []  # the end came: iteration stops


def test_a_cancelled_job_with_a_full_queue_ends_without_a_reader() -> None:
    job = SpeechJob(prepared=cast(Any, None))
    for _ in range(job._out.maxsize):
        job.emit(b"audio")
    job.cancel()
    job.close()  # returns: nobody will read
    assert job.cancel_event.is_set()
