"""Settings: TTS_* environment parsing, bounds, secrets, and the report of unknown TTS_* variables."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from service.settings import Settings, unknown_env_vars


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("TTS_")]:
        monkeypatch.delenv(name)


def make(**kwargs: object) -> Settings:
    return Settings(_env_file=None, **kwargs)  # type: ignore[call-arg]


def test_defaults_serve_the_tiny_bundle_on_loopback() -> None:
    s = make()
    assert (s.host, s.port, s.model_dir) == ("127.0.0.1", 8000, Path("models/tiny"))
    assert s.api_keys == [] and s.redis_url is None and s.rate_limit_per_minute > 0


def test_environment_variables_use_the_tts_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_PORT", "9123")
    monkeypatch.setenv("TTS_MODEL_DIR", "/models/full")
    monkeypatch.setenv("TTS_CONCURRENT_REQUESTS", "2")
    monkeypatch.setenv("TTS_OPENAI_PCM_SAMPLE_RATE_HZ", "22050")
    s = make()
    assert (s.port, s.model_dir, s.concurrent_requests, s.openai_pcm_sample_rate_hz) == (9123, Path("/models/full"), 2, 22050)


def test_old_workers_variable_is_still_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_WORKERS", "3")
    assert make().concurrent_requests == 3
    assert unknown_env_vars({"TTS_WORKERS": "3"}) == []


def test_defaults_batch_concurrent_requests() -> None:
    """The shipped defaults synthesize several requests at once with the batching scheduler on."""
    s = Settings(_env_file=None)  # type: ignore[call-arg]
    assert s.concurrent_requests >= 4 and s.engine_profile.max_batch >= s.concurrent_requests
    assert s.engine_profile.acoustic_slots >= 1 and s.engine_profile.first_audio_priority


def test_lists_are_comma_separated_and_keys_are_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_API_KEYS", "first-key-123, second-key-456")
    monkeypatch.setenv("TTS_TRUSTED_PROXIES", "10.0.0.0/8,127.0.0.1")
    monkeypatch.setenv("TTS_REDIS_URL", "redis://:hunter2hunter2@localhost:6379/0")
    s = make()
    assert [k.get_secret_value() for k in s.api_keys] == ["first-key-123", "second-key-456"]
    assert s.trusted_proxies == ["10.0.0.0/8", "127.0.0.1"]
    assert "hunter2" not in repr(s) and "first-key-123" not in repr(s) and "first-key-123" not in str(s.model_dump())


def test_empty_redis_url_means_no_redis(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TTS_REDIS_URL", "")
    assert make().redis_url is None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("port", 0),
        ("port", 70000),
        ("concurrent_requests", 0),
        ("concurrent_requests", 1000),
        ("queue_max", -1),
        ("max_chars", 0),
        ("max_chars", 1_000_000),
        ("max_body_bytes", 10),
        ("rate_limit_per_minute", -5),
        ("openai_pcm_sample_rate_hz", 44100),
        ("log_level", "verbose"),
        ("api_keys", "short"),
        ("trusted_proxies", "not-an-ip"),
    ],
)
def test_out_of_bounds_values_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as info:
        make(**{field: value})
    assert field in str(info.value)


def test_settings_are_immutable() -> None:
    s = make()
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]


def test_unknown_tts_variables_are_reported() -> None:
    env = {"TTS_PORT": "1", "TTS_PROT": "2", "TTS_API_KEY": "x", "PATH": "/bin", "tts_workers": "1"}
    assert unknown_env_vars(env) == ["TTS_API_KEY", "TTS_PROT"]


def test_every_field_is_documented_with_bounds_where_numeric() -> None:
    for name, info in Settings.model_fields.items():
        assert info.description, f"{name} has no description"
        if info.annotation is int and name != "port":
            bounds = {type(m).__name__ for m in info.metadata}
            assert {"Ge", "Le"} <= bounds, f"{name} is unbounded"


def test_settings_table_script_lists_every_setting(repo_root: Path) -> None:
    out = subprocess.run(
        [sys.executable, "scripts/settings_table.py"], cwd=repo_root, capture_output=True, text=True, check=True
    ).stdout
    for name in Settings.model_fields:
        assert f"`TTS_{name.upper()}`" in out
    assert out.splitlines()[0].startswith("| variable |")
