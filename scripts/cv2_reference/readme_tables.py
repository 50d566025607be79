"""The README's generated blocks: file table, prompt / case / stream tables, tolerances, one array table per npz."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cv2_reference import output
from cv2_reference.descriptions import describe_array

MODES = ("zero_shot", "cross_lingual", "instruct2")


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    return "\n".join([_row(header), _row(["---"] * len(header)), *(_row(r) for r in rows)])


def prompts_table(meta: dict[str, Any]) -> str:
    header = ["prompt", "rate / channels / frames", "transcript", "16 kHz samples", "24 kHz samples", "fbank frames"]
    header += ["whisper frames", "speech tokens", "mel80 frames", "after trim: tokens / mel frames", "min FSQ margin"]
    rows = [
        [
            name,
            f"{p['sample_rate']} / {p['channels']} / {p['frames']}",
            p["prompt_text"],
            p["samples_16k"],
            p["samples_24k"],
            p["fbank_frames"],
            p["whisper_mel_frames"],
            p["speech_tokens"],
            p["mel80_frames"],
            f"{p['trimmed_tokens']} / {p['trimmed_mel_frames']}",
            "-" if p["min_fsq_margin"] is None else f"{p['min_fsq_margin']:.1e}",
        ]
        for name, p in meta.items()
    ]
    return _table(header, rows)


def case_sizes(out: Path) -> dict[str, dict[str, int]]:
    """Token counts per mode case (text ids, prompt-text ids, forced tokens), read from the mode npz files."""
    import numpy as np

    sizes = {}
    for mode in MODES:
        with np.load(out / f"{mode}.npz") as arrays:
            cases = sorted({name.split("_")[0] for name in arrays.files})
            for case in cases:
                n = {"text": len(arrays[f"{case}_mi_text"]), "forced": len(arrays[f"{case}_forced_tokens"])}
                if f"{case}_mi_prompt_text" in arrays.files:
                    n["prompt_text"] = len(arrays[f"{case}_mi_prompt_text"])
                sizes[f"{mode}/{case.removeprefix('case')}"] = n
    return sizes


def cases_table(meta: dict[str, Any], ids: dict[str, dict[str, int]]) -> str:
    header = ["file / case", "prompt", "instruct (raw)", "tts text (raw)", "normalized", "text ids", "prompt-text ids"]
    header += ["forced tokens", "prefill L", "P_tok / P frames", "T frames", "samples", "torch seed"]
    rows = []
    for mode in MODES:
        for i, c in enumerate(meta[mode]):
            n = ids[f"{mode}/{i}"]
            rows.append(
                [
                    f"{mode}.npz case{i}",
                    c["prompt"],
                    c["instruct_text"] or "-",
                    c["tts_text"],
                    " / ".join(c["tts_text_normalized"]),
                    n["text"],
                    n.get("prompt_text", 0),
                    n["forced"],
                    c["prefill_len"],
                    f"{c['prompt_tokens']} / {c['prompt_mel_frames']}",
                    c["tts_mel_frames"],
                    c["samples"],
                    c["torch_seed"],
                ]
            )
    return _table(header, rows)


def streams_table(meta: dict[str, Any]) -> str:
    header = [
        "run",
        "chunk",
        "token_offset",
        "tokens given (all from 0)",
        "finalize",
        "flow streaming",
        "frames solved (prompt + all)",
    ]
    header += ["new mel frames", "HiFT mel frames", "cache_source samples", "yielded samples"]
    rows = []
    for run, m in meta.items():
        s = m["schedule"]
        for k, offset in enumerate(s["chunk_offset"]):
            rows.append(
                [
                    f"{run} ({m['mode']}, {m['prompt']}, {m['forced_tokens']} tokens)" if k == 0 else "",
                    k,
                    offset,
                    s["chunk_token_len"][k],
                    s["chunk_finalize"][k],
                    s["chunk_flow_streaming"][k],
                    s["chunk_flow_frames"][k],
                    s["chunk_new_mel_frames"][k],
                    s["chunk_hift_mel_frames"][k],
                    s["chunk_cache_source_samples"][k],
                    s["chunk_yielded_samples"][k],
                ]
            )
    return _table(header, rows)


def hift_table(meta: list[dict[str, Any]]) -> str:
    header = ["case", "mel", "f0", "voiced frames", "cache_source samples", "torch seed"]
    mel = {0: "flow mel of zero_shot case 0 (first frames)", 1: "synthetic `randn * 2 - 5` (generator seed 7)"}
    rows = [
        [
            m["case"],
            f"{mel.get(m['case'], 'as case 1')} [{m['mel_frames']} frames]",
            "injected contour (0 Hz, then 120-220 Hz ramp + 20 Hz wobble)" if m["f0_overridden"] else "predicted",
            m["voiced_frames"],
            m["cache_source_samples"],
            m["torch_seed"],
        ]
        for m in meta
    ]
    return _table(header, rows)


def recompute_lines(meta: dict[str, Any]) -> str:
    lines = []
    for run, m in meta.items():
        for k, d in enumerate(m["recompute"], start=1):
            what = "final call (full attention)" if d["final_call"] else "next chunk (chunk masks)"
            lines.append(
                f"* `{run}` call {k} vs call {k - 1}, {what}: the {d['frames_compared']} frames both computed differ by "
                f"{d['mel_max_abs']:.1e} (mel) and {d['mu_max_abs']:.1e} (mu) at most"
            )
    return "\n".join(lines)


def tolerance_lines(tolerance: dict[str, Any]) -> str:
    lines = []
    for name, result in tolerance.items():
        kinds = result["float_max_abs_by_kind"]
        nonzero = sorted(((v, k) for k, v in kinds.items() if v > 0), reverse=True)
        top = ", ".join(f"{k} {v:.1e}" for v, k in nonzero[:10]) or "none"
        ints = ", ".join(result["integer_arrays_differing"]) or "none"
        lines.append(
            f"* `{name}`: integer arrays differing: {ints}; float kinds differing: {len(nonzero)} of {len(kinds)}; largest: {top}"
        )
    return "\n".join(lines)


def refresh(out: Path, readme: Path) -> None:
    """Rewrite the generated blocks of `readme` from the fixture files and fixtures_meta.json in `out`."""
    import json

    meta = json.loads((out / "fixtures_meta.json").read_text(encoding="utf-8"))
    output.fill_generated(readme, blocks(out, meta))


def blocks(out: Path, meta: dict[str, Any]) -> dict[str, str]:
    """Every generated block of the README, from the fixture files in `out` and the run's metadata."""
    result = {
        "files": output.file_table(out),
        "prompts": prompts_table(meta["prompts"]),
        "cases": cases_table(meta, case_sizes(out)),
        "streams": streams_table(meta["stream"]),
        "recompute": recompute_lines(meta["stream"]),
        "hift": hift_table(meta["hift"]),
    }
    if "tolerance" in meta:
        result["tolerance"] = tolerance_lines(meta["tolerance"])
    npz = sorted(path.stem for path in out.glob("*.npz"))
    result.update({f"arrays_{name}": output.array_table(out / f"{name}.npz", describe_array) for name in npz})
    return result
