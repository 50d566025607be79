"""loadtest/profile_stages.py profiles one streamed request of any family's bundle (the committed tiny bundles here).

It patches how sessions are opened, so it runs in its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


STAGES = ("llm_step", "flow_estimator", "hift_decode")  # graph-name prefixes (a native twin: "<graph>_native")


@pytest.mark.parametrize(
    ("bundle", "family"),
    [("models/tiny", "cosyvoice1"), ("models/tiny-cosyvoice2", "cosyvoice2"), ("models/tiny-cosyvoice3", "cosyvoice3")],
)
def test_profile_names_the_graphs_a_stream_ran(tmp_path: Path, bundle: str, family: str) -> None:
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "loadtest/profile_stages.py", bundle, "--tokens", "30", "--steps", "2", "--json", str(out)]
    subprocess.run(cmd, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=600)
    result = json.loads(out.read_text())
    assert result["family"] == family and result["tokens"] == 30
    assert result["audio_s"] > 0 and 0 < result["first_audio_s"] <= result["wall_s"]
    called = {name: g for name, g in result["graphs"].items() if g.get("calls")}
    for prefix in STAGES:  # each stage this family streams through was profiled and took time
        found = [g for name, g in called.items() if name.startswith(prefix)]
        assert found, f"no profiled calls of a {prefix}* graph in {sorted(called)}"
        assert all(g["ms_per_call"] > 0 and g["share_of_wall"] > 0 for g in found)
