"""stream=True calls chunk by chunk (CosyVoice3Model.token2wav: DiT flow, causal HiFT re-run over the mel history) and
direct HiFT cases."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from cv2_reference.stream_fixtures import _final_with_chunk_masks, _recompute_diffs, fresh_schedule, stream_token_count

from cv3_reference import capture
from cv3_reference.capture import hift_direct
from cv3_reference.cases import StreamCase
from cv3_reference.mode_fixtures import (
    TOKEN_MEL_RATIO,
    estimator_step1,
    forced_tokens,
    official_call,
    silence_filtered,
)

SAMPLES_PER_FRAME = 480
HIFT_FRAMES = 24


def _chunk_arrays(call: dict[str, Any], t2w: dict[str, Any], hift: dict[str, Any], yielded: np.ndarray) -> dict[str, np.ndarray]:
    new = TOKEN_MEL_RATIO * t2w["token_offset"]
    p = call["prompt_feat"].shape[1]
    out = {
        "flow_new_mu": call["mu"][0, :, p + new :],
        "flow_new_mel": call["feat"][0, :, new:],
        "hift_f0": hift["f0"][0],
        "yielded": yielded[0],
    }
    if t2w["finalize"]:
        out.update(flow_solver_out=call["solver_out"][0], hift_source=hift["source"][0, 0])
    return out


def _hift_recompute(hifts: list[dict[str, Any]], yielded: list[np.ndarray]) -> list[dict[str, Any]]:
    """How far each HiFT re-run's samples before the speech offset are from the audio yielded earlier for them."""
    rows, history = [], np.zeros(0, dtype=np.float32)
    for hift, chunk in zip(hifts, yielded, strict=True):
        speech = hift["speech"][0]
        n = history.shape[0]
        rows.append(
            {
                "hift_mel_frames": int(hift["mel"].shape[2]),
                "finalize": hift["finalize"],
                "hift_out_samples": int(speech.shape[0]),
                "speech_offset": n,
                "earlier_samples_max_abs": float(np.abs(speech[:n] - history).max()) if n else 0.0,
            }
        )
        assert np.array_equal(speech[n:], chunk[0])
        history = np.concatenate([history, chunk[0]])
    return rows


