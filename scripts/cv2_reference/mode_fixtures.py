"""Non-stream zero-shot / cross-lingual / instruct2 calls: model input, LLM, flow, estimator and HiFT stage arrays."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from cv2_reference import capture
from cv2_reference.cases import PROMPTS, Case
from cv2_reference.recorder import to_numpy

LOGP_ROWS = "first (prefill), second (first cached step) and last (the EOS step)"


def forced_tokens(seed: int, n: int) -> list[int]:
    return np.random.RandomState(seed).randint(0, capture.SPEECH_TOKENS, n).tolist()


def official_call(cv: Any, case: Case, prompts_dir: Path, stream: bool) -> Callable[[], Any]:
    """The official inference_* generator for `case` (prompt given as a file path, as the frontend expects)."""
    wav = str(prompts_dir / f"{case.prompt}.wav")
    if case.mode == "zero_shot":
        return lambda: cv.inference_zero_shot(case.tts_text, PROMPTS[case.prompt], wav, stream=stream)
    if case.mode == "cross_lingual":
        return lambda: cv.inference_cross_lingual(case.tts_text, wav, stream=stream)
    return lambda: cv.inference_instruct2(case.tts_text, case.instruct_text, wav, stream=stream)


def model_input_arrays(cap: capture.Capture) -> dict[str, np.ndarray]:
    """The model input after the frontend (ids int32, prompt mel [P, 80], embedding [192])."""
    mi = cap.model_input
    out = {f"mi_{k}": mi[k][0].astype(np.int32) for k in ("text", "prompt_text", "llm_prompt_speech_token") if k in mi}
    out["mi_flow_prompt_speech_token"] = mi["flow_prompt_speech_token"][0].astype(np.int32)
    out["mi_prompt_speech_feat"] = mi["prompt_speech_feat"][0]
    out["mi_embedding"] = mi["flow_embedding"][0]
    assert np.array_equal(mi["llm_embedding"], mi["flow_embedding"])  # Qwen2LM ignores it; the flow uses it
    return out


def llm_arrays(cv: Any, cap: capture.Capture) -> dict[str, np.ndarray]:
    """Teacher-forced LLM: prefill input, per-step hidden states (KV cache as the official loop), log-probs, no-cache."""
    import torch

    forced, steps = cap.forced.tokens, cap.llm_steps
    n = len(forced)
    assert len(steps) == n + 1 and len(cap.forced.logp) == n + 1
    embed = cv.model.llm.speech_embedding.weight.detach()
    for i in range(1, n + 1):
        assert np.array_equal(steps[i]["input"][0], to_numpy(embed[forced[i - 1]])) and steps[i]["past"] == steps[i - 1][
            "past"
        ] + len(steps[i - 1]["input"])
    logp = np.stack(cap.forced.logp)
    targets = np.array([*forced, capture.SPEECH_TOKENS])
    rows = [0, 1, n]
    prefill = steps[0]["input"]
    with torch.inference_mode():
        full = torch.cat([torch.from_numpy(prefill), embed[torch.tensor(forced)]])[None]
        hidden, _ = cv.model.llm.llm(full, torch.tensor([full.shape[1]]))
        hidden = hidden[0, prefill.shape[0] - 1 :]
        nocache_logp = cv.model.llm.llm_decoder(hidden[rows]).log_softmax(dim=-1)
    return {
        "forced_tokens": np.array(forced, dtype=np.int32),
        "llm_prefill_input": prefill,
        "llm_step_hidden": np.stack([s["hidden"] for s in steps]),
        "llm_step_past": np.array([s["past"] for s in steps], dtype=np.int32),
        "llm_logp_rows": logp[rows],
        "llm_logp_row_index": np.array(rows, dtype=np.int32),
        "llm_logp_taken": logp[np.arange(n + 1), targets],
        "llm_logp_eos": logp[:, capture.SPEECH_TOKENS],
        "llm_ignore_eos": np.array(cap.forced.ignore_eos),
        "llm_nocache_hidden": to_numpy(hidden),
        "llm_nocache_logp_rows": to_numpy(nocache_logp),
    }


def check_flow_call(call: dict[str, Any], rand_noise: np.ndarray) -> None:
    """Assert what the README says follows from the stored arrays (noise, cond, mask, grid, mu)."""
    p = call["prompt_feat"].shape[1]
    frames = call["mu"].shape[2]
    assert np.array_equal(call["z"], rand_noise[:, :, :frames]), "solver noise is not the fixed rand_noise prefix"
    cond = np.zeros_like(call["mu"])
    cond[0, :, :p] = call["prompt_feat"][0].T
    assert np.array_equal(call["cond"], cond) and np.all(call["mask"] == 1)
    assert np.array_equal(call["mu"][0], call["encoder_proj"][0].T)
    assert np.array_equal(call["feat"][0], call["solver_out"][0, :, p:])
    grid = 1 - np.cos(np.linspace(0, 1, 11, dtype=np.float32) * 0.5 * np.pi)
    assert np.allclose(call["t_span"], grid, atol=1e-6) and len(call["est_steps"]) == 10


def estimator_step1(call: dict[str, Any]) -> dict[str, np.ndarray]:
    """Inputs of the first Euler step follow from the call; only x (= z) and the output are stored."""
    step = call["est_steps"][0]
    assert np.array_equal(step["x"][0], call["z"][0]) and np.array_equal(step["x"][1], call["z"][0])
    assert np.array_equal(step["mu"][0], call["mu"][0]) and not step["mu"][1].any()
    assert np.array_equal(step["cond"][0], call["cond"][0]) and not step["cond"][1].any()
    assert np.array_equal(step["spks"][0], call["spks"][0]) and not step["spks"][1].any()
    assert not step["t"].any() and np.all(step["mask"] == 1)
    return {"est1_out": step["out"]}


def flow_arrays(call: dict[str, Any], rand_noise: np.ndarray, with_encoder: bool, with_estimator: bool) -> dict[str, np.ndarray]:
    check_flow_call(call, rand_noise)
    out = {
        "flow_mu": call["mu"][0],
        "flow_spks": call["spks"][0],
        "flow_solver_out": call["solver_out"][0],
    }
    if with_encoder:
        out["flow_encoder_h"] = call["encoder_h"][0]
    if with_estimator:
        out.update(estimator_step1(call))
    return out


def hift_arrays(call: dict[str, Any], yielded: np.ndarray | None) -> dict[str, np.ndarray]:
    kinds = [kind for kind, _ in call["draws"]]
    assert kinds == ["rand", "randn_like", "randn_like"], kinds
    if yielded is not None:
        assert np.array_equal(call["speech"], yielded)
    return {
        "hift_mel": call["mel"][0],
        "hift_f0": call["f0"][0],
        "hift_rand_ini": call["draws"][0][1][0],
        "hift_source": call["source"][0, 0],
        "hift_speech": call["speech"][0],
    }


def mode_case(
    cv: Any, case: Case, prompts_dir: Path, rand_noise: np.ndarray, first: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One non-stream official call and its arrays (estimator and encoder states stored for the first case of a mode)."""
    cap = capture.run(cv, official_call(cv, case, prompts_dir, stream=False), forced_tokens(case.seed, case.n_tokens), case.seed)
    assert len(cap.flow_calls) == 1 and len(cap.hift_calls) == 1 and len(cap.yielded) == 1
    call = cap.flow_calls[0]
    assert not call["streaming"] and call["finalize"] and np.array_equal(call["token"][0], cap.forced.tokens)
    arrays = {**model_input_arrays(cap), **llm_arrays(cv, cap)}
    arrays.update(flow_arrays(call, rand_noise, with_encoder=first and case.mode == "zero_shot", with_estimator=first))
    arrays.update(hift_arrays(cap.hift_calls[0], cap.yielded[0]))
    tts_sentences = next(out for text, split, out in cap.normalized if split and text == case.tts_text)
    meta = {
        "mode": case.mode,
        "prompt": case.prompt,
        "prompt_text": PROMPTS[case.prompt] if case.mode == "zero_shot" else None,
        "instruct_text": case.instruct_text or None,
        "tts_text": case.tts_text,
        "tts_text_normalized": tts_sentences,
        "torch_seed": case.seed,
        "forced_tokens_from": f"numpy RandomState({case.seed}).randint(0, 6561, {case.n_tokens})",
        "prefill_len": int(arrays["llm_prefill_input"].shape[0]),
        "prompt_tokens": int(arrays["mi_flow_prompt_speech_token"].shape[0]),
        "prompt_mel_frames": int(arrays["mi_prompt_speech_feat"].shape[0]),
        "tts_mel_frames": int(call["feat"].shape[2]),
        "samples": int(cap.yielded[0].shape[1]),
        "min_len_max_len": [int(2 * len(arrays["mi_text"])), int(20 * len(arrays["mi_text"]))],
    }
    return arrays, meta
