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
        ("built-in speaker, 1 client: first audio ≤ 0.7 s, TTCA ≤ 1.2 s", _latency(results, "listen", BUILTIN, 1, 0.7, 1.2)),
        (
            "saved voice, 10 s recording, 1 client: first audio ≤ 1.5 s, TTCA ≤ 2.5 s",
            _latency(results, "listen", SAVED_10S, 1, 1.5, 2.5),
        ),
        ("saved voice, 3 s recording, 1 client: TTCA ≤ 2.0 s", _latency(results, "listen", SAVED_3S, 1, None, 2.0)),
        ("built-in speaker, 2 clients: TTCA ≤ 2.0 s", _latency(results, "listen", BUILTIN, 2, None, 2.0)),
        ("8 clients, ~15-character sentence: ≥ 1.5 audio s/s, first audio p95 ≤ 3.0 s", _eight(levels)),
        ("server peak RSS ≤ 1.0 GB under 1-8 streams", _rss(http)),
        ("parity: `service verify` passes on the reference fixtures", _parity(results)),
    ]
    return [(name, measured, ok) for name, (measured, ok) in rows]


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


def _listen_rows(label: str, run: dict[str, Any]) -> list[list[str]]:
    out = []
    for r in run.get("rows", []):
        row = [label, r["voice"], str(r["clients"]), str(r["requests"] - r["failures"]), str(r.get("refused", 0))]
        for key in ("first_audio_s", "ttca_s", "stall_s"):
            row.append(f"{_f(r[key + '_p50'])} / {_f(r[key + '_max'])}")
        peak = r.get("peak_rss_mb")
        row += [_f(r["rtf_p50"]), _f(r["audio_per_wall"]), "–" if peak is None else _f(peak / MB_PER_GB)]
        out.append(row)
    return out


# The open issues state their speed targets for 2 cores with these flags (CosyVoice-300M as fast as CosyVoice2, fits a
# small VM, Fun-CosyVoice3 in real time); memory targets hold on any host.
TARGET_FLAGS = ("avx512_vnni", "avx512_bf16")
GIB_MB = 1024.0  # TTS_MEMORY_LIMIT=2G is 2 GiB; peak_rss_mb counts MiB


def cpu_flags(cpu: str) -> frozenset[str]:
    """The flags a recorded CPU summary lists as present ("AMD EPYC; avx2, no avx512f, ..." -> {"avx2"})."""
    _, _, listed = cpu.partition("; ")
    return frozenset(listed.split(",")[0].split())


def target_host_note(results: dict[str, Any], parts: Iterable[str]) -> list[str]:
    """A line under a targets table when a run that measured it lacks the flags its speed targets are stated for."""
    runs = results.get("part_runs") or {}
    lacking = sorted(
        {f"`{part}` ({', '.join(f for f in TARGET_FLAGS if f not in cpu_flags(runs[part]['cpu']))})"
         for part in parts if part in results and part in runs
         and any(f not in cpu_flags(runs[part]["cpu"]) for f in TARGET_FLAGS)}
    )  # fmt: skip
    if not lacking:
        return []
    return [
        "Speed targets are stated for 2 cores with AVX-512 VNNI and bf16; these parts ran without some of those flags: "
        f"{', '.join(lacking)}. Their speed figures are that host's (compare rows of one run); memory figures still hold.",
        "",
    ]


def _latency(
    results: dict[str, Any], part: str, voice: str, clients: int, first: float | None, ttca: float
) -> tuple[str, bool | None]:
    """First audio and TTCA p50 of a default-settings row against their bounds (`first` None: TTCA alone)."""
    row = listen_row(results, voice, clients, part)
    if row is None:
        return NOT_RUN
    got_first, got_ttca = row["first_audio_s_p50"], row["ttca_s_p50"]
    ok = got_ttca <= ttca and (first is None or got_first <= first)
    return f"first audio {_f(got_first)} s, TTCA {_f(got_ttca)} s", ok


def _per_wall(results: dict[str, Any], part: str, voice: str, clients: int, floor: float) -> tuple[str, bool | None]:
    row = listen_row(results, voice, clients, part)
    if row is None:
        return NOT_RUN
    return f"{_f(row['audio_per_wall'])} audio s/s", row["audio_per_wall"] >= floor


