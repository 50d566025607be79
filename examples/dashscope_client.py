"""An app written for Alibaba Cloud's CosyVoice API (the `dashscope` SDK), moved to cosyvoice-lite by one line.

The switch is the SDK's WebSocket base URL, either in the environment (read when dashscope is imported):

    DASHSCOPE_WEBSOCKET_BASE_URL=ws://127.0.0.1:8000/api-ws/v1/inference python examples/dashscope_client.py

or in code, before a synthesizer is made (what --url below does):

    dashscope.base_websocket_api_url = "ws://127.0.0.1:8000/api-ws/v1/inference"

Everything else is the SDK's own usage: SpeechSynthesizer, a ResultCallback, streaming_call() with an LLM's pieces
of text, streaming_complete(). The API key is the server's TTS_API_KEYS key (any text when keys are off); `voice`
names one of our voices (GET /v1/audio/voices), not a cloud voice. Each event is printed as it comes; the audio goes
to --out. Needs `dashscope` (pip install dashscope).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import dashscope
from dashscope.audio.tts_v2 import AudioFormat, ResultCallback, SpeechSynthesizer
from dashscope.common.error import DashScopeException

REPLY = ("今天天气很好，", "适合出去散步。我们可以先去", "公园，然后在湖边喝杯咖啡。", "See you tomorrow!")
LOCAL_URL = "ws://127.0.0.1:8000/api-ws/v1/inference"


class EventLog(ResultCallback):
    """Prints each event with the time since the start; keeps the audio."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.audio = bytearray()
        self.done = threading.Event()
        self.failed: str | None = None

    def _print(self, what: str) -> None:
        print(f"{time.perf_counter() - self.start:7.3f} s  {what}", flush=True)

    def on_open(self) -> None:
        self._print("task-started")

    def on_event(self, message: str) -> None:
        output = json.loads(message)["payload"]["output"]
        sentence = output["sentence"]
        times = {k: sentence[k] for k in ("begin_time", "end_time") if k in sentence}
        self._print(f"{output['type']:<15} [{sentence['index']}] {times} {output.get('original_text', '')}")

    def on_data(self, data: bytes) -> None:
        if not self.audio:
            self._print(f"first audio ({len(data)} bytes)")
        self.audio += data

    def on_complete(self) -> None:
        self._print(f"task-finished: {len(self.audio)} bytes of audio")
        self.done.set()

    def on_error(self, message: str) -> None:
        self.failed = str(json.loads(message)["header"].get("error_message", message))
        self._print(f"task-failed: {message}")
        self.done.set()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default=os.environ.get("DASHSCOPE_WEBSOCKET_BASE_URL", LOCAL_URL))
    p.add_argument("--api-key", default=os.environ.get("DASHSCOPE_API_KEY", "none"))
    p.add_argument("--model", default="cosyvoice-v2", help="a cloud model name (cosyvoice-v*) or the server's model id")
    p.add_argument("--voice", default="中文女", help="built-in speaker or saved voice of the server")
    p.add_argument("--out", default="reply.pcm", help="raw 16-bit mono PCM at 22,050 Hz")
    args = p.parse_args(argv)

    dashscope.base_websocket_api_url = args.url  # the one line that moves an app from the cloud to cosyvoice-lite
    dashscope.api_key = args.api_key

    log = EventLog()
    fmt = AudioFormat.PCM_22050HZ_MONO_16BIT
    synthesizer = SpeechSynthesizer(model=args.model, voice=args.voice, format=fmt, callback=log)
    try:
        for piece in REPLY:  # as an LLM streams its reply
            synthesizer.streaming_call(piece)
        synthesizer.streaming_complete()
    except (DashScopeException, OSError, TimeoutError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if log.failed is not None:
        print(f"error: {log.failed}", file=sys.stderr)
        return 1
    with open(args.out, "wb") as out:
        out.write(log.audio)
    print(f"wrote {args.out} ({len(log.audio) / 2 / 22050:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
