"""Request ids on every transport: the client's `x-request-id` when it is sane, else a fresh one, held in a context
variable while the request is served so that every log line written for it (HTTP, gRPC, WebSocket, its job thread)
names it."""

from __future__ import annotations

import contextvars
import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")
HEADER = "x-request-id"
MAX_CHARS = 128
# UUIDs, hex, ULIDs, W3C trace ids, `req_...`: what clients send; anything else (blanks, controls, non-ASCII, longer) is
# replaced, never echoed into headers and logs.
_SANE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}")
_CURRENT: ContextVar[str | None] = ContextVar("request_id", default=None)


def request_id(presented: str | None) -> str:
    """The id of a request: `presented` when it is 1-128 characters of letters, digits and `._:/+=@-` starting with a
    letter or digit, else a new random one (32 hex digits)."""
    if presented is not None and _SANE.fullmatch(presented):
        return presented
    return uuid.uuid4().hex


def current() -> str | None:
    """The id of the request being served in this context, if any."""
    return _CURRENT.get()


@contextmanager
def serving(rid: str) -> Iterator[None]:
    """Log lines written inside the block (and in contexts copied from it) carry `rid`. Enter and leave it in one
    task or thread; a generator that other threads may resume or close uses `in_own_context` instead."""
    token = _CURRENT.set(rid)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def in_own_context(rid: str, items: Iterator[T]) -> Iterator[T]:
    """Iterate `items` inside a context of its own where the request id is `rid` (each step and the final close run
    in it, whichever thread drives them), leaving the caller's context untouched."""
    context = contextvars.copy_context()
    context.run(_CURRENT.set, rid)
    try:
        while True:
            try:
                item = context.run(next, items)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            context.run(close)


class RequestIdFilter(logging.Filter):
    """Adds `request_id` ("-" outside a request) and `request_tag` (" [id]", or "" outside one) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        rid = _CURRENT.get()
        record.request_id = rid or "-"
        record.request_tag = f" [{rid}]" if rid else ""
        return True