def _rtf(results: dict[str, Any], part: str, voice: str, ceiling: float) -> tuple[str, bool | None]:
    row = listen_row(results, voice, 1, part)
    if row is None:
        return NOT_RUN
    return f"RTF {_f(row['rtf_p50'])} ({voice})", row["rtf_p50"] <= ceiling


def _stall_p95(results: dict[str, Any], part: str, voice: str, clients: int, ceiling: float) -> tuple[str, bool | None]:
    row = listen_row(results, voice, clients, part)
    if row is None or "stall_s_p95" not in row:
        return NOT_RUN
    return f"stall p95 {_f(row['stall_s_p95'])} s", row["stall_s_p95"] <= ceiling


def _peak_rss(results: dict[str, Any], part: str, clients: int, ceiling_gb: float) -> tuple[str, bool | None]:
    """The server's peak over the default rows of at most `clients` clients (every voice); a run recorded before rows
    had their own peak counts its whole peak when it ran no more clients than that."""
    run = (results.get(part) or {}).get("default", {})
    rows = [r for r in run.get("rows", []) if r["clients"] <= clients]
    peaks = [r["peak_rss_mb"] for r in rows if "peak_rss_mb" in r]
    if not peaks and rows and max(r["clients"] for r in run["rows"]) <= clients and "server_peak_rss_mb" in run:
        peaks = [run["server_peak_rss_mb"]]
    if not peaks:
        return NOT_RUN
    peak = max(peaks) / MB_PER_GB
    return f"{peak:.2f} GB", peak <= ceiling_gb


def _answers(rows: list[dict[str, Any]]) -> str:
    asked, refused, failed = (sum(r.get(k, 0) for r in rows) for k in ("requests", "refused", "failures"))
    return f"{asked} requests: {asked - refused - failed} audio, {refused} refused (503), {failed} failed"


def _eight_clients(results: dict[str, Any], part: str) -> tuple[str, bool | None]:
    rows = [r for r in (results.get(part) or {}).get("default", {}).get("rows", []) if r["clients"] == 8]
    if not rows:
        return NOT_RUN
    return _answers(rows), all(r["failures"] == 0 for r in rows)


def _limited(results: dict[str, Any], part: str) -> tuple[str, bool | None]:
    """8 clients of the 10 s voice under TTS_MEMORY_LIMIT=2G: every answer audio or a 503, the peak within 2 GiB."""
    run = (results.get(part) or {}).get("memory_limit")
    if not run or not run.get("rows"):
        return NOT_RUN
    peak = run["server_peak_rss_mb"]
    ok = all(r["failures"] == 0 for r in run["rows"]) and peak <= 2 * GIB_MB
    return f"{_answers(run['rows'])}; peak {peak / MB_PER_GB:.2f} GB", ok


def v1_speed_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) of "CosyVoice-300M as fast as CosyVoice2": full-size int8, default settings, HTTP."""
    rows: list[tuple[str, tuple[str, bool | None]]] = [
        ("built-in speaker, 1 client: first audio ≤ 0.40 s, TTCA ≤ 0.70 s", _latency(results, "listen", BUILTIN, 1, 0.4, 0.7)),
        (
            "saved voice, 10 s recording, 1 client: first audio ≤ 0.60 s, TTCA ≤ 0.90 s",
            _latency(results, "listen", SAVED_10S, 1, 0.6, 0.9),
        ),
        ("built-in speaker, 4 clients: ≥ 2.5 audio s per wall s", _per_wall(results, "listen", BUILTIN, 4, 2.5)),
        ("saved voice, 10 s recording, 4 clients: ≥ 2.0 audio s per wall s", _per_wall(results, "listen", SAVED_10S, 4, 2.0)),
        ("server peak RSS, 1-4 clients: ≤ 1.2 GB", _peak_rss(results, "listen", 4, 1.2)),
    ]
    return [(name, measured, ok) for name, (measured, ok) in rows]


def small_vm_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) of "Fits a small VM": both families, full-size int8, default settings, HTTP."""
    rows: list[tuple[str, tuple[str, bool | None]]] = [
        ("CosyVoice2 server peak RSS, 1-4 clients: ≤ 1.5 GB", _peak_rss(results, "listen2", 4, 1.5)),
        ("CosyVoice-300M server peak RSS, 1-4 clients: ≤ 1.2 GB", _peak_rss(results, "listen", 4, 1.2)),
        (
            "CosyVoice2, saved voice 10 s, 4 clients: stall p95 after first audio ≤ 0.3 s",
            _stall_p95(results, "listen2", SAVED_10S, 4, 0.3),
        ),
        (
            "CosyVoice2, saved voice 10 s, 4 clients: ≥ 2.16 audio s per wall s",
            _per_wall(results, "listen2", SAVED_10S, 4, 2.16),
        ),
        ("CosyVoice-300M, 8 clients: no failure but 503 + Retry-After", _eight_clients(results, "listen")),
        ("CosyVoice2, 8 clients: no failure but 503 + Retry-After", _eight_clients(results, "listen2")),
        ("CosyVoice-300M, 8 cloned clients, `TTS_MEMORY_LIMIT=2G`: 200 or 503 only, peak ≤ 2 GiB", _limited(results, "listen")),
        ("CosyVoice2, 8 cloned clients, `TTS_MEMORY_LIMIT=2G`: 200 or 503 only, peak ≤ 2 GiB", _limited(results, "listen2")),
        ("Fun-CosyVoice3, 8 cloned clients, `TTS_MEMORY_LIMIT=2G`: 200 or 503 only, peak ≤ 2 GiB", _limited(results, "listen3")),
    ]
    return [(name, measured, ok) for name, (measured, ok) in rows]


