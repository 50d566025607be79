"""stream=True calls chunk by chunk (CosyVoice2Model.tts / token2wav), the HiFT cases and the official defects checked."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np

from cv2_reference import capture
from cv2_reference.cases import StreamCase
from cv2_reference.mode_fixtures import estimator_step1, forced_tokens, hift_arrays, model_input_arrays, official_call
from cv2_reference.recorder import observed_rng, to_numpy

FIRST_HOP = 25  # CosyVoice2Model.token_hop_len on a freshly built model
LOOKAHEAD = 3  # flow.pre_lookahead_len
TOKEN_MEL_RATIO = 2
HIFT_FRAMES = 24  # the HiFT cases keep every random draw: 24 frames = 11,520 samples x 9 harmonics


def stream_token_count(prompt_tokens: int, hops: tuple[int, ...], tail: int) -> int:
    """Forced tokens that give the official loop a first chunk, then `hops`, then a final chunk of `tail` tokens."""
    pad = math.ceil(prompt_tokens / FIRST_HOP) * FIRST_HOP - prompt_tokens
    return FIRST_HOP + pad + sum(hops) + tail


def fresh_schedule(cv: Any) -> None:
    """The official tts() doubles model.token_hop_len and never resets it: start each stream like a new model."""
    cv.model.token_hop_len = FIRST_HOP


def _chunk_arrays(call: dict[str, Any], t2w: dict[str, Any], hift: dict[str, Any], yielded: np.ndarray) -> dict[str, np.ndarray]:
    offset, p = t2w["token_offset"], call["prompt_feat"].shape[1]
    new = TOKEN_MEL_RATIO * offset
    out = {
        "flow_new_mu": call["mu"][0, :, p + new :],
        "flow_new_mel": call["feat"][0, :, new:],
        **{k: v for k, v in hift_arrays(hift, None).items() if k != "hift_speech"},
        "yielded": yielded[0],
    }
    cache = t2w["cache_in"]
    expected_mel = call["feat"][:, :, new:] if cache is None else np.concatenate([cache["mel"], call["feat"][:, :, new:]], axis=2)
    assert np.array_equal(hift["mel"], expected_mel) and np.array_equal(t2w["speech"], yielded)
    if t2w["cache_out"] is not None:
        out["speech_tail"] = t2w["cache_out"]["speech"][0]
    if t2w["finalize"]:
        out["flow_mu"], out["flow_solver_out"] = call["mu"][0], call["solver_out"][0]
    return out


def _recompute_diffs(calls: list[dict[str, Any]]) -> list[dict[str, float]]:
    """How far each call's recomputed earlier frames are from what the previous call produced for them."""
    diffs = []
    for prev, cur in itertools.pairwise(calls):
        frames = prev["feat"].shape[2]
        p = prev["prompt_feat"].shape[1]
        diffs.append(
            {
                "frames_compared": int(frames),
                "mel_max_abs": float(np.abs(cur["feat"][..., :frames] - prev["feat"]).max()),
                "mu_max_abs": float(np.abs(cur["mu"][..., : p + frames] - prev["mu"]).max()),
                "final_call": bool(cur["finalize"]),
            }
        )
    return diffs


def _final_with_chunk_masks(cv: Any, call: dict[str, Any], offset: int) -> np.ndarray:
    """Harness extra, not an official output: the final call's new frames had it used streaming=True (chunk masks)."""
    import torch

    args = {k: torch.from_numpy(call[k]) for k in ("token", "prompt_token", "prompt_feat", "embedding")}
    with torch.inference_mode():
        feat, _ = cv.model.flow.inference(
            token=args["token"].int(),
            token_len=torch.tensor([args["token"].shape[1]], dtype=torch.int32),
            prompt_token=args["prompt_token"].int(),
            prompt_token_len=torch.tensor([args["prompt_token"].shape[1]], dtype=torch.int32),
            prompt_feat=args["prompt_feat"],
            prompt_feat_len=torch.tensor([args["prompt_feat"].shape[1]], dtype=torch.int32),
            embedding=args["embedding"],
            streaming=True,
            finalize=True,
        )
    return to_numpy(feat)[0, :, TOKEN_MEL_RATIO * offset :]


