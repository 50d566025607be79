"""Replay every v1 reference fixture present (model stages, prompt analysis, cloning modes) through a bundle."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from service.bundle import ModelBundle
from service.engine.options import RuntimeOptions
from service.families.cosyvoice1.verify.modes import has_mode_fixtures, verify_modes
from service.families.cosyvoice1.verify.prompts import PROMPT_MODELS, PROMPTS_FILE, verify_prompts
from service.families.cosyvoice1.verify.stages import (
    Engines,
    verify_flow,
    verify_hift,
    verify_llm,
    verify_stream,
    verify_tokenizer,
)
from service.verify.checks import Check, VerifyReport

FIXTURE_FILES = ("tokenizer.json", "llm.npz", "flow.npz", "hift.npz", "stream.npz")

_STAGES: dict[str, Callable[[Engines, Any], Iterator[Check]]] = {
    "llm.npz": verify_llm,
    "flow.npz": verify_flow,
    "hift.npz": verify_hift,
    "stream.npz": verify_stream,
}


def run_verification(
    bundle: ModelBundle,
    fixtures: Path,
    runtime: RuntimeOptions | None = None,
    on_check: Callable[[Check], None] | None = None,
) -> VerifyReport:
    """Replay every fixture file present in `fixtures` (layout of tests/reference/tiny).

    Missing files are listed in `report.skipped`; `on_check` sees each result as soon as it exists.
    """
    engines = Engines.open(bundle, runtime)
    report = VerifyReport()

    def emit(checks: Iterator[Check]) -> None:
        for check in checks:
            report.checks.append(check)
            if on_check is not None:
                on_check(check)

    for name in FIXTURE_FILES:
        path = Path(fixtures) / name
        if not path.is_file():
            report.skipped.append(f"{name}: not present")
        elif name == "tokenizer.json":
            emit(verify_tokenizer(engines, path))
        else:
            with np.load(path) as npz:
                emit(_STAGES[name](engines, npz))
    _verify_voice_cloning(engines, Path(fixtures), runtime, report, emit)
    return report


def _verify_voice_cloning(
    engines: Engines,
    fixtures: Path,
    runtime: RuntimeOptions | None,
    report: VerifyReport,
    emit: Callable[[Iterator[Check]], None],
) -> None:
    """Prompt analysis (prompts.npz) and the zero-shot / cross-lingual / instruct model paths, when present."""
    missing = [f for f in (PROMPTS_FILE, *PROMPT_MODELS) if not (fixtures / f).is_file()]
    if missing:
        report.skipped.append(f"{PROMPTS_FILE}: not present" if PROMPTS_FILE in missing else f"{PROMPTS_FILE}: missing {missing}")
    else:
        emit(verify_prompts(fixtures, runtime))
    if has_mode_fixtures(fixtures):
        emit(verify_modes(engines, fixtures))
    else:
        report.skipped.append("zero_shot/cross_lingual/instruct: modes_meta.json or prompts.npz not present")
