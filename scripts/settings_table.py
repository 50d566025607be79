"""The settings tables (markdown) from the models: the operator settings (Settings, docs/settings.md) and the engine
profile's levers (EngineProfile, docs/engine-profile.md): name, type, default, bounds, meaning.

`python scripts/settings_table.py --write` rewrites the table of every page in PAGES; without `--write` it prints the
operator table."""

from __future__ import annotations

import sys
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from service.levers import EngineProfile
from service.settings import ENV_PREFIX, Settings


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (Union, UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + " (optional)"
    if origin is list:
        return f"list of {_type_name(args[0])} (comma-separated)"
    if origin is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])} (`name=value`, comma-separated)"
    return "secret" if annotation is SecretStr else str(getattr(annotation, "__name__", annotation))


def _default(info: FieldInfo) -> str:
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    if value is None or value == [] or value == {}:
        return "(empty)"
    return f"`{value}`"


_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "len >="), ("max_length", "len <="))


def _bounds(info: FieldInfo) -> str:
    parts = []
    for meta in info.metadata:
        for attr, sign in _BOUNDS:
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {value:,}" if isinstance(value, int) else f"{sign} {value}")
    return ", ".join(parts)


def settings_table(model: type[BaseModel] = Settings) -> str:
    """Markdown table of every field of `model`: `TTS_*` variables for Settings, lever names for EngineProfile."""
    head = "variable" if model is Settings else "lever"
    rows = [f"| {head} | type | default | bounds | meaning |", "|---|---|---|---|---|"]
    for name, info in model.model_fields.items():
        meaning = (info.description or "").replace("|", "\\|")
        shown = f"{ENV_PREFIX}{name.upper()}" if model is Settings else name
        rows.append(f"| `{shown}` | {_type_name(info.annotation)} | {_default(info)} | {_bounds(info)} | {meaning} |")
    return "\n".join(rows)


START, END = "<!-- settings-table:start -->", "<!-- settings-table:end -->"


def with_table(text: str, model: type[BaseModel] = Settings) -> str:
    """The page's text with the generated table of `model` placed between the settings-table markers."""
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{settings_table(model)}\n{END}{tail}"


PAGES: dict[str, type[BaseModel]] = {"docs/settings.md": Settings, "docs/engine-profile.md": EngineProfile}
REPO = Path(__file__).resolve().parents[1]


def write_pages(named: list[str]) -> None:
    """Rewrite the tables of the named pages, or of every page in PAGES when none (or none of them) is one of PAGES
    (the operator table left README.md for docs/settings.md: `--write README.md` now writes every page)."""
    pages = [page for page in named if page in PAGES] or list(PAGES)
    for page in named:
        if page not in PAGES:
            print(f"{page} has no settings table; writing {', '.join(pages)}", file=sys.stderr)
    for page in pages:
        path = REPO / page
        path.write_text(with_table(path.read_text(encoding="utf-8"), PAGES[page]), encoding="utf-8")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write"]:
        write_pages(sys.argv[2:])
    else:
        print(settings_table())
