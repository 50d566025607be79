"""Text frontend routes: the shared pronunciation lexicon (/v1/lexicon) and what will be spoken (/v1/normalize)."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query

from service.api.deps import ADMIN, AUTHENTICATED, JSON_BODY, FrontendDep, LexiconDep, StateDep
from service.api.schemas import (
    OPENAI_MAX_INPUT_CHARS,
    LexiconDeleted,
    LexiconEntry,
    LexiconList,
    LexiconPut,
    LexiconWord,
    NormalizeBody,
    NormalizeResult,
)
from service.api.textfields import TextRoute
from service.errors import InvalidInputError, NotFoundError, TTSError
from service.frontend import TextFrontend
from service.frontend.lexicon import MAX_WORD_CHARS
from service.speech.request import check_text

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["text"], route_class=TextRoute)

# Handlers are plain `def`: FastAPI runs them in its thread pool, so Redis round trips and normalization
# never block the event loop.
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"description": description, "content": {"application/json": {}}}
    for status, description in {
        400: "Invalid word, pinyin or text",
        401: "Missing or wrong API key",
        403: "A valid key that is not an admin key (writes)",
        404: "No such entry",
        413: "Text too long",
        415: "The body is not JSON: send `Content-Type: application/json`",
        503: "Not ready, or the shared lexicon store (Redis) is down for writes (Retry-After)",
    }.items()
}
Word = Annotated[str, Path(min_length=1, max_length=MAX_WORD_CHARS, description="Chinese word, e.g. 重庆.")]


@router.get("/lexicon", dependencies=AUTHENTICATED, response_model=LexiconList, responses=_ERRORS, summary="All entries")
def list_entries(lexicon: LexiconDep) -> LexiconList:
    """Built-in defaults overlaid with operator entries, and the version they have together."""
    snap = lexicon.snapshot()
    defaults = lexicon.defaults
    data = [LexiconEntry(word=w, pinyin=p, source=_source(w, p, defaults)) for w, p in sorted(snap.entries.items())]
    return LexiconList(version=snap.version, data=data)


@router.get("/lexicon/{word}", dependencies=AUTHENTICATED, response_model=LexiconWord, responses=_ERRORS, summary="One entry")
def get_entry(word: Word, lexicon: LexiconDep) -> LexiconWord:
    word, snap = word.strip(), lexicon.snapshot()
    pinyin = snap.entries.get(word)
    if pinyin is None:
        raise NotFoundError(f"no lexicon entry for {word!r}", param="word")
    return LexiconWord(word=word, pinyin=pinyin, source=_source(word, pinyin, lexicon.defaults), version=snap.version)


@router.put(
    "/lexicon/{word}",
    dependencies=[*ADMIN, *JSON_BODY],
    response_model=LexiconWord,
    responses=_ERRORS,
    summary="Add or replace an entry",
)
def put_entry(word: Word, body: LexiconPut, lexicon: LexiconDep) -> LexiconWord:
    """Validated (one known syllable with tone 1-5 per character); every replica uses it from its next request,
    and audio cached before the change is not served for it (the version is part of the cache key)."""
    word, pinyin = lexicon.put(word, body.pinyin)
    log.info("lexicon: %s -> %s", word, pinyin)
    return LexiconWord(word=word, pinyin=pinyin, source="custom", version=lexicon.version())


@router.delete("/lexicon/{word}", dependencies=ADMIN, response_model=LexiconDeleted, responses=_ERRORS, summary="Remove an entry")
def delete_entry(word: Word, lexicon: LexiconDep) -> LexiconDeleted:
    """Removes an operator entry; a built-in default for the same word applies again (defaults cannot be deleted)."""
    if not lexicon.delete(word):
        hint = " (built-in defaults can be overridden with PUT, not deleted)" if word.strip() in lexicon.defaults else ""
        raise NotFoundError(f"no custom lexicon entry for {word!r}{hint}", param="word")
    log.info("lexicon: %s removed", word.strip())
    return LexiconDeleted(word=word.strip(), version=lexicon.version())


@router.get(
    "/normalize", dependencies=AUTHENTICATED, response_model=NormalizeResult, responses=_ERRORS, summary="What will be spoken"
)
def normalize_get(
    frontend: FrontendDep, state: StateDep, text: Annotated[str, Query(min_length=1, description="Text to normalize.")]
) -> NormalizeResult:
    """Normalized sentences, lexicon rewrites, rules fired and token ids; POST the same for long text."""
    return _normalize(frontend, text, min(OPENAI_MAX_INPUT_CHARS, state.settings.max_chars))


@router.post(
    "/normalize",
    dependencies=[*AUTHENTICATED, *JSON_BODY],
    response_model=NormalizeResult,
    responses=_ERRORS,
    summary="What will be spoken",
)
def normalize_post(frontend: FrontendDep, state: StateDep, body: NormalizeBody) -> NormalizeResult:
    return _normalize(frontend, body.text, min(OPENAI_MAX_INPUT_CHARS, state.settings.max_chars))


def _normalize(frontend: TextFrontend, text: str, max_chars: int) -> NormalizeResult:
    """The frontend's report for `text`, checked like synthesis input (length, control characters)."""
    check_text(text, max_chars, "text")
    try:
        report = frontend.normalize_report(text)
    except TTSError:
        raise
    except Exception as e:  # same contract as synthesis: odd input is the caller's 400, not a 500
        log.warning("text frontend failed on %d characters: %s: %s", len(text), type(e).__name__, e)
        raise InvalidInputError("the text could not be normalized", param="text") from e
    return NormalizeResult.model_validate(report.as_dict())


def _source(word: str, pinyin: str, defaults: dict[str, str]) -> Literal["default", "custom"]:
    return "default" if defaults.get(word) == pinyin else "custom"
