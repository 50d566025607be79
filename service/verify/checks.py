"""What a verification measures: one compared quantity against its bound, a report, and the error measures."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CASE = re.compile(r"^case(\d+)_")  # array names of one recorded case: `case2_logp`
CHUNK = re.compile(r"^chunk(\d+)_")  # array names of one streamed chunk: `chunk0_token`


@dataclass(frozen=True)
class Check:
    """One compared quantity: its largest absolute error against the fixture and the allowed bound."""

    stage: str
    name: str
    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return bool(np.isfinite(self.error)) and self.error <= self.tolerance


@dataclass
class VerifyReport:
    checks: list[Check] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # "<file>: <reason>"

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def max_abs(got: np.ndarray, want: np.ndarray) -> float:
    """Largest |got - want|; inf when the shapes differ (a shape mismatch is never within tolerance)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return float("inf")
    if got.size == 0:
        return 0.0
    return float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))


def mismatches(got: Any, want: Any) -> float:
    """0.0 when two integer sequences are identical, else the number of differing positions (inf on length change)."""
    a, b = np.asarray(got).reshape(-1), np.asarray(want).reshape(-1)
    if a.shape != b.shape:
        return float("inf")
    return float(np.count_nonzero(a != b))


def indices(npz: Any, pattern: re.Pattern[str]) -> list[int]:
    """Case or chunk numbers present in an npz (derived from array names like `case2_logp`)."""
    return sorted({int(m.group(1)) for k in npz.files if (m := pattern.match(k))})


def skip_reason(fixtures: Path, name: str, needs: tuple[str, ...] = ()) -> str | None:
    """Why the stage reading fixture file `name` cannot run (`name` or a file it `needs`, e.g. the prompt models, is
    missing from `fixtures`), as a `VerifyReport.skipped` entry; None when it can run."""
    if not (fixtures / name).is_file():
        return f"{name}: not present"
    missing = [f for f in needs if not (fixtures / f).is_file()]
    return f"{name}: missing {', '.join(missing)}" if missing else None
