"""loadtest/timeline.py: one streamed request's calls, chunks, first audio and TTCA, in a process of its own (it wraps
the session opener)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_timeline(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "loadtest" / "timeline.py"), *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_a_saved_voice_stream_is_timed_call_by_call(tmp_path: Path) -> None:
    out = tmp_path / "timeline.json"
    done = run_timeline(tmp_path, str(ROOT / "models" / "tiny"), "--tokens", "120", "--voice", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr
    t = json.loads(out.read_text())
    assert t["family"] == "cosyvoice1" and t["tokens"] == 120 and t["voice"] == "2"
    chunks = t["chunks"]
    assert len(chunks) >= 2 and chunks[0]["offset_s"] == 0.0
    for before, after in itertools.pairwise(chunks):  # offsets add up, arrivals in order
        assert abs(after["offset_s"] - before["offset_s"] - before["seconds"]) < 1e-9 and after["at_s"] >= before["at_s"]
    assert abs(sum(c["seconds"] for c in chunks) - t["audio_s"]) < 1e-9
    assert abs(t["audio_s"] - 120 / 50) < 0.05  # 120 tokens at 50 a second
    assert 0 < t["first_audio_s"] <= t["ttca_s"] <= t["wall_s"]
    assert t["ttca_s"] == max(c["at_s"] - c["offset_s"] for c in chunks)
    assert t["decode"]["steps"] >= 120 - 1 and sum(b["steps"] for b in t["decode"]["bins"]) == t["decode"]["steps"]
    graphs = {c["graph"] for c in t["calls"]}
    assert {"llm_encoder", "flow_encoder", "hift_f0"} <= graphs and any(g.startswith("flow_estimator") for g in graphs)
    assert "first audio" in done.stdout and "chunk at" in done.stdout


def test_a_saved_voice_needs_a_built_in_speaker(tmp_path: Path) -> None:
    done = run_timeline(tmp_path, str(ROOT / "models" / "tiny-cosyvoice2"), "--voice", "3")
    assert done.returncode == 2 and "no built-in speakers" in done.stderr
