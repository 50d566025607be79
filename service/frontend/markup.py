"""Markdown and SSML-ish tags removed before normalization (enhanced frontend); block ends become full stops.

What happens to each construct:
- headings (`# Title`, setext underlines), list items (`-`, `*`, `+`, `1.`, `1)`, task boxes), table rows and
  `</p>` `</s>` `<br>`: their text is kept and ends with a full stop (unless it already ends a sentence), and so
  does the text just before them, so a heading never runs into the next line;
- emphasis (`**b**`, `*i*`, `__b__`, `_i_`, `~~s~~`): markers dropped, text kept; `_` and `*` inside a word
  (snake_case, 2*3) are not markup;
- links `[text](url)` and `[text][ref]` read the text, images `![alt](src)` the alt text, reference
  definitions are dropped; autolinks `<https://…>` keep the address (read like any URL), minus the brackets;
- inline code keeps its text without backticks; fenced code blocks (``` or ~~~) are dropped whole (an unclosed
  fence drops the rest of the text), as are horizontal rules and table separator rows;
- block quote markers `>` are dropped; other SSML tags (`<speak>`, `<prosody …>`, `<emphasis>` …) are dropped,
  their text kept. Pause markers (see pauses.py) are replaced before this runs and are never dropped.
"""

from __future__ import annotations

import regex

from service.frontend.pauses import PAUSE_MARK

BLOCK_END = "\ue000"  # private use: clean_input removes such characters, so input never holds one
CELL_SEP = "\ue001"
_SENTENCE_ENDS = frozenset("。！？；：.!?;:…")

_SSML_TAG = regex.compile(
    r"</?+(?P<tag>speak|p|s|br|paragraph|sentence|emphasis|prosody|voice|say-as|sub|lang|mark|phoneme|audio|break|w)\b"
    r"[^<>]{0,500}+>",
    regex.IGNORECASE,
)
_BLOCK_TAGS = frozenset({"p", "s", "br", "paragraph", "sentence"})
_AUTOLINK = regex.compile(r"<(?P<addr>(?i:https?|ftp)://[^<>\s]{1,2000}+|[^<>\s@]{1,64}+@[^<>\s@]{1,255}+)>")
_FENCE = regex.compile(r"^ {0,3}+(?P<fence>`{3,}+|~{3,}+)")
_RULE_LINE = regex.compile(r" {0,3}+(?:(?:-[ \t]*+){3,}+|(?:\*[ \t]*+){3,}+|(?:_[ \t]*+){3,}+|=++[ \t]*+)")
_HEADING = regex.compile(r"^ {0,3}+#{1,6}+(?=[ \t]|$)")
_QUOTES = regex.compile(r"^(?: {0,3}+>[ \t]?+)++")  # all nested markers at once
_LIST_ITEM = regex.compile(r"^[ \t]*+(?:[-*+]|\d{1,9}+[.)])[ \t]++(?:\[[ xX]\][ \t]++)?+")
_TABLE_SEPARATOR = regex.compile(r"[ \t]*+\|?+[ \t]*+:?+-++:?+[ \t]*+(?:\|[ \t]*+:?+-++:?+[ \t]*+)++\|?+[ \t]*+")
_REF_DEFINITION = regex.compile(r"^ {0,3}+\[[^\[\]\n]{1,200}+\]:[ \t]*+\S")
_LINK = regex.compile(
    rf"!?+\[(?P<text>[^\[\]\n]{{0,1000}}+)\]\((?P<url>[^()\s{PAUSE_MARK}]{{0,2000}}+)(?:[ \t]++\"[^\"\n]{{0,500}}+\")?+[ \t]*+\)"
)
_REF_LINK = regex.compile(r"\[(?P<text>[^\[\]\n]{1,1000}+)\]\[[^\[\]\n]{0,100}+\]")
# Spans whose characters are not markup: inline code (group `code`) and bare web addresses.
_VERBATIM = regex.compile(r"`{1,2}+(?P<code>[^`\n]{1,1000}+)`{1,2}+|(?i:https?://|ftp://|www\.)[^\s<>`]{1,2000}+")
_STARS = regex.compile(r"(?<![A-Za-z0-9*\\])(?P<m>\*{1,3}+)(?=[^\s*])(?P<text>[^*\n]{1,1000}+)(?<=[^\s*])(?P=m)(?!\*)")
_UNDERSCORES = regex.compile(
    r"(?<![A-Za-z0-9_\\])(?P<m>_{1,3}+)(?=[^\s_])(?P<text>[^_\n]{1,1000}+)(?<=[^\s_])(?P=m)(?![A-Za-z0-9_])"
)
_STRIKE = regex.compile(r"~~(?=\S)(?P<text>[^~\n]{1,1000}+)(?<=\S)~~")
_STAR_RUN = regex.compile(r"\*{2,}+")


