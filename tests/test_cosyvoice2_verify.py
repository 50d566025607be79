"""`service verify` on the official-layout tiny CosyVoice2 model: every fixture the official code computed, within 1e-4."""

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
FIXTURES = REPO / "tests" / "reference" / "tiny-cosyvoice2"
STAGE_FILES = ("tokenizer_cases.json", "prompts.npz", "zero_shot.npz", "cross_lingual.npz", "instruct2.npz")
STAGE_FILES += ("hift.npz", "stream.npz")


def test_every_fixture_stage_is_within_tolerance(cv2_ref_bundle: Path) -> None:
    report = run_verification(ModelBundle.load(cv2_ref_bundle), FIXTURES, RuntimeOptions(intra_op_threads=2, max_batch=0))
    assert report.skipped == []
    failed = [(c.stage, c.name, c.error) for c in report.checks if not c.ok]
    assert failed == []
    stages = {c.stage.split()[0] for c in report.checks}
    assert {"tokenizer", "prompt", "zero_shot", "cross_lingual", "instruct2", "hift", "stream"} <= stages
    model = [c for c in report.checks if c.stage.split()[0] in ("zero_shot", "cross_lingual", "instruct2", "hift", "stream")]
    assert all(c.tolerance <= 1e-4 for c in model)
    streams = {c.stage for c in report.checks if c.stage.startswith("stream")}
    assert streams == {"stream zs", "stream cl", "stream i2"}
    assert any(c.name == "final chunk, chunk masks (cached)" for c in report.checks)


def test_verify_command_reports_a_cosyvoice2_bundle(cv2_ref_bundle: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "service", "verify", "--bundle", str(cv2_ref_bundle), "--fixtures", str(FIXTURES)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    done, total = last.split()[0].split("/")
    assert done == total and int(total) > 100


@pytest.mark.parametrize("name", STAGE_FILES)
def test_fixture_files_are_present(name: str) -> None:
    assert (FIXTURES / name).is_file(), f"{name}: the official CosyVoice2 fixtures (scripts/cosyvoice2_fixtures.py)"
