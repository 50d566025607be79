"""Request text must be real text: form fields, JSON bodies and query strings are decoded strictly (UTF-8 unless a
form declares its charset), so a transcript in GBK is a 400 naming the field, never mojibake saved as a voice."""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Coroutine
from contextlib import aclosing
from typing import Any
from urllib.parse import unquote_to_bytes

from fastapi.routing import APIRoute
from python_multipart.multipart import parse_options_header
from starlette.datastructures import FormData, QueryParams, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response

from service.api.errors import RequestFieldError
from service.errors import InvalidInputError
from service.speech.request import decode_text

_JSON_KEY = re.compile(rb'"([^"\\\n]{1,64})"\s*:')  # a JSON object key (the last one before a bad byte names it)
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \uD800-\uDFFF: JSON's only way to a lone surrogate
_SURROGATE = re.compile("[\ud800-\udfff]")


def parse_urlencoded(body: bytes, what: str = "form field", *, max_fields: int | float = 1000) -> list[tuple[str, str]]:
    """(name, value) pairs of a form body or a query string: `+` and %XX undone, then strict UTF-8. Raw non-ASCII
    bytes (curl -d 'text=你好' sends UTF-8 unescaped) count as their bytes, not as Latin-1 characters."""
    pairs: list[tuple[str, str]] = []
    for item in body.split(b"&"):
        if not item:
            continue
        if len(pairs) >= max_fields:
            raise InvalidInputError(f"too many {what}s; the limit is {int(max_fields)}")
        raw_name, _, raw_value = item.partition(b"=")
        name = decode_text(_unquote(raw_name), f"a {what} name", None)
        pairs.append((name, decode_text(_unquote(raw_value), f"{what} {name!r}", name)))
    return pairs


def _unquote(raw: bytes) -> bytes:
    return unquote_to_bytes(raw.replace(b"+", b" "))


class _FieldError(MultiPartException):
    """A text part that does not decode: carries the typed error through Starlette's multipart parser."""

    def __init__(self, error: InvalidInputError) -> None:
        super().__init__(error.message)
        self.error = error


class _StrictMultiPartParser(MultiPartParser):
    """Starlette's multipart parser with strict text parts (its own falls back to Latin-1 when they do not decode)."""

    def on_part_end(self) -> None:
        part = self._current_part
        if part.file is not None:
            super().on_part_end()
            return
        try:
            text = decode_text(bytes(part.data), f"form field {part.field_name!r}", part.field_name, self._charset or "utf-8")
        except InvalidInputError as e:
            raise _FieldError(e) from e
        self.items.append((part.field_name, text))


class TextRequest(Request):
    """A Request whose form fields, JSON body and query string are decoded strictly (RequestFieldError: 400)."""

    @property
    def query_params(self) -> QueryParams:
        if not hasattr(self, "_query_params"):
            try:
                pairs = parse_urlencoded(self.scope["query_string"], "query parameter")
            except InvalidInputError as e:
                raise RequestFieldError(e) from e
            self._query_params = QueryParams(pairs)
        return self._query_params

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                body.decode("utf-8")  # JSON is UTF-8 (RFC 8259); json.loads would guess UTF-16/32 or fail vaguely
            except UnicodeDecodeError as e:
                raise RequestFieldError(json_encoding_error(body, e.start)) from e
            document = await super().json()
            found = lone_surrogate(document) if _SURROGATE_ESCAPE.search(body) else None
            if found is not None:  # json.loads keeps a lone one: no encoder, file name or key takes it
                raise RequestFieldError(found)
        return await super().json()

    async def _get_form(
        self, *, max_files: int | float = 1000, max_fields: int | float = 1000, max_part_size: int = 1024 * 1024
    ) -> FormData:
        if self._form is not None:
            return self._form
        media = self.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if media == "application/x-www-form-urlencoded":
            try:
                fields: list[tuple[str, str | UploadFile]] = list(parse_urlencoded(await self.body(), max_fields=max_fields))
            except InvalidInputError as e:
                raise RequestFieldError(e) from e
            self._form = FormData(fields)
        elif media == "multipart/form-data":
            self._form = await self._multipart(max_files=max_files, max_fields=max_fields, max_part_size=max_part_size)
        else:
            self._form = FormData()
        return self._form

    async def _multipart(self, **limits: Any) -> FormData:
        _check_charset(self.headers.get("content-type", ""))
        try:
            async with aclosing(self.stream()) as stream:
                return await _StrictMultiPartParser(self.headers, stream, **limits).parse()
        except _FieldError as e:
            raise RequestFieldError(e.error) from e
        except MultiPartException as e:
            raise HTTPException(status_code=400, detail=f"the multipart/form-data body is malformed: {e.message}") from e


def _check_charset(content_type: str) -> None:
    """A multipart body may declare its charset (Content-Type: ...; charset=gbk); one Python does not know is a 400
    (Starlette would read it as Latin-1)."""
    charset = parse_options_header(content_type)[1].get(b"charset")
    if charset is None:
        return
    try:
        codecs.lookup(charset.decode("latin-1"))
    except LookupError as e:
        shown = charset[:40].decode("latin-1")
        raise RequestFieldError(InvalidInputError(f"the Content-Type names an unknown charset {shown!r}; send UTF-8")) from e


def lone_surrogate(document: Any) -> InvalidInputError | None:
    """The error for a parsed JSON document with a field (`voice.id`, `texts[2]`) whose value or name holds half of a
    UTF-16 pair (`"\\ud800"` with no partner: text that cannot be UTF-8), or None. Every HTTP JSON route and the
    DashScope socket refuse such a document; the message never quotes the text (it could not be encoded either)."""
    stack: list[tuple[str, Any]] = [("", document)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str) and (found := _SURROGATE.search(value)):
            return _lone_surrogate_error(where or "the request body", found)
        if isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, dict):
            for key, item in value.items():
                if found := _SURROGATE.search(key):
                    return _lone_surrogate_error(f"a field name in {where or 'the request body'}", found)
                stack.append((f"{where}.{key}" if where else key, item))
    return None


def _lone_surrogate_error(field: str, found: re.Match[str]) -> InvalidInputError:
    code = f"\\u{ord(found.group()):04x}"
    param = field.split(".", 1)[0].split("[", 1)[0] if not field.startswith(("a field name", "the request body")) else None
    return InvalidInputError(
        f"{field} holds a lone surrogate ({code} at position {found.start()}): a \\uD800-\\uDFFF escape is half of a "
        "character and must be followed by its other half; send the text as UTF-8",
        param=param,
    )


def json_encoding_error(body: bytes, offset: int) -> InvalidInputError:
    """Where the first bad byte is, and the field it is in (the last object key before it, when there is one)."""
    keys = list(_JSON_KEY.finditer(body, max(0, offset - 4096), offset))
    field = keys[-1].group(1).decode("utf-8", "replace") if keys else None
    where = f" in the value of {field!r}" if field else ""
    return InvalidInputError(
        f"the JSON body is not valid UTF-8 (byte 0x{body[offset]:02X} at offset {offset}{where}); encode text as UTF-8",
        param=field,
    )


class TextRoute(APIRoute):
    """The route class of every router: its handler sees a TextRequest."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_text_handler(request: Request) -> Response:
            return await handler(TextRequest(request.scope, request.receive))

        return strict_text_handler
