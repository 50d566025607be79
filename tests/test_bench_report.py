"""The benchmark report: docs/benchmarks.md and the README's tables come from results.json alone, every target appears
(met / not met / not measured), listener rows first, a family without rows says it was not measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loadtest.bench_report import NOT_MEASURED, main, markdown, with_readme_tables
from loadtest.bench_targets import (
    BUILTIN,
    SAVED_3S,
    SAVED_10S,
    cpu_flags,
    small_vm_targets,
    targets,
    v1_speed_targets,
    v2_targets,
    v3_targets,
)


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


def _heard(voice: str, clients: int, first: float, ttca: float) -> dict[str, Any]:
    row = {"voice": voice, "clients": clients, "requests": 3, "failures": 0, "audio_per_wall": 1.0}
    for key, value in (("first_audio_s", first), ("ttca_s", ttca), ("stall_s", ttca - first), ("rtf", 0.9)):
        row |= {f"{key}_p50": value, f"{key}_max": value + 0.1}
    return row


def _results(first: float, ttca: float, p95: float, rss_mb: float, saved_ttca: float) -> dict[str, Any]:
    rows = [
        _heard(BUILTIN, 1, first, ttca),
        _heard(BUILTIN, 2, first + 0.2, ttca + 0.8),
        _heard(SAVED_3S, 1, first + 0.3, saved_ttca - 0.5),
        _heard(SAVED_10S, 1, first + 0.5, saved_ttca),
    ]
    listen = {"default": {"rows": rows, "tokens": 250}, "compare": {"ORT": {"rows": rows[:1]}}}
    http = {"levels": [_level(1, first, first, 1.0), _level(8, 2.0, p95, 1.6)], "server_peak_rss_mb": rss_mb}
    parity = {"passed": True, "summary": "177/177 checks within tolerance"}
    return {"http": http, "listen": listen, "parity": parity}


def test_every_target_met_when_the_figures_are_inside() -> None:
    rows = targets(_results(first=0.65, ttca=1.1, p95=2.9, rss_mb=900, saved_ttca=2.4))
    assert len(rows) == 7
    assert all(ok is True for _, _, ok in rows), rows


def test_each_target_fails_on_its_own_figure() -> None:
    by_name = {name: ok for name, _, ok in targets(_results(first=0.71, ttca=1.3, p95=3.1, rss_mb=1001, saved_ttca=2.6))}
    failed = [name for name, ok in by_name.items() if ok is False]
    assert len(failed) == 6, by_name  # all but parity
    assert any("first audio ≤ 0.7 s" in n for n in failed) and any("10 s recording" in n for n in failed)


def test_unmeasured_targets_are_listed_as_not_measured() -> None:
    rows = targets({})
    assert len(rows) == 7 and all(ok is None for _, _, ok in rows)
    doc = markdown({})
    assert doc.count("not measured in this run") == 7 + len(v1_speed_targets({}))


def test_the_listener_table_leads_and_says_what_ttca_means() -> None:
    doc = markdown(_results(first=0.65, ttca=1.1, p95=2.9, rss_mb=900, saved_ttca=2.4))
    assert doc.index("What a listener hears") < doc.index("Concurrent streams")
    assert "earliest moment a player can start and never have to wait" in " ".join(doc.split())  # the method
    assert "| default settings | built-in speaker | 1 | 3 | 0 | 0.65 / 0.75 | 1.10 / 1.20 |" in doc
    assert "| ORT | built-in speaker | 1 |" in doc


def _v2(first_10s: float, first_3s: float, ttca: float, four_clients: float) -> dict[str, Any]:
    rows = [_heard(SAVED_3S, 1, first_3s, ttca), _heard(SAVED_10S, 1, first_10s, ttca), _heard(SAVED_10S, 4, 2.0, 5.0)]
    rows[-1]["audio_per_wall"] = four_clients
    return {"listen2": {"default": {"rows": rows, "tokens": 125}, "compare": {"official": {"rows": rows[:1]}}}}


def test_cosyvoice2_targets_have_their_own_table() -> None:
    met = v2_targets(_v2(first_10s=0.9, first_3s=0.6, ttca=1.4, four_clients=1.1))
    assert len(met) == 3 and all(ok is True for _, _, ok in met), met
    missed = v2_targets(_v2(first_10s=1.2, first_3s=0.7, ttca=1.6, four_clients=0.9))
    assert all(ok is False for _, _, ok in missed), missed
    assert all(ok is None for _, _, ok in v2_targets({}))
    doc = markdown(_v2(first_10s=0.9, first_3s=0.6, ttca=1.4, four_clients=1.1))
    v2 = doc.split("## CosyVoice2-0.5B")[1]
    assert "### Targets" in v2 and "| official | saved voice, 3 s recording | 1 |" in v2


def test_each_family_names_the_run_and_cpu_that_measured_it(tmp_path: Path) -> None:
    from loadtest.bench import cpu_summary

    cpuinfo = tmp_path / "cpuinfo"
    first = "model name\t: AMD EPYC\ncpu family\t: 26\nmodel\t\t: 2\nflags\t\t: fpu avx2 avx512f avx512_vnni avx512_bf16\n"
    cpuinfo.write_text(first + "\nprocessor\t: 1\nmodel name\t: AMD EPYC\n")
    cpu = cpu_summary(cpuinfo, frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}))
    assert cpu == "AMD EPYC (family 26 model 2); avx2 avx512f avx512_vnni avx512_bf16, no amx_tile"
    now, before = "2026-11-29 01:43:47 UTC", "2026-11-20 10:00:00 UTC"
    results = _results(first=0.65, ttca=1.1, p95=2.9, rss_mb=900, saved_ttca=2.4) | _v2(0.9, 0.6, 1.4, 1.1)
    results["machine"] = {"started": now, "platform": "Linux", "cpu_count": 2, "cpu": cpu}
    results["part_runs"] = {"listen": {"started": now, "cpu": cpu}, "http": {"started": before, "cpu": "Intel Xeon; avx2"}}
    doc = markdown(results)
    assert f"2 CPUs ({cpu})" in doc.split("## CosyVoice-300M")[0]
    v1 = doc.split("## CosyVoice-300M (v1)")[1].split("### Targets")[0]
    assert f"Measured by the run started {now} on {cpu} (the latest): listen." in v1
    assert f"Measured by the run started {before} on Intel Xeon; avx2: http." in v1
    assert "Measured by a run before runs were recorded: parity." in v1
    v2 = doc.split("## CosyVoice2-0.5B")[1].split("### Targets")[0]
    assert "a run before runs were recorded: listen2." in v2


def _v3() -> dict[str, Any]:
    rows = [_heard(BUILTIN, 1, 0.4, 0.7), _heard(SAVED_10S, 1, 0.6, 0.9)]
    env = {"TTS_ENGINE_PROFILE": "flow_window_s=all"}
    return {"listen3": {"default": {"rows": rows, "tokens": 125}, "compare": {"all frames": {"rows": rows[1:], "env": env}}}}


def test_cosyvoice3_is_not_measured_until_its_rows_exist_then_filled() -> None:
    before = markdown(_results(first=0.65, ttca=1.1, p95=2.9, rss_mb=900, saved_ttca=2.4))
    v3 = before.split("## Fun-CosyVoice3-0.5B")[1]
    assert NOT_MEASURED.format(part="listen3") in v3 and "|" not in v3
    after = markdown(_v3()).split("## Fun-CosyVoice3-0.5B")[1]
    assert "| default settings | saved voice, 10 s recording | 1 | 3 | 0 | 0.60 / 0.70 | 0.90 / 1.00 |" in after
    assert "| all frames (`TTS_ENGINE_PROFILE=flow_window_s=all`) | saved voice, 10 s recording |" in after
    assert "![Fun-CosyVoice3-0.5B](benchmarks/cosyvoice3.png)" in after


def test_settings_recorded_under_old_names_are_shown_as_they_are_spelled_now() -> None:
    part = {"default": {"rows": []}, "compare": {}}
    for label, env in (
        ("ORT (TTS_ACOUSTIC_BACKEND=ort)", {"TTS_ACOUSTIC_BACKEND": "ort"}),
        ("no tiles (COSYVOICE_LITE_AMX=0; the default without AMX)", {"COSYVOICE_LITE_AMX": "0"}),
    ):
        part["compare"][label] = {"rows": [_heard(BUILTIN, 1, 0.5, 1.0)], "env": env}
    doc = markdown({"listen2": part})
    assert "| ORT (`TTS_ENGINE_PROFILE=acoustic_backend=ort`) | built-in speaker |" in doc
    assert "| no tiles (`TTS_ENGINE_PROFILE=native_kernels=no-amx`) | built-in speaker |" in doc
    assert "TTS_ACOUSTIC_BACKEND" not in doc and "COSYVOICE_LITE_AMX" not in doc


def test_the_generator_writes_the_same_files_from_a_results_fixture(tmp_path: Path) -> None:
    """`python loadtest/bench_report.py` on a small results.json: the whole doc and each README block, twice the same."""
    results = _results(first=0.65, ttca=1.1, p95=2.9, rss_mb=900, saved_ttca=2.4) | _v2(0.9, 0.6, 1.4, 1.1)
    results["part_runs"] = {p: {"started": "2026-11-29 01:58:23 UTC", "cpu": "AMD EPYC; avx512_vnni"} for p in results}
    (tmp_path / "results.json").write_text(json.dumps(results))
    readme = tmp_path / "README.md"
    blocks = "".join(f"<!-- bench:cosyvoice{n} -->\nstale\n<!-- /bench -->\n" for n in (1, 2, 3))
    readme.write_text("# x\n" + blocks)
    argv = ["--results", str(tmp_path / "results.json"), "--doc", str(tmp_path / "b.md"), "--readme", str(readme)]
    assert main([*argv, "--no-plots"]) == 0
    doc, text = (tmp_path / "b.md").read_text(), readme.read_text()
    assert main([*argv, "--no-plots"]) == 0
    assert (tmp_path / "b.md").read_text() == doc and readme.read_text() == text
    assert doc == markdown(results) and "stale" not in text
    assert "| built-in speaker | 1 | 0.65 s | 1.10 s | 0.45 s | 1.00 |" in text.split("<!-- bench:cosyvoice1 -->")[1]
    assert "`make bench`, 2026-11-29, on AMD EPYC with avx512_vnni." in text
    assert NOT_MEASURED.format(part="listen3") in text.split("<!-- bench:cosyvoice3 -->")[1]
    assert doc.index("## Method") < doc.index("## CosyVoice-300M") < doc.index("## CosyVoice2") < doc.index("## Fun-CosyVoice3")


def test_the_committed_report_is_what_the_generator_writes_from_the_committed_results() -> None:
    repo = Path(__file__).resolve().parents[1]
    results = json.loads((repo / "docs" / "benchmarks" / "results.json").read_text(encoding="utf-8"))
    assert (repo / "docs" / "benchmarks.md").read_text(encoding="utf-8") == markdown(results), "run loadtest/bench_report.py"
    readme = (repo / "README.md").read_text(encoding="utf-8")
    assert with_readme_tables(readme, results) == readme, "run: python loadtest/bench_report.py"
    assert readme.count("<!-- /bench -->") == 3


def test_the_cosyvoice3_part_runs_the_listener_bench_with_real_levers(monkeypatch: Any, tmp_path: Path) -> None:
    """`make bench`'s listen3 part: the default settings at 1, 2 and 4 clients (7 one-client requests), then each switch
    at 1 client; every switch is a lever the engine profile accepts (as are listen2's)."""
    import argparse

    from loadtest import bench
    from service.levers import LEVERS, parse_profile

    calls: list[list[str]] = []
    monkeypatch.setattr(bench, "ensure_v3_bundle", lambda models: tmp_path / "full-random-cosyvoice3-int8")
    monkeypatch.setattr(bench, "run_json", lambda cmd, env=None: calls.append(cmd) or {"rows": []})
    out = bench.part_listen3({}, argparse.Namespace(models=tmp_path, per_client=2))
    assert "listen3" in bench.PARTS and bench.RUNNERS["listen3"] is bench.part_listen3
    default, *compare, limited = calls
    assert default[1:3] == ["loadtest/bench_listen.py", str(tmp_path / "full-random-cosyvoice3-int8")]
    assert default[-6:] == ["--levels", "1", "2", "4", "--one-client-requests", "7"] and "--per-client" in default
    assert set(out["compare"]) == {label for label, _ in bench.LISTEN3_COMPARE} and len(compare) == len(bench.LISTEN3_COMPARE)
    assert limited[-6:] == ["--levels", "8", "--prompt-seconds", "10", "--env", "TTS_MEMORY_LIMIT=2G"] and "memory_limit" in out
    for _, env in (*bench.LISTEN2_COMPARE, *bench.LISTEN3_COMPARE):
        for setting in env:
            name, _, value = setting.partition("=")
            assert name == "TTS_ENGINE_PROFILE", setting
            profile = parse_profile(value)
            assert isinstance(profile, dict) and set(profile) <= set(LEVERS), setting


def _listened(part: str, rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {part: {"default": {"rows": rows, "tokens": 125}, "compare": {}, **extra}}


def _with(row: dict[str, Any], **values: Any) -> dict[str, Any]:
    return row | values


def test_the_open_issues_targets_are_judged_on_their_own_rows() -> None:
    """CosyVoice-300M as fast as CosyVoice2, fits a small VM, Fun-CosyVoice3 in real time: each figure from the row it
    names, met when inside, not met when outside, not measured when the row is missing."""
    v1_rows = [
        _with(_heard(BUILTIN, 1, 0.35, 0.65), peak_rss_mb=900.0),
        _with(_heard(SAVED_10S, 1, 0.55, 0.85), peak_rss_mb=1100.0),
        _with(_heard(BUILTIN, 4, 1.0, 2.0), audio_per_wall=2.6, peak_rss_mb=1150.0),
        _with(_heard(SAVED_10S, 4, 1.0, 2.0), audio_per_wall=2.1, peak_rss_mb=1190.0),
        _with(_heard(SAVED_10S, 8, 2.0, 4.0), refused=3, requests=24, peak_rss_mb=1900.0),  # past 4 clients: not judged
    ]
    fast = v1_speed_targets(_listened("listen", v1_rows))
    assert all(ok is True for _, _, ok in fast), fast
    slow = [_with(r, first_audio_s_p50=r["first_audio_s_p50"] + 0.1, audio_per_wall=1.9, peak_rss_mb=1250.0) for r in v1_rows]
    assert [ok for _, _, ok in v1_speed_targets(_listened("listen", slow))] == [False] * 5

    limited = {"rows": [_with(_heard(SAVED_10S, 8, 3.0, 9.0), requests=24, refused=5)], "server_peak_rss_mb": 1500.0}
    v2_rows = [
        _with(_heard(SAVED_10S, 4, 1.0, 2.0), audio_per_wall=2.2, stall_s_p95=0.2, peak_rss_mb=1400.0),
        _with(_heard(BUILTIN, 8, 1.0, 2.0), refused=2),
    ]
    results = _listened("listen", v1_rows, memory_limit=limited) | _listened("listen2", v2_rows, memory_limit=limited)
    vm = {name: (measured, ok) for name, measured, ok in small_vm_targets(results)}
    assert [ok for _, ok in vm.values()] == [True] * 8 + [None], vm
    assert vm["CosyVoice2, 8 clients: no failure but 503 + Retry-After"][0] == "3 requests: 1 audio, 2 refused (503), 0 failed"
    failing = _with(v2_rows[1], failures=1)
    over = limited | {"server_peak_rss_mb": 2100.0}
    results = _listened("listen2", [_with(v2_rows[0], stall_s_p95=0.4, audio_per_wall=2.1), failing], memory_limit=over)
    vm = {name: ok for name, _, ok in small_vm_targets(results)}
    assert [name for name, ok in vm.items() if ok is False] == [
        "CosyVoice2, saved voice 10 s, 4 clients: stall p95 after first audio ≤ 0.3 s",
        "CosyVoice2, saved voice 10 s, 4 clients: ≥ 2.16 audio s per wall s",
        "CosyVoice2, 8 clients: no failure but 503 + Retry-After",
        "CosyVoice2, 8 cloned clients, `TTS_MEMORY_LIMIT=2G`: 200 or 503 only, peak ≤ 2 GiB",
    ]

    v3_rows = [
        _with(_heard(SAVED_10S, 1, 1.1, 1.9), rtf_p50=0.85, peak_rss_mb=2000.0),
        _with(_heard(SAVED_10S, 2, 1.5, 2.5), audio_per_wall=1.1, peak_rss_mb=2400.0),
        _with(_heard(SAVED_10S, 4, 1.5, 2.5), peak_rss_mb=3000.0),  # past 2 clients: not judged
    ]
    assert all(ok is True for _, _, ok in v3_targets(_listened("listen3", v3_rows)))
    late = [_with(r, ttca_s_p50=2.1, rtf_p50=0.95, audio_per_wall=0.9, peak_rss_mb=2600.0) for r in v3_rows]
    assert [ok for _, _, ok in v3_targets(_listened("listen3", late))] == [False] * 4
    assert all(ok is None for rows in (v1_speed_targets({}), small_vm_targets({}), v3_targets({})) for _, _, ok in rows)


def test_a_run_recorded_before_rows_had_peaks_counts_its_whole_peak_only_within_the_clients() -> None:
    rows = [_heard(BUILTIN, 1, 0.3, 0.6), _heard(SAVED_10S, 4, 1.0, 2.0)]
    within = _listened("listen", rows) | {}
    within["listen"]["default"]["server_peak_rss_mb"] = 1100.0
    assert v1_speed_targets(within)[-1][1:] == ("1.10 GB", True)
    beyond = _listened("listen", [*rows, _heard(BUILTIN, 8, 2.0, 4.0)])
    beyond["listen"]["default"]["server_peak_rss_mb"] = 1100.0
    assert v1_speed_targets(beyond)[-1][2] is None


def test_the_report_shows_each_issue_table_the_memory_limit_row_and_which_host_lacked_the_flags() -> None:
    zen3 = "AMD EPYC (family 25 model 1); avx2, no avx512f, no avx512_vnni, no avx512_bf16, no amx_tile"
    assert cpu_flags(zen3) == {"avx2"}
    assert cpu_flags("AMD EPYC; avx2 avx512f avx512_vnni avx512_bf16, no amx_tile") >= {"avx512_vnni", "avx512_bf16"}
    limited = {"rows": [_with(_heard(SAVED_10S, 8, 3.0, 9.0), requests=24, refused=5, peak_rss_mb=1600.0)]}
    limited["env"] = {"TTS_MEMORY_LIMIT": "2G"}
    limited["server_peak_rss_mb"] = 1600.0
    results = _listened("listen3", [_with(_heard(SAVED_10S, 1, 1.1, 1.9), peak_rss_mb=1686.0)], memory_limit=limited)
    results["part_runs"] = {"listen3": {"started": "2026-11-29 23:19:47 UTC", "cpu": zen3}}
    v3 = markdown(results).split("## Fun-CosyVoice3-0.5B")[1]
    assert v3.index("### Targets: Fun-CosyVoice3-0.5B streamed in real time") < v3.index("What a listener hears")
    assert "these parts ran without some of those flags: `listen3` (avx512_vnni, avx512_bf16)" in v3
    assert "| default settings | saved voice, 10 s recording | 1 | 3 | 0 | 1.10 / 1.20 |" in v3 and "| 0.90 | 1.00 | 1.69 |" in v3
    assert "| 8 clients under a 2 GiB memory limit (`TTS_MEMORY_LIMIT=2G`) | saved voice, 10 s recording | 8 | 24 | 5 |" in v3
    doc = markdown(results)
    assert "### Targets: fits a small VM" not in doc  # CosyVoice2's section holds it, and has no rows here
    v1 = doc.split("## CosyVoice-300M (v1)")[1].split("## CosyVoice2")[0]
    assert v1.index("as fast as CosyVoice2") < v1.index("speech that plays without gaps") and "flags" not in v1
