"""Non-stream zero-shot / cross-lingual / instruct2 calls: model input, LLM, flow (look-ahead + DiT) and causal HiFT."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from cv2_reference.mode_fixtures import model_input_arrays
from cv2_reference.recorder import to_numpy

from cv3_reference import capture
from cv3_reference.cases import MAX_SILENT_RUN, SILENT_TOKENS, Case

TOKEN_MEL_RATIO = 2
EULER_STEPS = 10


def forced_tokens(case: Case, n: int) -> list[int]:
    """numpy RandomState(seed).randint(0, 6561, n), with the case's silent run written over it."""
    tokens: list[int] = np.random.RandomState(case.seed).randint(0, capture.SPEECH_TOKENS, n).tolist()
    start, length = case.silent_run
    for i in range(length):
        tokens[start + i] = SILENT_TOKENS[i % len(SILENT_TOKENS)]
    return tokens


def silence_filtered(tokens: list[int]) -> list[int]:
    """What CosyVoiceModel.llm_job (model.py:121-128) passes on: a silent token after 5 in a row is dropped."""
    out, run = [], 0
    for token in tokens:
        run = run + 1 if token in SILENT_TOKENS else 0
        if run <= MAX_SILENT_RUN:
            out.append(token)
    return out


def official_call(cv: Any, case: Case, prompts_dir: Path, stream: bool) -> Callable[[], Any]:
    """The official inference_* generator for `case` (prompt given as a file path, as the frontend expects)."""
    wav = str(prompts_dir / f"{case.prompt}.wav")
    if case.mode == "zero_shot":
        return lambda: cv.inference_zero_shot(case.tts_text, case.prompt_text, wav, stream=stream)
    if case.mode == "cross_lingual":
        return lambda: cv.inference_cross_lingual(case.tts_text, wav, stream=stream)
    return lambda: cv.inference_instruct2(case.tts_text, case.instruct_text, wav, stream=stream)


def llm_arrays(cv: Any, cap: Any) -> dict[str, np.ndarray]:
    """Teacher-forced LLM: prefill input, per-step hidden states (KV cache as the official loop), log-probs, no-cache."""
    import torch

    forced, steps = cap.forced.tokens, cap.llm_steps
    n = len(forced)
    assert len(steps) == n + 1 and len(cap.forced.logp) == n + 1
    embed = cv.model.llm.speech_embedding.weight.detach()
    for i in range(1, n + 1):
        assert np.array_equal(steps[i]["input"][0], to_numpy(embed[forced[i - 1]]))
        assert steps[i]["past"] == steps[i - 1]["past"] + len(steps[i - 1]["input"])
    prefill = steps[0]["input"]
    assert np.array_equal(prefill[0], to_numpy(embed[capture.SPEECH_TOKENS]))  # sos = speech_embedding[6561]
    logp = np.stack(cap.forced.logp)
    rows = [0, 1, n]
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
        "llm_logp_taken": logp[np.arange(n + 1), np.array([*forced, capture.EOS])],
        "llm_logp_eos": logp[:, capture.EOS],
        "llm_ignore_eos": np.array(cap.forced.ignore_eos),
        "llm_nocache_hidden": to_numpy(hidden),
        "llm_nocache_logp_rows": to_numpy(nocache_logp),
    }


def check_flow_call(call: dict[str, Any], rand_noise: np.ndarray) -> None:
    """Assert what the README says follows from the stored arrays (noise, cond, mask, grid, mu = look-ahead output x 2)."""
    p = call["prompt_feat"].shape[1]
    frames = call["mu"].shape[2]
    assert np.array_equal(call["z"], rand_noise[:, :, :frames]), "solver noise is not the fixed rand_noise prefix"
    cond = np.zeros_like(call["mu"])
    cond[0, :, :p] = call["prompt_feat"][0].T
    assert np.array_equal(call["cond"], cond) and np.all(call["mask"] == 1)
    assert np.array_equal(call["mu"][0], np.repeat(call["lookahead_h"][0], TOKEN_MEL_RATIO, axis=0).T)
    assert np.array_equal(call["feat"][0], call["solver_out"][0, :, p:])
    grid = 1 - np.cos(np.linspace(0, 1, EULER_STEPS + 1, dtype=np.float32) * 0.5 * np.pi)
    assert np.allclose(call["t_span"], grid, atol=1e-6) and len(call["est_steps"]) == EULER_STEPS


