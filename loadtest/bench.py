"""`make bench`: build the full-size random-init bundles once, measure everything with a 2-thread budget, write the report.

Parts (each in its own process, so peak RSS is per configuration):
  quality      int8/int4 decode-step deviation and flow mel error vs fp32 (and 5 vs 10 Euler steps)
  single       single-stream RTF and per-stage seconds, 250 forced tokens, fp32/int8/int4, 10 and 5 flow steps
  reference    the PyTorch reference pipeline on the same weights (see bench_reference.py)
  latency      streaming first-chunk latency of a ~15-character sentence at concurrency 1
  concurrency  1/2/4/8 closed-loop streaming clients in-process
  http         the same through a real uvicorn server on a free loopback port, with the default settings
  cloning      a saved voice (10 s prompt) vs a built-in speaker at 1 and 8 clients; prompt analysis time
  listen2      CosyVoice2-0.5B (full-size random-init int8) over HTTP: what a listener hears, defaults and each lever
  listen3      Fun-CosyVoice3-0.5B (full-size random-init int8) over HTTP: the same, defaults and its official switches
Results go to docs/benchmarks/results.json; loadtest/bench_report.py then writes docs/benchmarks.md, its plots and the
README's per-family tables from that file alone.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "2")  # the 2-thread budget, also for the calibration SGEMM

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from loadtest.bench_report import write_report  # noqa: E402
from loadtest.bundles import SCHEMES, bundle_dirs, ensure_bundles, ensure_v2_bundle, ensure_v3_bundle  # noqa: E402

PYTHON = sys.executable
PARTS = (
    "parity", "listen", "quality", "single", "reference", "latency", "concurrency", "http", "cloning", "websocket", "listen2",
    "listen3",
)  # fmt: skip


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run_json(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run a benchmark worker; its last stdout line is its JSON result."""
    log(" ".join(Path(c).name if c == PYTHON else c for c in cmd))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, check=True)
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["load_avg_after"] = os.getloadavg()[0]
    result["elapsed_s"] = time.perf_counter() - t0
    return result


CPU_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")  # what picks our kernels' code paths


def cpu_summary(cpuinfo: Path = Path("/proc/cpuinfo"), flags: frozenset[str] | None = None) -> str:
    """The CPU's model name and the flags our kernels choose by ("AMD EPYC; avx2 avx512f ..., no amx_tile"): `flags`,
    by default what our library's CPU probe reports (service.engine.native.cpu_features; none where it is not built)."""
    from service.engine.native import cpu_features

    try:
        text = cpuinfo.read_text(encoding="ascii", errors="replace")
    except OSError:
        return platform.processor() or "unknown CPU"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = (cpu_features() or frozenset()) if flags is None else flags
    family = f" (family {fields['cpu family']} model {fields['model']})" if "cpu family" in fields and "model" in fields else ""
    listed = " ".join(f for f in CPU_FLAGS if f in flags) + "".join(f", no {f}" for f in CPU_FLAGS if f not in flags)
    return f"{fields.get('model name', 'unknown CPU')}{family}; {listed}"