def v3_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) of "Fun-CosyVoice3-0.5B in real time": full-size int8, default settings, HTTP, 5 s."""
    rows: list[tuple[str, tuple[str, bool | None]]] = [
        (
            "saved voice, 10 s recording, 1 client: first audio ≤ 1.2 s, TTCA ≤ 2.0 s",
            _latency(results, "listen3", SAVED_10S, 1, 1.2, 2.0),
        ),
        ("streamed RTF, 1 client: ≤ 0.9", _rtf(results, "listen3", SAVED_10S, 0.9)),
        ("saved voice, 10 s recording, 2 clients: ≥ 1.0 audio s per wall s", _per_wall(results, "listen3", SAVED_10S, 2, 1.0)),
        ("server peak RSS, 1-2 clients: ≤ 2.5 GB", _peak_rss(results, "listen3", 2, 2.5)),
    ]
    return [(name, measured, ok) for name, (measured, ok) in rows]


def listener_lines(part: dict[str, Any] | None, title: str) -> list[str]:
    """What a listener hears: the default settings first, then each comparison setup (with its setting)."""
    if not part:
        return []
    head = ["setup", "voice", "clients", "answered", "refused (503)", "first audio s p50 / max", "TTCA s p50 / max"]
    head += ["stall s p50 / max", "streamed RTF p50", "audio s / wall s", "peak RSS GB"]
    rows = _listen_rows("default settings", part["default"])
    for label, run in part.get("compare", {}).items():
        rows += _listen_rows(setup_label(label, run.get("env") or {}), run)
    limited = part.get("memory_limit")
    if limited:
        rows += _listen_rows(setup_label("8 clients under a 2 GiB memory limit", limited.get("env") or {}), limited)
    return [title, "", *_table(head, rows)]


def v2_targets(results: dict[str, Any]) -> list[Target]:
    """(target, measured, met) of issue 24 item 6: CosyVoice2, full-size int8, default settings, HTTP, 5 s sentence."""
    ten, three = (listen_row(results, voice, 1, "listen2") for voice in (SAVED_10S, SAVED_3S))
    latency = "saved voice, 10 s recording, 1 client: first audio ≤ 1.0 s, TTCA ≤ 1.5 s"
    out: list[Target] = [(latency, *_latency(results, "listen2", SAVED_10S, 1, 1.0, 1.5))]
    if ten is None or three is None:
        out.append(("3 s vs 10 s recording, 1 client: first audio differs by ≤ 0.4 s", *NOT_RUN))
    else:
        gap = ten["first_audio_s_p50"] - three["first_audio_s_p50"]
        measured = f"{_f(three['first_audio_s_p50'])} s vs {_f(ten['first_audio_s_p50'])} s: {_f(gap)} s"
        out.append(("3 s vs 10 s recording, 1 client: first audio differs by ≤ 0.4 s", measured, abs(gap) <= 0.4))
    four = "saved voice, 10 s recording, 4 clients: ≥ 1.0 audio s per wall s"
    out.append((four, *_per_wall(results, "listen2", SAVED_10S, 4, 1.0)))
    return out
