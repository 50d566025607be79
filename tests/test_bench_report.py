"""The benchmark report's targets table: every target of the speed issue appears, met / not met / not measured."""

from __future__ import annotations

from typing import Any

from loadtest.bench_report import markdown, targets


def _level(clients: int, p50: float, p95: float, per_wall: float, failures: int = 0) -> dict[str, Any]:
    return {
        "clients": clients,
        "requests": 2 * clients,
        "failures": failures,
        "first_chunk_p50_s": p50,
        "first_chunk_p95_s": p95,
        "audio_per_wall": per_wall,
        "rtf_p50": 1.0,
    }


def _results(first: float, p95: float, rss_mb: float, saved: float) -> dict[str, Any]:
    voices = {"built-in speaker": _level(1, 0.6, 0.6, 1.0), "saved voice": _level(1, saved, saved, 1.0)}
    http = {"levels": [_level(1, first, first, 1.0), _level(8, 2.0, p95, 1.2)], "server_peak_rss_mb": rss_mb}
    single = [{"label": "int8", "n_timesteps": 10, "median": {"rtf": 0.9}, "min_max": {"rtf": [0.8, 1.0]}}]
    parity = {"passed": True, "summary": "177/177 checks within tolerance"}
    return {"http": http | {"voices": voices, "voice_prompt_s": 10}, "single": single, "parity": parity}


def test_every_target_met_when_the_figures_are_inside() -> None:
    rows = targets(_results(first=0.65, p95=2.9, rss_mb=900, saved=0.8))
    assert len(rows) == 6
    assert all(ok is True for _, _, ok in rows), rows


def test_each_target_fails_on_its_own_figure() -> None:
    by_name = {name: ok for name, _, ok in targets(_results(first=0.71, p95=3.1, rss_mb=1001, saved=0.86))}
    failed = [name for name, ok in by_name.items() if ok is False]
    assert len(failed) == 4, by_name
    assert any("first audio ≤ 0.7 s" in n for n in failed) and any("saved voice" in n for n in failed)


def test_unmeasured_targets_are_listed_as_not_measured() -> None:
    rows = targets({})
    assert len(rows) == 6 and all(ok is None for _, _, ok in rows)
    doc = markdown({}, "summary.png")
    assert doc.count("not measured in this run") == 6