def machine_state() -> dict[str, Any]:
    """What the host could do in this minute: 2-thread SGEMM rate and memory read bandwidth, load average."""
    a = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)
    big = np.ones(64 << 20, dtype=np.float64)  # 512 MB: streams from DRAM
    gemm, read = [], []
    for _ in range(5):
        t = time.perf_counter()
        a @ a
        gemm.append(2 * 1024**3 / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        big.sum()
        read.append(big.nbytes / (time.perf_counter() - t) / 1e9)
    return {"load_avg_1m": os.getloadavg()[0], "sgemm_gflops": float(np.median(gemm)), "read_gb_s": float(np.median(read))}


def engine(mode: str, bundle: Path, *extra: str) -> list[str]:
    return [PYTHON, "loadtest/bench_engine.py", mode, str(bundle), *extra]


def part_quality(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    return run_json([PYTHON, "loadtest/bench_quality.py", str(dirs["fp32"]), *(str(dirs[s]) for s in SCHEMES), "--steps", "5"])


def part_single(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    out = []
    for precision in ("fp32", *SCHEMES):
        for steps in (10, 5):
            cmd = engine("single", dirs[precision], "--reps", str(args.reps), "--n-timesteps", str(steps))
            out.append(run_json(cmd) | {"label": precision})
    return out


def part_reference(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    # Passive OpenMP waits: with spinning workers torch slows down ~10x whenever another process shares
    # the two cores (measured on this machine); the engine's ORT pools do not spin either.
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [PYTHON, "loadtest/bench_reference.py", "--tokens", "250", "--text-tokens", "48", "--reps", str(args.reference_reps)]
    return run_json(cmd, env=env)


LATENCY_SETUPS = (  # (label, bundle, flow steps, extra engine options)
    ("int8", "int8", 10, ()),
    ("int8", "int8", 5, ()),
    ("fp32", "fp32", 10, ()),
    ("int4", "int4", 10, ()),
    # the schedule before first-audio priority and the 21-token first hop, measured in the same run
    ("int8, no first-audio priority", "int8", 10, ("--first-hop", "30", "--no-first-audio-priority")),
)


def part_latency(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    out = []
    for label, precision, steps, extra in LATENCY_SETUPS:
        cmd = engine("latency", dirs[precision], "--text", "short", "--tokens", "200", "--reps", str(2 * args.reps + 1))
        out.append(run_json([*cmd, "--n-timesteps", str(steps), *extra]) | {"label": label})
    return out


CONCURRENCY_SETUPS = (  # (label, flow steps, extra engine options)
    ("int8, 10 steps", 10, ()),
    ("int8, 5 steps", 5, ()),
    ("int8, 10 steps, acoustic 1 thread x 2 slots", 10, ("--acoustic-threads", "1", "--acoustic-slots", "2")),
)


def part_concurrency(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    out = []
    for label, steps, extra in CONCURRENCY_SETUPS:
        cmd = engine("concurrency", dirs["int8"], "--text", "short", "--tokens", "200", "--n-timesteps", str(steps), *extra)
        out.append(run_json([*cmd, "--levels", *map(str, args.levels), "--per-client", str(args.per_client)]) | {"label": label})
    return out


def part_http(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    cmd = [PYTHON, "loadtest/bench_http.py", "load", str(dirs["int8"]), "--levels", *map(str, args.levels)]
    return run_json([*cmd, "--per-client", str(args.per_client)])


def part_cloning(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """A saved (cloned) voice with a 10 s prompt against a built-in speaker, same run: first audio at 1 and 8
    clients (int8, 10 steps, streamed), and the time to analyse a 10 s prompt (features; tiny stand-in models)."""
    out: dict[str, Any] = {"prompt": run_json([PYTHON, "loadtest/bench_prompt.py", "--seconds", "10", "--reps", "5"])}
    for label, extra in (("built-in speaker", ()), ("saved voice, 10 s prompt", ("--prompt-seconds", "10"))):
        cmd = engine("concurrency", dirs["int8"], "--text", "short", "--tokens", "200", "--n-timesteps", "10", *extra)
        out[label] = run_json([*cmd, "--levels", "1", "8", "--per-client", str(args.cloning_per_client)]) | {"label": label}
    return out


# A row of the default settings at one client again, under another name (acoustic_backend=ort has been the default's
# runtime since OpenVINO left serving): the spread between it and the default row is this host's run-to-run noise.
AGAIN = "the defaults again (acoustic_backend=ort, the default runtime): run-to-run spread"
LISTEN_COMPARE = (  # (label, server settings): what each lever of the speed issue changes, against the defaults above
    (AGAIN, ("TTS_ENGINE_PROFILE=acoustic_backend=ort",)),
    ("the whole prompt in every chunk (prompt_window_s=all)", ("TTS_ENGINE_PROFILE=prompt_window_s=all",)),
    (
        "the schedule before this issue: ORT, whole prompt, first hop 21 then 100",
        ("TTS_ENGINE_PROFILE=acoustic_backend=ort,prompt_window_s=all,stream_schedule=official,first_hop_tokens=21",),
    ),
)


def part_listen(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """What a listener hears (first audio, TTCA, stall) over HTTP: the default settings at 1, 2 and 4 clients for a
    built-in speaker and saved voices from 3 s and 10 s recordings, then each lever's setting at 1 client."""
    cmd = [PYTHON, "loadtest/bench_listen.py", str(dirs["int8"]), "--per-client", str(args.per_client + 1)]
    out: dict[str, Any] = {"default": run_json([*cmd, "--levels", "1", "2", "4", "8"])}
    out["compare"] = {label: run_json([*cmd, "--levels", "1", "--env", *env]) for label, env in LISTEN_COMPARE}
    out["memory_limit"] = run_json(memory_limit_row(cmd))
    return out


V2_PARTS = ("listen2", "listen3")  # parts that build their own bundle (not the v1 ones)
# Requests of the one-client rows with the default settings, where the targets are read: a p50 of 3 let one slow request
# decide a headline (docs/perf-log.md); the lever rows keep 3.
ONE_CLIENT_REQUESTS = 7
LISTEN2_COMPARE = (  # (label, server settings): each CosyVoice2 lever switched back to the official computation
    ("official schedule: first hop 25 + pad, then 50, 100", ("TTS_ENGINE_PROFILE=stream_schedule=official",)),
    ("the whole prompt in the flow (prompt_window_s=all)", ("TTS_ENGINE_PROFILE=prompt_window_s=all",)),
    ("two-thread acoustic calls, no CFG lanes (acoustic_threads=2)", ("TTS_ENGINE_PROFILE=acoustic_threads=2",)),
    (AGAIN, ("TTS_ENGINE_PROFILE=acoustic_backend=ort",)),
    ("ONNX Runtime's graphs, not our kernels (native_kernels=off)", ("TTS_ENGINE_PROFILE=native_kernels=off",)),
    ("our kernels without AMX tiles (the default without AMX)", ("TTS_ENGINE_PROFILE=native_kernels=no-amx",)),
    ("decode steps never pause for the flow (decode_lead_tokens=0)", ("TTS_ENGINE_PROFILE=decode_lead_tokens=0",)),
    (
        "the engine before this work: all three engine levers off",
        ("TTS_ENGINE_PROFILE=stream_schedule=official,prompt_window_s=all,acoustic_threads=2",),
    ),
)  # fmt: skip


def part_listen2(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """CosyVoice2-0.5B over HTTP (full-size random-init int8, 125 forced tokens = 5 s): the default settings at 1, 2
    and 4 clients for a built-in speaker and saved voices from 3 s and 10 s recordings, then each lever off at 1 client."""
    bundle = ensure_v2_bundle(args.models)
    cmd = [PYTHON, "loadtest/bench_listen.py", str(bundle), "--per-client", str(args.per_client + 1)]
    default = [*cmd, "--levels", "1", "2", "4", "8", "--one-client-requests", str(ONE_CLIENT_REQUESTS)]
    out: dict[str, Any] = {"default": run_json(default)}
    out["compare"] = {label: run_json([*cmd, "--levels", "1", "--env", *env]) for label, env in LISTEN2_COMPARE}
    out["memory_limit"] = run_json(memory_limit_row(cmd))
    return out


def memory_limit_row(cmd: list[str]) -> list[str]:
    """8 clients of the 10 s saved voice under TTS_MEMORY_LIMIT=2G: every answer must be audio or a 503 with
    Retry-After (`refused`), never a failure, and the server's peak RSS within the limit."""
    return [*cmd, "--levels", "8", "--prompt-seconds", "10", "--env", "TTS_MEMORY_LIMIT=2G"]


LISTEN3_COMPARE = (  # (label, server settings): each Fun-CosyVoice3 departure switched back to the official computation
    ("official schedule and recompute stream", ("TTS_ENGINE_PROFILE=stream_schedule=official",)),
    ("the whole prompt in the flow (prompt_window_s=all)", ("TTS_ENGINE_PROFILE=prompt_window_s=all",)),
    ("every generated frame attended to (flow_window_s=all)", ("TTS_ENGINE_PROFILE=flow_window_s=all",)),
)


def part_listen3(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """Fun-CosyVoice3-0.5B over HTTP (full-size random-init int8, 125 forced tokens = 5 s), as listen2: the default
    settings at 1, 2 and 4 clients for a built-in speaker and saved voices, then each official switch at 1 client, then
    8 clients of the 10 s voice under a 2 GB memory limit."""
    bundle = ensure_v3_bundle(args.models)
    cmd = [PYTHON, "loadtest/bench_listen.py", str(bundle), "--per-client", str(args.per_client + 1)]
    default = [*cmd, "--levels", "1", "2", "4", "--one-client-requests", str(ONE_CLIENT_REQUESTS)]
    out: dict[str, Any] = {"default": run_json(default)}
    out["compare"] = {label: run_json([*cmd, "--levels", "1", "--env", *env]) for label, env in LISTEN3_COMPARE}
    out["memory_limit"] = run_json(memory_limit_row(cmd))
    return out


def part_parity(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """`python -m service verify` of the committed tiny bundle against the official implementation's fixtures."""
    cmd = [PYTHON, "-m", "service", "verify", "--bundle", "models/tiny", "--fixtures", "tests/reference/tiny"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    last = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr.strip()[-200:]
    return {"passed": done.returncode == 0, "summary": last}


def part_websocket(dirs: dict[str, Path], args: argparse.Namespace) -> Any:
    """WebSocket first audio (text in LLM-paced deltas) against one HTTP request with the same sentence, same server."""
    return run_json([PYTHON, "loadtest/ws_latency.py", str(dirs["int8"]), "--reps", str(args.reps)])


RUNNERS = {
    "parity": part_parity,
    "listen": part_listen,
    "quality": part_quality,
    "single": part_single,
    "reference": part_reference,
    "latency": part_latency,
    "concurrency": part_concurrency,
    "http": part_http,
    "cloning": part_cloning,
    "websocket": part_websocket,
    "listen2": part_listen2,
    "listen3": part_listen3,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", type=Path, default=REPO / "models", help="where the full-size bundles are cached")
    p.add_argument("--out", type=Path, default=REPO / "docs" / "benchmarks", help="JSON and PNG directory")
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "benchmarks.md")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--reps", type=int, default=3, help="repetitions of each single-stream measurement")
    p.add_argument("--reference-reps", type=int, default=1)
    p.add_argument("--levels", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--per-client", type=int, default=2)
    p.add_argument("--cloning-per-client", type=int, default=2, help="requests per client in the cloning part")
    p.add_argument("--merge", action="store_true", help="keep earlier results of parts not run now")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    v1_parts = [p for p in args.parts if p not in V2_PARTS]
    dirs = ensure_bundles(args.models) if v1_parts else bundle_dirs(args.models)  # CosyVoice2 parts build their own
    results_path = args.out / "results.json"
    results: dict[str, Any] = json.loads(results_path.read_text()) if args.merge and results_path.is_file() else {}
    results["machine"] = {
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu_summary(),
        "before": machine_state(),
    }
    runs: dict[str, Any] = results.setdefault("part_runs", {})  # which run measured each part (kept by --merge)
    args.out.mkdir(parents=True, exist_ok=True)
    for part in args.parts:
        results[part] = RUNNERS[part](dirs, args)
        runs[part] = {"started": results["machine"]["started"], "cpu": results["machine"]["cpu"]}
        results["machine"]["after_" + part] = machine_state()
        results_path.write_text(json.dumps(results, indent=1) + "\n")  # after every part: a later failure keeps it
    write_report(results, args.out, args.doc, REPO / "README.md")
    log(f"wrote {results_path}, the plots in {args.out}, {args.doc} and the README's tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
