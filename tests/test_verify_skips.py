"""`service verify` on a fixture folder without the prompt models (CosyVoice2, Fun-CosyVoice3): the prompt stage is
reported as skipped, not dropped, so a partial folder cannot pass as a complete run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.registry import run_verification

REPO = Path(__file__).resolve().parents[1]
CASES = {
    "cosyvoice2": (REPO / "models" / "tiny-cosyvoice2", REPO / "tests" / "reference" / "tiny-cosyvoice2", "v2"),
    "cosyvoice3": (REPO / "models" / "tiny-cosyvoice3", REPO / "tests" / "reference" / "tiny-cosyvoice3", "v3"),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_prompt_stage_without_prompt_models_is_reported_skipped(family: str, tmp_path: Path) -> None:
    bundle, reference, version = CASES[family]
    shutil.copy(reference / "prompts.npz", tmp_path / "prompts.npz")  # the recorded analysis, not the models it needs
    report = run_verification(ModelBundle.load(bundle), tmp_path, RuntimeOptions(intra_op_threads=1, max_batch=0))
    assert report.checks == []
    assert f"prompts.npz: missing campplus.onnx, speech_tokenizer_{version}.onnx" in report.skipped
    assert "zero_shot.npz: not present" in report.skipped
