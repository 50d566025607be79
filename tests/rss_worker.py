"""Child process of tests/test_request_bounds.py: serve a CosyVoice2 bundle under the TTS_* limits in its environment,
speak the worst text those limits allow, and print (one JSON line) how much its peak resident memory grew against the
bound docs/architecture.md ("Bounds per request") states for those limits.

    python tests/rss_worker.py BUNDLE VOICES_DIR STREAM(0|1)

Peak RSS is measured by construction: after the model is loaded and warm, the kernel's high-water mark (VmHWM) is
reset to the current size (`/proc/self/clear_refs`, 5), the request runs, and VmHWM is read. A thread watching VmRSS
ends the process (exit 3) as soon as the growth passes the bound, so a regression fails fast instead of filling the
machine's memory.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
from pathlib import Path

from service.audio.encode import AudioFormat
from service.errors import TTSError
from service.families.cosyvoice2.voice import Voice2
from service.families.model import PromptAudio, PromptVoice
from service.runtime import Runtime
from service.settings import Settings
from service.speech.request import SpeechRequest

MiB = 1 << 20
PROMPT = Path(__file__).resolve().parent / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"
NAUGHTY_THAI = "ด้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็้้้้้้้้็็็็็้้้้้็็็็็"
SLOWEST_SPEED = 0.25  # OpenAI's lowest: the most audio a request's speech tokens can become
ATTENTION_TENSORS = 7  # float32 H x T x T tensors one full-attention node chain keeps at once (scores, mask, softmax)
CALL_ALLOWANCE = 160 * MiB  # one flow or vocoder call's other activations in ONNX Runtime's arenas (tiny: ~90 MB)


def status_bytes(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def bound_bytes(runtime: Runtime, voice: Voice2, stream: bool) -> int:
    """docs/architecture.md's worst case for one request of a CosyVoice2 bundle under the limits in the environment
    (read from there, not from the settings, so that the same bound is computed for code without these settings)."""
    engine = runtime.model.engine  # type: ignore[attr-defined]
    c, e = engine.constants, engine.extra
    sentence = int(float(os.environ["TTS_MAX_SENTENCE_SPEECH_S"]) * c.token_rate_hz)  # S: a sentence's tokens at most
    prompt = len(voice.flow.tokens)  # P
    llm_kv = 2 * c.llm_num_layers * c.llm_num_heads * c.llm_head_dim * 4 * (prompt + 2 * 200 + sentence)
    request_s = float(os.environ["TTS_MAX_SPEECH_S"])
    audio = 2 * 4 * int(request_s / SLOWEST_SPEED * c.sample_rate)  # the whole file's samples, joined once
    if stream:
        window = min(prompt, engine.prompt_window_tokens or prompt)
        positions = window + sentence + e.pre_lookahead
        per_frame = engine.flow.empty_state(c.n_timesteps, capacity=1).bytes_per_frame()
        per_token = (e.encoder_blocks + e.up_blocks * e.token_mel_ratio) * 2 * e.encoder_heads * e.encoder_head_dim * 4
        acoustic = per_frame * e.token_mel_ratio * positions + 2 * per_token * positions  # + a grown copy
    else:
        frames = e.token_mel_ratio * (prompt + sentence)  # T: the full-attention pass over prompt and sentence
        acoustic = ATTENTION_TENSORS * 4 * e.estimator_heads * frames * frames
    return acoustic + llm_kv + audio + CALL_ALLOWANCE


def watch(base: int, bound: int) -> None:
    while True:
        if status_bytes("VmRSS:") - base > bound:
            print(json.dumps({"error": "over the bound while running", "growth_mb": (status_bytes("VmHWM:") - base) / MiB,
                              "bound_mb": bound / MiB}), flush=True)  # fmt: skip
            os._exit(3)
        threading.Event().wait(0.02)


def main(bundle: str, voices_dir: str, stream: bool) -> None:
    settings = Settings(model_dir=Path(bundle), voices_dir=Path(voices_dir), intra_op_threads=1, grpc_port=0,  # type: ignore[call-arg]
                        rate_limit_per_minute=0, cache_max_bytes=0)  # fmt: skip
    runtime = Runtime(settings)
    runtime.load()
    service = runtime.service
    voice = service.resolve_voice(PromptVoice(PromptAudio(PROMPT.read_bytes()), "希望你以后能够做的比我还好呦。"))
    assert isinstance(voice, Voice2)

    def speak(text: str) -> str | None:
        request = SpeechRequest(text, voice, AudioFormat.MP3, engine_stream=stream, chunked=stream, max_chars=settings.max_chars)
        try:
            service.submit(request).read_all()
        except TTSError as e:
            return e.code.value
        return None

    assert speak("你好，世界。") is None  # warm: the sessions' small-shape arenas, the voice's prompt state
    gc.collect()
    bound = bound_bytes(runtime, voice, stream)
    base = status_bytes("VmRSS:")
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current size
    threading.Thread(target=watch, args=(base, bound), daemon=True).start()
    error = speak((NAUGHTY_THAI * (settings.max_chars // len(NAUGHTY_THAI) + 1))[: settings.max_chars])
    growth = status_bytes("VmHWM:") - base
    print(json.dumps({"error": error, "growth_mb": growth / MiB, "bound_mb": bound / MiB, "base_mb": base / MiB}), flush=True)
    runtime.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] == "1")