def stream_case(
    cv: Any, sc: StreamCase, prompts_dir: Path, prompt_tokens: int, full: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One official stream=True call, every token2wav call recorded; arrays prefixed with `sc.name`."""
    from cv2_reference.mode_fixtures import model_input_arrays

    n = stream_token_count(prompt_tokens, sc.hops, sc.tail)
    fresh_schedule(cv)
    forced = forced_tokens(sc.case, n)
    cap = capture.run(cv, official_call(cv, sc.case, prompts_dir, stream=True), forced, sc.case.seed)
    calls, t2ws, hifts = cap.flow_calls, cap.token2wav_calls, cap.hift_calls
    assert len(calls) == len(t2ws) == len(hifts) == len(cap.yielded)
    assert t2ws[-1]["token"][0].tolist() == silence_filtered(forced)
    arrays = {f"{sc.name}_{k}": v for k, v in model_input_arrays(cap).items()}
    arrays[f"{sc.name}_forced_tokens"] = np.array(forced, dtype=np.int32)
    mel_history = np.zeros((1, 80, 0), dtype=np.float32)
    for k, (call, t2w, hift, yielded) in enumerate(zip(calls, t2ws, hifts, cap.yielded, strict=True)):
        assert call["streaming"] == (not t2w["finalize"]) and call["finalize"] == t2w["finalize"] == hift["finalize"]
        mel_history = np.concatenate([mel_history, call["feat"][:, :, TOKEN_MEL_RATIO * t2w["token_offset"] :]], axis=2)
        assert np.array_equal(hift["mel"], mel_history), "HiFT did not get the whole mel history"
        chunk = _chunk_arrays(call, t2w, hift, yielded)
        if full and k == 1:
            chunk.update({k2: v for k2, v in estimator_step1(call).items() if k2 == "est1_out"})
        arrays.update({f"{sc.name}_k{k}_{name}": value for name, value in chunk.items()})
    table = {
        "chunk_offset": [t["token_offset"] for t in t2ws],
        "chunk_token_len": [int(t["token"].shape[1]) for t in t2ws],
        "chunk_finalize": [t["finalize"] for t in t2ws],
        "chunk_flow_streaming": [c["streaming"] for c in calls],
        "chunk_flow_frames": [int(c["mu"].shape[2]) for c in calls],
        "chunk_new_mel_frames": [
            int(c["feat"].shape[2]) - TOKEN_MEL_RATIO * t["token_offset"] for c, t in zip(calls, t2ws, strict=True)
        ],
        "chunk_hift_mel_frames": [int(h["mel"].shape[2]) for h in hifts],
        "chunk_hift_out_samples": [int(h["speech"].shape[1]) for h in hifts],
        "chunk_yielded_samples": [int(y.shape[1]) for y in cap.yielded],
    }
    arrays.update({f"{sc.name}_{k}": np.array(v) for k, v in table.items()})
    meta: dict[str, Any] = {
        "mode": sc.case.mode,
        "prompt": sc.case.prompt,
        "prompt_text": sc.case.prompt_text,
        "tts_text": sc.case.tts_text,
        "instruct_text": sc.case.instruct_text or None,
        "torch_seed": sc.case.seed,
        "forced_tokens": n,
        "forced_tokens_from": f"numpy RandomState({sc.case.seed}).randint(0, 6561, {n})",
        "prompt_tokens": prompt_tokens,
        "schedule": table,
        "recompute": _recompute_diffs(calls),
        "hift_recompute": _hift_recompute(hifts, cap.yielded),
    }
    if full:
        extra = _final_with_chunk_masks(cv, calls[-1], t2ws[-1]["token_offset"])
        arrays[f"{sc.name}_extra_final_chunkmask_new_mel"] = extra
        meta["final_chunk_chunkmask_vs_official_max_abs"] = float(
            np.abs(extra - arrays[f"{sc.name}_k{len(calls) - 1}_flow_new_mel"]).max()
        )
    return arrays, meta


def hift_cases(cv: Any, mel: np.ndarray) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """HiFT alone: a flow mel; a synthetic mel with a voiced f0 contour injected, with finalize True and False."""
    import torch

    synthetic = (torch.randn(1, 80, HIFT_FRAMES, generator=torch.Generator().manual_seed(7)) * 2 - 5).numpy()
    frames = np.arange(HIFT_FRAMES)
    contour = np.where(frames < 8, 0.0, 120.0 + 100.0 * (frames - 8) / (HIFT_FRAMES - 9) + 20.0 * np.sin(frames / 3.0))
    cases = [(mel[None, :, :HIFT_FRAMES], None, True), (synthetic, contour, True), (synthetic, contour, False)]
    arrays: dict[str, np.ndarray] = {}
    meta = []
    for i, (feat, contour_f0, finalize) in enumerate(cases):
        call = hift_direct(cv.model.hift, feat, contour_f0, finalize)
        arrays.update({f"case{i}_mel": feat[0], f"case{i}_f0": call["f0"][0], f"case{i}_source": call["source"][0, 0]})
        arrays[f"case{i}_speech"] = call["speech"][0]
        meta.append(
            {
                "case": i,
                "mel_frames": int(feat.shape[2]),
                "finalize": finalize,
                "f0_overridden": contour_f0 is not None,
                "f0_frames": int(call["f0"].shape[1]),
                "voiced_frames": int((call["f0"] > 10).sum()),
                "source_samples": int(call["source"].shape[2]),
                "speech_samples": int(call["speech"].shape[1]),
            }
        )
    return arrays, meta


def rand_ini_reaches_output(cv: Any) -> dict[str, Any]:
    """Run the voiced HiFT case again with SineGen2.rand_ini replaced by other values: does the output change?"""
    import torch

    synthetic = (torch.randn(1, 80, HIFT_FRAMES, generator=torch.Generator().manual_seed(7)) * 2 - 5).numpy()
    contour = np.full(HIFT_FRAMES, 150.0)
    sine_gen = cv.model.hift.m_source.l_sin_gen
    official = sine_gen.rand_ini
    before = hift_direct(cv.model.hift, synthetic, contour, True)["speech"]
    sine_gen.rand_ini = torch.rand(1, 9, generator=torch.Generator().manual_seed(11))  # this instance only
    try:
        after = hift_direct(cv.model.hift, synthetic, contour, True)["speech"]
    finally:
        sine_gen.rand_ini = official
    return {"confirmed_no_effect": bool(np.array_equal(before, after)), "max_abs": float(np.abs(before - after).max())}
