"""The README's generated blocks for tiny-cosyvoice3: file, prompt, case, stream, HiFT, recompute and tolerance tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cv2_reference import output
from cv2_reference.readme_tables import _table, prompts_table, recompute_lines, tolerance_lines

from cv3_reference.descriptions import describe_array

MODES = ("zero_shot", "cross_lingual", "instruct2")


def case_sizes(out: Path) -> dict[str, dict[str, int]]:
    """Token counts per mode case (text ids, prompt-text ids, forced and flow tokens), read from the mode npz files."""
    import numpy as np

    sizes = {}
    for mode in MODES:
        with np.load(out / f"{mode}.npz") as arrays:
            for case in sorted({name.split("_")[0] for name in arrays.files}):
                n = {k: len(arrays[f"{case}_{k}"]) for k in ("mi_text", "forced_tokens", "flow_tokens")}
                if f"{case}_mi_prompt_text" in arrays.files:
                    n["mi_prompt_text"] = len(arrays[f"{case}_mi_prompt_text"])
                sizes[f"{mode}/{case.removeprefix('case')}"] = n
    return sizes


def cases_table(meta: dict[str, Any], ids: dict[str, dict[str, int]]) -> str:
    header = ["file / case", "prompt", "prompt text / instruct (raw)", "tts text (raw)", "normalized", "text ids"]
    header += ["prompt-text ids", "forced / flow tokens", "prefill L", "P_tok / P frames", "T frames", "samples", "seed"]
    rows = []
    for mode in MODES:
        for i, c in enumerate(meta[mode]):
            n = ids[f"{mode}/{i}"]
            rows.append(
                [
                    f"{mode}.npz case{i}",
                    c["prompt"],
                    c["prompt_text"] or c["instruct_text"] or "-",
                    c["tts_text"],
                    " / ".join(c["tts_text_normalized"]),
                    n["mi_text"],
                    n.get("mi_prompt_text", 0),
                    f"{n['forced_tokens']} / {n['flow_tokens']}",
                    c["prefill_len"],
                    f"{c['prompt_tokens']} / {c['prompt_mel_frames']}",
                    c["tts_mel_frames"],
                    c["samples"],
                    c["torch_seed"],
                ]
            )
    return _table(header, rows)


def streams_table(meta: dict[str, Any]) -> str:
    header = ["run", "chunk", "token_offset", "tokens given (all from 0)", "finalize", "flow streaming"]
    header += ["frames solved (prompt + all)", "new mel frames", "HiFT mel frames (history)", "HiFT out samples"]
    header += ["yielded samples", "earlier samples re-run: max abs diff"]
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
                    s["chunk_hift_out_samples"][k],
                    s["chunk_yielded_samples"][k],
                    f"{m['hift_recompute'][k]['earlier_samples_max_abs']:.1e}",
                ]
            )
    return _table(header, rows)


def hift_table(meta: list[dict[str, Any]]) -> str:
    header = ["case", "mel", "finalize", "f0", "f0 frames", "voiced frames", "source samples", "speech samples"]
    mel = {0: "flow mel of zero_shot case 0 (first frames)", 1: "synthetic `randn * 2 - 5` (generator seed 7)"}
    rows = [
        [
            m["case"],
            f"{mel.get(m['case'], 'as case 1')} [{m['mel_frames']} frames]",
            m["finalize"],
            "injected contour (0 Hz, then 120-220 Hz ramp + 20 Hz wobble)" if m["f0_overridden"] else "predicted",
            m["f0_frames"],
            m["voiced_frames"],
            m["source_samples"],
            m["speech_samples"],
        ]
        for m in meta
    ]
    return _table(header, rows)


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
