"""The speed targets and the listener tables (first audio, TTCA, stall) of docs/benchmarks.md, from results.json."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from service.levers import LEVERS

MB_PER_GB = 1000.0
NOT_RUN = ("not measured in this run", None)
Target = tuple[str, str, bool | None]
BUILTIN = "built-in speaker"
SAVED_3S = "saved voice, 3 s recording"
SAVED_10S = "saved voice, 10 s recording"
TTCA_MEANS = (
    "TTCA (time to continuous audio) is the earliest moment a player can start and never have to wait: the largest "
    "(arrival time − seconds of audio received before it) over the pieces of the stream."
)
STALL_MEANS = "Stall: seconds a player that starts at the first audio sits silent."
# Settings some recorded runs were made with, before they became engine levers: what each is called now.
LEGACY_SETTINGS = {"COSYVOICE_LITE_AMX=0": "native_kernels=no-amx"}
_RECORDED_SETTING = re.compile(r"\s*\((?:TTS_|COSYVOICE_LITE_)[^)]*\)")


def _f(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def _table(head: list[str], rows: Iterable[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return [*out, ""]


def current_setting(env: dict[str, str]) -> str:
    """The server settings of a recorded run as they are spelled now: levers gathered into one TTS_ENGINE_PROFILE."""
    levers, others = [], []
    for name, value in env.items():
        lever = name.removeprefix("TTS_").lower()
        if name == "TTS_ENGINE_PROFILE":
            levers.append(value)
        elif f"{name}={value}" in LEGACY_SETTINGS:
            levers.append(LEGACY_SETTINGS[f"{name}={value}"])
        elif name.startswith("TTS_") and lever in LEVERS:
            levers.append(f"{lever}={value}")
        else:
            others.append(f"{name}={value}")
    profile = [f"TTS_ENGINE_PROFILE={','.join(levers)}"] if levers else []
    return " ".join(others + profile)


def setup_label(label: str, env: dict[str, str]) -> str:
    """A comparison row's label without the setting names it was recorded with, then the setting as spelled now."""
    setting = current_setting(env)
    plain = _RECORDED_SETTING.sub("", label)
    return f"{plain} (`{setting}`)" if setting else plain


def listen_row(results: dict[str, Any], voice: str, clients: int, part: str = "listen") -> dict[str, Any] | None:
    """The default-settings listener row of one voice and client count of a listener part, or None."""
    rows = (results.get(part) or {}).get("default", {}).get("rows", [])
    return next((r for r in rows if r["voice"] == voice and r["clients"] == clients), None)


def targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) for each goal of the v1 speed issue "Speech that plays without gaps", always all of them
    (met is None when the part that measures it did not run). Full-size int8 bundle, default settings, HTTP."""
    http = results.get("http") or {}
    levels = {lv["clients"]: lv for lv in http.get("levels", [])}
    rows: list[tuple[str, tuple[str, bool | None]]] = [
        ("built-in speaker, 1 client: first audio ≤ 0.7 s, TTCA ≤ 1.2 s", _first_ttca(results, BUILTIN, 1, 0.7, 1.2)),
        (
            "saved voice, 10 s recording, 1 client: first audio ≤ 1.5 s, TTCA ≤ 2.5 s",
            _first_ttca(results, SAVED_10S, 1, 1.5, 2.5),
        ),
        ("saved voice, 3 s recording, 1 client: TTCA ≤ 2.0 s", _first_ttca(results, SAVED_3S, 1, None, 2.0)),
        ("built-in speaker, 2 clients: TTCA ≤ 2.0 s", _first_ttca(results, BUILTIN, 2, None, 2.0)),
        ("8 clients, ~15-character sentence: ≥ 1.5 audio s/s, first audio p95 ≤ 3.0 s", _eight(levels)),
        ("server peak RSS ≤ 1.0 GB under 1-8 streams", _rss(http)),
        ("parity: `service verify` passes on the reference fixtures", _parity(results)),
    ]
    return [(name, measured, ok) for name, (measured, ok) in rows]


def _first_ttca(results: dict[str, Any], voice: str, clients: int, first: float | None, ttca: float) -> tuple[str, bool | None]:
    row = listen_row(results, voice, clients)
    if row is None:
        return NOT_RUN
    got_first, got_ttca = row["first_audio_s_p50"], row["ttca_s_p50"]
    ok = got_ttca <= ttca and (first is None or got_first <= first)
    return f"first audio {_f(got_first)} s, TTCA {_f(got_ttca)} s", ok


def _eight(levels: dict[int, dict[str, Any]]) -> tuple[str, bool | None]:
    if 8 not in levels:
        return NOT_RUN
    lv = levels[8]
    ok = lv["first_chunk_p95_s"] <= 3.0 and lv["audio_per_wall"] >= 1.5 and lv["failures"] == 0
    return f"{_f(lv['audio_per_wall'])} audio s/s, p95 {_f(lv['first_chunk_p95_s'])} s, {lv['failures']} failures", ok


def _rss(http: dict[str, Any]) -> tuple[str, bool | None]:
    if not http:
        return NOT_RUN
    peak = http["server_peak_rss_mb"]
    return f"{peak / MB_PER_GB:.2f} GB", peak <= MB_PER_GB


def _parity(results: dict[str, Any]) -> tuple[str, bool | None]:
    parity = results.get("parity")
    return (parity["summary"], parity["passed"]) if parity else NOT_RUN


def status_lines(title: str, rows: list[Target]) -> list[str]:
    """A targets table: each target, what was measured, and met / not met / – (not measured)."""
    table = [[t, m, "**met**" if ok else ("not met" if ok is False else "–")] for t, m, ok in rows]
    return [title, "", *_table(["target", "measured", "status"], table)]


def target_lines(results: dict[str, Any]) -> list[str]:
    return status_lines("### Targets", targets(results))


def _listen_rows(label: str, run: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in run.get("rows", []):
        row = [label, r["voice"], str(r["clients"]), str(r["requests"] - r["failures"])]
        for key in ("first_audio_s", "ttca_s", "stall_s"):
            row.append(f"{_f(r[key + '_p50'])} / {_f(r[key + '_max'])}")
        row += [_f(r["rtf_p50"]), _f(r["audio_per_wall"])]
        out.append(row)
    return out


def listener_lines(part: dict[str, Any] | None, title: str) -> list[str]:
    """What a listener hears: the default settings first, then each comparison setup (with its setting)."""
    if not part:
        return []
    head = ["setup", "voice", "clients", "requests", "first audio s p50 / max", "TTCA s p50 / max", "stall s p50 / max"]
    head += ["streamed RTF p50", "audio s / wall s"]
    rows = _listen_rows("default settings", part["default"])
    for label, run in part.get("compare", {}).items():
        rows += _listen_rows(setup_label(label, run.get("env") or {}), run)
    return [title, "", *_table(head, rows)]


def v2_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) of issue 24 item 6: CosyVoice2, full-size int8, default settings, HTTP, 5 s sentence."""
    run = (results.get("listen2") or {}).get("default", {})
    rows = {(r["voice"], r["clients"]): r for r in run.get("rows", [])}
    ten, three = rows.get((SAVED_10S, 1)), rows.get((SAVED_3S, 1))
    out: list[Target] = []
    latency = "saved voice, 10 s recording, 1 client: first audio ≤ 1.0 s, TTCA ≤ 1.5 s"
    if ten is None:
        out.append((latency, *NOT_RUN))
    else:
        first, ttca = ten["first_audio_s_p50"], ten["ttca_s_p50"]
        out.append((latency, f"first audio {_f(first)} s, TTCA {_f(ttca)} s", first <= 1.0 and ttca <= 1.5))
    if ten is None or three is None:
        out.append(("3 s vs 10 s recording, 1 client: first audio differs by ≤ 0.4 s", *NOT_RUN))
    else:
        gap = ten["first_audio_s_p50"] - three["first_audio_s_p50"]
        measured = f"{_f(three['first_audio_s_p50'])} s vs {_f(ten['first_audio_s_p50'])} s: {_f(gap)} s"
        out.append(("3 s vs 10 s recording, 1 client: first audio differs by ≤ 0.4 s", measured, abs(gap) <= 0.4))
    four = rows.get((SAVED_10S, 4))
    if four is None:
        out.append(("saved voice, 10 s recording, 4 clients: ≥ 1.0 audio s per wall s", *NOT_RUN))
    else:
        apw = four["audio_per_wall"]
        out.append(("saved voice, 10 s recording, 4 clients: ≥ 1.0 audio s per wall s", f"{_f(apw)} audio s/s", apw >= 1.0))
    return out
