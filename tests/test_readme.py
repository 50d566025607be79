"""The README stays true: quick start commands first, settings table generated from the Settings model."""

from __future__ import annotations

import re
from pathlib import Path

from settings_table import with_table  # scripts/ is put on sys.path below

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text(encoding="utf-8")


def test_quick_start_is_make_run_then_make_test() -> None:
    commands = re.findall(r"^(make \w+)", README, flags=re.M)
    assert commands[:2] == ["make run", "make test"]


def test_settings_table_matches_the_settings_model() -> None:
    assert with_table(README) == README, "run: python scripts/settings_table.py --write README.md"


def test_every_setting_is_documented() -> None:
    from service.settings import ENV_PREFIX, Settings

    for name in Settings.model_fields:
        assert f"`{ENV_PREFIX}{name.upper()}`" in README


def test_client_snippets_say_how_to_install_the_client() -> None:
    """A reader can paste each snippet into a fresh shell: a client the server does not ship is installed first."""
    for block in re.findall(r"```bash\n(.*?)```", README, flags=re.S):
        if "from openai import" in block:
            assert "pip install openai" in block.split("from openai import")[0], block
