"""Two tiers of settings: operator settings are TTS_* variables; the engine's levers are one setting,
TTS_ENGINE_PROFILE, with the same defaults, and an unknown lever is refused at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from settings_table import PAGES, with_table

from service.engine.options import EngineLevers, RuntimeOptions, SessionOptions
from service.levers import LEVERS, EngineProfile
from service.runtime import runtime_options
from service.settings import Settings, moved_levers, unknown_env_vars

REPO = Path(__file__).resolve().parents[1]


def settings(**env: str) -> Settings:
    return Settings(_env_file=None, **env)  # type: ignore[call-arg]


def test_the_profile_is_pairs_or_a_toml_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_ENGINE_PROFILE", "first_hop_tokens=10, STREAM_SCHEDULE=official,prompt_window_s=all")
    profile = settings().engine_profile
    assert (profile.first_hop_tokens, profile.stream_schedule, profile.prompt_window_s) == (10, "official", None)
    path = tmp_path / "engine.toml"
    path.write_text('max_batch = 4\nacoustic_backend = "ort"\n', encoding="utf-8")
    monkeypatch.setenv("TTS_ENGINE_PROFILE", f"@{path}")
    assert (settings().engine_profile.max_batch, settings().engine_profile.acoustic_backend) == (4, "ort")


@pytest.mark.parametrize("value", ["bogus=1", "first_hop_tokens", "max_batch=-1", "first_hop_tokens=1,first_hop_tokens=2"])
def test_a_bad_profile_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_ENGINE_PROFILE", value)
    with pytest.raises(ValidationError):
        settings()


def test_defaults_are_unchanged_and_levers_reach_the_engine() -> None:
    assert settings().engine_profile == EngineProfile()
    opts = runtime_options(settings(engine_profile="max_batch=3,acoustic_nice=5,ort_spinning=true,llm_threads=1"))
    assert (opts.max_batch, opts.acoustic_nice, opts.allow_spinning, opts.threads_for("llm")) == (3, 5, True, 1)
    assert isinstance(opts, SessionOptions) and isinstance(opts, EngineLevers) and isinstance(opts, RuntimeOptions)


def test_code_may_name_levers_directly() -> None:
    assert (
        settings(max_batch=0, first_hop_tokens=7).engine_profile.model_dump()
        == EngineProfile(max_batch=0, first_hop_tokens=7).model_dump()
    )


def test_a_lever_set_as_its_own_variable_is_named_with_where_it_goes() -> None:
    environ = {"TTS_FIRST_HOP_TOKENS": "10", "TTS_MAX_CHARS": "10", "TTS_TYPO": "1"}
    assert moved_levers(environ) == ["TTS_FIRST_HOP_TOKENS is an engine lever: set TTS_ENGINE_PROFILE=first_hop_tokens=10"]
    assert unknown_env_vars(environ) == ["TTS_TYPO"]


def test_the_operator_table_has_no_lever_and_the_profile_page_has_every_one() -> None:
    assert not set(LEVERS) & set(Settings.model_fields)
    for page, model in PAGES.items():
        text = (REPO / page).read_text(encoding="utf-8")
        assert with_table(text, model) == text, f"run: python scripts/settings_table.py --write {page}"