def stream_case(
    cv: Any, sc: StreamCase, prompts_dir: Path, prompt_tokens: int, full: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One official stream=True call, every token2wav call recorded; arrays prefixed with `sc.name`."""
    n = stream_token_count(prompt_tokens, sc.hops, sc.tail)
    fresh_schedule(cv)
    cap = capture.run(cv, official_call(cv, sc.case, prompts_dir, stream=True), forced_tokens(sc.case.seed, n), sc.case.seed)
    calls, t2ws = cap.flow_calls, cap.token2wav_calls
    assert len(calls) == len(t2ws) == len(cap.hift_calls) == len(cap.yielded)
    arrays = {f"{sc.name}_{k}": v for k, v in model_input_arrays(cap).items()}
    arrays[f"{sc.name}_forced_tokens"] = np.array(cap.forced.tokens, dtype=np.int32)
    for k, (call, t2w, hift, yielded) in enumerate(zip(calls, t2ws, cap.hift_calls, cap.yielded, strict=True)):
        assert call["streaming"] == (not t2w["finalize"]) and call["finalize"] == t2w["finalize"]
        chunk = _chunk_arrays(call, t2w, hift, yielded)
        if full and k == 1:
            chunk.update(estimator_step1(call))
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
        "chunk_hift_mel_frames": [int(h["mel"].shape[2]) for h in cap.hift_calls],
        "chunk_cache_source_samples": [int(h["cache_source"].shape[2]) for h in cap.hift_calls],
        "chunk_yielded_samples": [int(y.shape[1]) for y in cap.yielded],
    }
    arrays.update({f"{sc.name}_{k}": np.array(v) for k, v in table.items()})
    meta: dict[str, Any] = {
        "mode": sc.case.mode,
        "prompt": sc.case.prompt,
        "tts_text": sc.case.tts_text,
        "instruct_text": sc.case.instruct_text or None,
        "torch_seed": sc.case.seed,
        "forced_tokens": n,
        "forced_tokens_from": f"numpy RandomState({sc.case.seed}).randint(0, 6561, {n})",
        "prompt_tokens": prompt_tokens,
        "schedule": table,
        "recompute": _recompute_diffs(calls),
    }
    if full:
        extra = _final_with_chunk_masks(cv, calls[-1], t2ws[-1]["token_offset"])
        arrays[f"{sc.name}_extra_final_chunkmask_new_mel"] = extra
        meta["final_chunk_chunkmask_vs_official_max_abs"] = float(
            np.abs(extra - arrays[f"{sc.name}_k{len(calls) - 1}_flow_new_mel"]).max()
        )
    return arrays, meta


def hift_cases(cv: Any, mel: np.ndarray) -> tuple[dict[str, np.ndarray], list[dict[str, Any]]]:
    """HiFT alone with every random draw kept: a flow mel, a synthetic mel with a voiced f0 contour, then with cache_source."""
    import torch

    synthetic = (torch.randn(1, 80, HIFT_FRAMES, generator=torch.Generator().manual_seed(7)) * 2 - 5).numpy()
    frames = np.arange(HIFT_FRAMES)
    contour = np.where(frames < 8, 0.0, 120.0 + 100.0 * (frames - 8) / (HIFT_FRAMES - 9) + 20.0 * np.sin(frames / 3.0)).astype(
        np.float32
    )
    cases = [(mel[None, :, :HIFT_FRAMES], None, 0), (synthetic, contour, 0), (synthetic, contour, 3840)]
    arrays: dict[str, np.ndarray] = {}
    meta = []
    previous_source = None
    for i, (feat, f0_override, cache_len) in enumerate(cases):
        hook = None
        if f0_override is not None:
            hook = cv.model.hift.f0_predictor.register_forward_hook(lambda _m, _i, _o, f=f0_override: torch.from_numpy(f)[None])
        cache = torch.zeros(1, 1, 0) if cache_len == 0 else torch.from_numpy(previous_source[:, :, -cache_len:])
        draws: list[tuple[str, np.ndarray]] = []
        torch.manual_seed(7000 + i)
        with torch.inference_mode(), observed_rng(draws):
            speech, source = cv.model.hift.inference(speech_feat=torch.from_numpy(feat), cache_source=cache)
        if hook is not None:
            hook.remove()
        f0 = f0_override if f0_override is not None else to_numpy(cv.model.hift.f0_predictor(torch.from_numpy(feat)))[0]
        previous_source = to_numpy(source)
        arrays.update({f"case{i}_mel": feat[0], f"case{i}_f0": f0, f"case{i}_rand_ini": draws[0][1][0]})
        arrays.update({f"case{i}_sine_noise": draws[1][1][0], f"case{i}_source": previous_source[0, 0]})
        arrays.update({f"case{i}_cache_source": to_numpy(cache)[0, 0], f"case{i}_speech": to_numpy(speech)[0]})
        meta.append(
            {
                "case": i,
                "mel_frames": int(feat.shape[2]),
                "f0_overridden": f0_override is not None,
                "voiced_frames": int((f0 > 10).sum()),
                "cache_source_samples": cache_len,
                "torch_seed": 7000 + i,
            }
        )
    return arrays, meta