def strip_markdown(text: str) -> str:
    """`text` with the markup above removed; BLOCK_END and CELL_SEP mark where finish_blocks puts punctuation."""
    text = _SSML_TAG.sub(lambda m: BLOCK_END if m.group("tag").lower() in _BLOCK_TAGS else "", text)
    text = _AUTOLINK.sub(r"\g<addr>", text)
    out: list[str] = []
    fence = ""
    for line in text.split("\n"):
        if fence:
            fence = "" if _closes(line, fence) else fence
            _keep_pauses(out, line)
            continue
        opening = _FENCE.match(line)
        if opening is not None:
            fence = opening.group("fence")
            _end_previous(out)
            _keep_pauses(out, line)
            continue
        _block_line(out, line)
    return "\n".join(out)


def finish_blocks(text: str, full_stop: str, comma: str) -> str:
    """Put `full_stop` after the last visible character before each BLOCK_END (unless it ends a sentence
    already) and `comma` for each CELL_SEP; the marks themselves go."""
    out: list[str] = []
    last = -1  # index in `out` of the last non-blank character
    for ch in text:
        if ch == BLOCK_END:
            if last >= 0 and out[last][-1] not in _SENTENCE_ENDS:
                out[last] += full_stop
            continue
        out.append(comma if ch == CELL_SEP else ch)
        if not out[-1].isspace():
            last = len(out) - 1
    return "".join(out)


def _closes(line: str, fence: str) -> bool:
    bare = line.strip()
    return len(bare) >= len(fence) and bare == fence[0] * len(bare)


def _keep_pauses(out: list[str], dropped: str) -> None:
    """A dropped line still keeps its pause markers, so every marker keeps its place in order."""
    marks = PAUSE_MARK * dropped.count(PAUSE_MARK)
    if marks:
        out.append(marks)


def _end_previous(out: list[str]) -> None:
    if out:
        out[-1] += BLOCK_END


def _block_line(out: list[str], line: str) -> None:
    """One line outside a code fence: classify it, append what is read of it to `out`."""
    if _RULE_LINE.fullmatch(line) or _TABLE_SEPARATOR.fullmatch(line) or _REF_DEFINITION.match(line):
        _end_previous(out)
        _keep_pauses(out, line)
        return
    quotes = _QUOTES.match(line)
    if quotes is not None:
        line = line[quotes.end() :]
    heading = _HEADING.match(line)
    item = _LIST_ITEM.match(line)
    if heading is not None:
        body = _heading_text(line[heading.end() :])
    elif item is not None:
        body = line[item.end() :]
    elif line.lstrip().startswith("|"):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        body = CELL_SEP.join(_inline(c) for c in cells if c)
        _end_previous(out)
        out.append(body + BLOCK_END)
        return
    else:
        out.append(_inline(line))
        return
    _end_previous(out)
    out.append(_inline(body) + BLOCK_END)


def _heading_text(rest: str) -> str:
    """Heading text without its optional closing `#` run (which must follow a blank)."""
    body = rest.strip()
    bare = body.rstrip("#")
    if bare != body and (not bare or bare[-1] in " \t"):
        body = bare.rstrip()
    return body


def _inline(line: str) -> str:
    """Links and images to their text; emphasis outside code spans and web addresses; backticks dropped."""
    line = _REF_LINK.sub(r"\g<text>", _LINK.sub(r"\g<text>", line))
    out: list[str] = []
    start = 0
    for m in _VERBATIM.finditer(line):
        out.append(_emphasis(line[start : m.start()]))
        out.append(m.group("code") if m.group("code") is not None else m.group())
        start = m.end()
    out.append(_emphasis(line[start:]))
    return "".join(out).replace("`", "")


def _emphasis(text: str) -> str:
    for _ in range(2):  # two rounds undo one level of nesting: **a *b* c**
        text = _STARS.sub(r"\g<text>", text)
        text = _UNDERSCORES.sub(r"\g<text>", text)
        text = _STRIKE.sub(r"\g<text>", text)
    return str(_STAR_RUN.sub("", text))
