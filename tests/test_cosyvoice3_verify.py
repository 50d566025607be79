"""`service verify` on the official-layout tiny Fun-CosyVoice3 model: every fixture the official code computed, within
1e-4: LLM, flow and HiFT per mode, HiFT alone, and every chunk of the official stream both recomputed (the official
switch) and from the caches (the default stream: non-final chunks as the official's, the last with chunk masks)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.registry import run_verification

pytestmark = pytest.mark.export
REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "reference" / "tiny-cosyvoice3"


def test_every_fixture_stage_is_within_tolerance(cv3_ref_bundle: Path) -> None:
    report = run_verification(ModelBundle.load(cv3_ref_bundle), FIXTURES, RuntimeOptions(intra_op_threads=2, max_batch=0))
    assert report.skipped == []
    failed = [(c.stage, c.name, c.error) for c in report.checks if not c.ok]
    assert failed == []
    stages = {c.stage.split()[0] for c in report.checks}
    assert {"tokenizer", "prompt", "zero_shot", "cross_lingual", "instruct2", "hift", "stream"} <= stages
    model = [c for c in report.checks if c.stage.split()[0] in ("zero_shot", "cross_lingual", "instruct2", "hift", "stream")]
    assert all(c.tolerance <= 1e-4 for c in model)
    streams = {c.stage for c in report.checks if c.stage.startswith("stream")}
    assert streams == {f"stream {run} {way}" for run in ("zs", "cl", "i2") for way in ("official", "cached")}
    names = {c.name for c in report.checks}
    assert {"final chunk, chunk masks", "chunk1 audio (HiFT over the history)", "chunk1 audio (windowed HiFT)"} <= names
    assert "silent-token filter" in names and "flow estimator step 1" in names


def test_verify_command_reports_a_cosyvoice3_bundle(cv3_ref_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service", "verify", "--bundle", str(cv3_ref_bundle), "--fixtures", str(FIXTURES)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    done, total = proc.stdout.strip().splitlines()[-1].split()[0].split("/")
    assert done == total and int(total) > 150
