"""Official CosyVoice3 behaviours a runtime must know about, each reproduced on the checkpoint (fixtures_meta.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cv2_reference.stream_fixtures import FIRST_HOP, fresh_schedule, stream_token_count

from cv3_reference import capture
from cv3_reference.cases import SYSTEM, Case, zero_shot_prompt_text
from cv3_reference.mode_fixtures import forced_tokens

PROBE = Case("zero_shot", "zh_16k", "今天天气很好，我们一起去公园散步吧。", 0, 9000)


def _run(cv: Any, n: int, prompts_dir: Path, stream: bool, speed: float = 1.0) -> capture.Capture:
    wav = str(prompts_dir / f"{PROBE.prompt}.wav")

    def call() -> Any:
        return cv.inference_zero_shot(PROBE.tts_text, PROBE.prompt_text, wav, stream=stream, speed=speed)

    return capture.run(cv, call, forced_tokens(PROBE, n), PROBE.seed)


def _chunks(cv: Any, n: int, prompts_dir: Path) -> list[int]:
    return [int(t["token"].shape[1]) for t in _run(cv, n, prompts_dir, stream=True).token2wav_calls]


def min_len_masks_sos(cv: Any) -> dict[str, Any]:
    """sampling_ids (llm.py:150-160, inherited) masks index speech_token_size = 6561, which is CosyVoice3's sos; its eos
    is 6562 (llm.py:681-682), and any id >= 6561 stops (llm.py:703): min_len does not keep the loop from stopping."""
    import torch

    llm = cv.model.llm
    scores = torch.full((llm.llm_decoder.out_features,), -float("inf"))
    scores[llm.eos_token] = 0.0  # only eos is possible
    torch.manual_seed(0)
    taken = int(llm.sampling_ids(scores.clone(), [], 25, ignore_eos=True))
    return {
        "confirmed": taken == llm.eos_token and taken in llm.stop_token_ids,
        "masked_index": int(llm.speech_token_size),
        "sos": int(llm.sos),
        "eos": int(llm.eos_token),
        "stop_ids": [min(llm.stop_token_ids), max(llm.stop_token_ids)],
        "taken_with_ignore_eos": taken,
        "note": "with ignore_eos=True (step < min_len) the official sampling still returned eos, which ends the utterance",
    }


def end_of_prompt_required(cv: Any, prompts_dir: Path) -> dict[str, Any]:
    """CosyVoice3LM.inference asserts 151646 (<|endofprompt|>) in prompt_text ++ text (llm.py:477-479).

    Called on the LLM directly: inside tts() the LLM runs on its own thread (model.py:339), where the assertion ends
    that thread only.
    """
    import torch

    text = "No marker here."
    model_input = cv.frontend.frontend_cross_lingual(text, str(prompts_dir / f"{PROBE.prompt}.wav"), 24000, "")
    empty = torch.zeros(1, 0, dtype=torch.int32)
    try:
        next(
            cv.model.llm.inference(
                text=model_input["text"],
                text_len=model_input["text_len"].clone(),
                prompt_text=empty,
                prompt_text_len=torch.tensor([0], dtype=torch.int32),
                prompt_speech_token=empty,
                prompt_speech_token_len=torch.tensor([0], dtype=torch.int32),
                embedding=model_input["llm_embedding"],
            )
        )
        return {"confirmed": False, "error": None, "text": text}
    except AssertionError as e:  # the official assertion is the finding
        return {"confirmed": True, "error": f"AssertionError: {e}", "text": text}


def hop_not_reset(cv: Any, prompts_dir: Path, prompt_tokens: int) -> dict[str, Any]:
    """CosyVoice3Model keeps CosyVoice2Model.tts: model.py:360 doubles the shared token_hop_len, nothing resets it."""
    n = stream_token_count(prompt_tokens, (50,), 10)
    fresh_schedule(cv)
    first = _chunks(cv, n, prompts_dir)
    hop_after = int(cv.model.token_hop_len)
    second = _chunks(cv, n, prompts_dir)
    fresh_schedule(cv)
    return {
        "confirmed": first != second,
        "forced_tokens": n,
        "first_request_token2wav_token_lens": first,
        "token_hop_len_after_first_request": hop_after,
        "second_request_token2wav_token_lens": second,
        "note": f"a fresh model starts with hop {FIRST_HOP}; later streams start at token_max_hop_len (100) + pad",
    }


def speed_in_stream(cv: Any, prompts_dir: Path, prompt_tokens: int) -> dict[str, Any]:
    """tts() passes `speed` only on the non-stream path (model.py:386); stream calls drop it without an error."""
    n = stream_token_count(prompt_tokens, (), 10)
    samples = {}
    for stream in (False, True):
        for speed in (1.0, 1.5):
            fresh_schedule(cv)
            cap = _run(cv, n, prompts_dir, stream=stream, speed=speed)
            samples[f"{'stream' if stream else 'non_stream'}_speed_{speed}"] = sum(int(y.shape[1]) for y in cap.yielded)
    fresh_schedule(cv)
    return {
        "confirmed": samples["stream_speed_1.0"] == samples["stream_speed_1.5"]
        and samples["non_stream_speed_1.5"] < samples["non_stream_speed_1.0"],
        "forced_tokens": n,
        "yielded_samples": samples,
    }


def tensor_prompt(cv: Any, prompts_dir: Path) -> dict[str, Any]:
    """runtime/python/fastapi/server.py:56-57, :64-65, :79-80 pass load_wav()'s tensor where the frontend wants a file."""
    from cosyvoice.utils.file_utils import load_wav

    speech = load_wav(str(prompts_dir / f"{PROBE.prompt}.wav"), 16000)
    try:
        list(cv.inference_zero_shot(PROBE.tts_text, zero_shot_prompt_text(PROBE.prompt), speech))
        return {"confirmed": False, "error": None}
    except Exception as e:  # the official frontend's own failure is the finding
        return {"confirmed": True, "error": f"{type(e).__name__}: {e}"}


def all_checks(cv: Any, prompts_dir: Path, prompt_tokens: int) -> dict[str, Any]:
    return {
        "min_len_masks_sos_not_eos": min_len_masks_sos(cv),
        "end_of_prompt_required": end_of_prompt_required(cv, prompts_dir),
        "token_hop_len_not_reset": hop_not_reset(cv, prompts_dir, prompt_tokens),
        "speed_ignored_when_streaming": speed_in_stream(cv, prompts_dir, prompt_tokens),
        "server_passes_tensor_prompt": tensor_prompt(cv, prompts_dir),
        "system_prefix": SYSTEM,
    }
