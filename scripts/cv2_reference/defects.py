"""The official defects named in issue 24, each reproduced on the checkpoint (results go to fixtures_meta.json)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cv2_reference import capture
from cv2_reference.cases import PROMPTS, Case
from cv2_reference.mode_fixtures import forced_tokens
from cv2_reference.stream_fixtures import FIRST_HOP, fresh_schedule, stream_token_count

PROBE = Case("zero_shot", "zh_16k", "今天天气很好，我们一起去公园散步吧。", 0, 9000)


def _run(cv: Any, n: int, prompts_dir: Path, stream: bool, speed: float = 1.0) -> capture.Capture:
    wav = str(prompts_dir / f"{PROBE.prompt}.wav")

    def call() -> Any:
        return cv.inference_zero_shot(PROBE.tts_text, PROMPTS[PROBE.prompt], wav, stream=stream, speed=speed)

    return capture.run(cv, call, forced_tokens(PROBE.seed, n), PROBE.seed)


def _chunks(cv: Any, n: int, prompts_dir: Path) -> list[int]:
    return [int(t["token"].shape[1]) for t in _run(cv, n, prompts_dir, stream=True).token2wav_calls]


def hop_not_reset(cv: Any, prompts_dir: Path, prompt_tokens: int) -> dict[str, Any]:
    """model.py:360 doubles self.token_hop_len on the shared model and nothing resets it (model.py:258 sets it once)."""
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
        "note": (
            f"a fresh model starts each stream with hop {FIRST_HOP}; after any stream the shared attribute stays at "
            "token_max_hop_len (100), so later requests wait for 100 + pad + 3 tokens before their first audio; concurrent "
            "requests also race on it (one request's doubling changes another's next hop)"
        ),
    }


def speed_in_stream(cv: Any, prompts_dir: Path, prompt_tokens: int) -> dict[str, Any]:
    """tts() passes `speed` to token2wav only in non-stream mode (model.py:386); stream calls (model.py:351, :367) drop it."""
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
        "note": "stream=True ignores speed without an error; model.py:320-321 would assert if a cached stream passed it",
    }


def tensor_prompt(cv: Any, prompts_dir: Path) -> dict[str, Any]:
    """runtime/python/fastapi/server.py:56-57 (and :64-65, :79-80) pass load_wav()'s tensor where the frontend wants a file."""
    from cosyvoice.utils.file_utils import load_wav

    speech = load_wav(str(prompts_dir / f"{PROBE.prompt}.wav"), 16000)
    try:
        list(cv.inference_zero_shot(PROBE.tts_text, PROMPTS[PROBE.prompt], speech))
        return {"confirmed": False, "error": None}
    except Exception as e:  # the official frontend's own failure is the finding
        return {"confirmed": True, "error": f"{type(e).__name__}: {e}"}