def estimator_step1(call: dict[str, Any]) -> dict[str, np.ndarray]:
    """Inputs of the first Euler step follow from the call; the output (and the DiT internals, if kept) are stored."""
    step = call["est_steps"][0]
    assert np.array_equal(step["x"][0], call["z"][0]) and np.array_equal(step["x"][1], call["z"][0])
    assert np.array_equal(step["mu"][0], call["mu"][0]) and not step["mu"][1].any()
    assert np.array_equal(step["cond"][0], call["cond"][0]) and not step["cond"][1].any()
    assert np.array_equal(step["spks"][0], call["spks"][0]) and not step["spks"][1].any()
    assert not step["t"].any() and np.all(step["mask"] == 1)
    out = {"est1_out": step["out"]}
    out.update({f"dit1_{name}": value for name, value in call["dit"].items()})
    return out


def flow_arrays(call: dict[str, Any], rand_noise: np.ndarray, with_estimator: bool) -> dict[str, np.ndarray]:
    check_flow_call(call, rand_noise)
    out = {
        "flow_lookahead_h": call["lookahead_h"][0],
        "flow_spks": call["spks"][0],
        "flow_solver_out": call["solver_out"][0],
    }
    if with_estimator:
        out.update(estimator_step1(call))
    return out


def hift_arrays(call: dict[str, Any]) -> dict[str, np.ndarray]:
    return {"hift_f0": call["f0"][0], "hift_source": call["source"][0, 0], "hift_speech": call["speech"][0]}


def mode_case(
    cv: Any, case: Case, prompts_dir: Path, rand_noise: np.ndarray, first: bool
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """One non-stream official call and its arrays (estimator step 1 for the first case of a mode, DiT internals for
    the first zero-shot case)."""
    dit = first and case.mode == "zero_shot"
    forced = forced_tokens(case, case.n_tokens)
    cap = capture.run(cv, official_call(cv, case, prompts_dir, stream=False), forced, case.seed, dit_internals=dit)
    assert len(cap.flow_calls) == 1 and len(cap.hift_calls) == 1 and len(cap.yielded) == 1
    call, hift = cap.flow_calls[0], cap.hift_calls[0]
    flow_tokens = call["token"][0].tolist()
    assert not call["streaming"] and call["finalize"] and flow_tokens == silence_filtered(forced)
    assert hift["finalize"] and np.array_equal(hift["mel"], call["feat"]) and np.array_equal(hift["speech"], cap.yielded[0])
    arrays = {**model_input_arrays(cap), **llm_arrays(cv, cap), "flow_tokens": np.array(flow_tokens, dtype=np.int32)}
    arrays.update(flow_arrays(call, rand_noise, with_estimator=first))
    arrays.update(hift_arrays(hift))
    tts_sentences = next(out for text, split, out in cap.normalized if split and text == case.tts_text)
    meta = {
        "mode": case.mode,
        "prompt": case.prompt,
        "prompt_text": case.prompt_text,
        "instruct_text": case.instruct_text or None,
        "tts_text": case.tts_text,
        "tts_text_normalized": tts_sentences,
        "torch_seed": case.seed,
        "forced_tokens_from": f"numpy RandomState({case.seed}).randint(0, 6561, {case.n_tokens})",
        "silent_run": {"start": case.silent_run[0], "length": case.silent_run[1], "tokens": list(SILENT_TOKENS)}
        if case.silent_run[1]
        else None,
        "flow_tokens": len(flow_tokens),
        "prefill_len": int(arrays["llm_prefill_input"].shape[0]),
        "prompt_tokens": int(arrays["mi_flow_prompt_speech_token"].shape[0]),
        "prompt_mel_frames": int(arrays["mi_prompt_speech_feat"].shape[0]),
        "tts_mel_frames": int(call["feat"].shape[2]),
        "samples": int(cap.yielded[0].shape[1]),
        "min_len_max_len": [int(2 * len(arrays["mi_text"])), int(20 * len(arrays["mi_text"]))],
    }
    return arrays, meta
