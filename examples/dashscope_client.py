"""An app written for Alibaba Cloud's CosyVoice API (the `dashscope` SDK), moved to cosyvoice-lite by one line.

The switch is the SDK's WebSocket base URL, either in the environment (read when dashscope is imported):

    DASHSCOPE_WEBSOCKET_BASE_URL=ws://127.0.0.1:8000/api-ws/v1/inference python examples/dashscope_client.py

or in code, before a synthesizer is made (what --url below does):

    dashscope.base_websocket_api_url = "ws://127.0.0.1:8000/api-ws/v1/inference"

Everything else is the SDK's own usage: SpeechSynthesizer, a ResultCallback, streaming_call() with an LLM's pieces
of text, streaming_complete(). The API key is the server's TTS_API_KEYS key (any text when keys are off); `voice`
names one of our voices (GET /v1/audio/voices), not a cloud voice: without --voice, the first the server lists (a
CosyVoice-300M-SFT model's first built-in speaker, or on CosyVoice2, which has none, a voice saved before with
POST /v1/voices). Each event is printed as it comes; the audio goes to --out. Needs the `dashscope` SDK, which the
server does not install: `pip install dashscope` (in this repository: `.venv/bin/pip install dashscope`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

try:
    import dashscope
    from dashscope.audio.tts_v2 import AudioFormat, ResultCallback, SpeechSynthesizer
    from dashscope.common.error import DashScopeException
except ImportError:  # the app's SDK, not a dependency of the server
    sys.exit("error: this example needs the dashscope SDK: pip install dashscope (here: .venv/bin/pip install dashscope)")

REPLY = ("今天天气很好，", "适合出去散步。我们可以先去", "公园，然后在湖边喝杯咖啡。", "See you tomorrow!")
LOCAL_URL = "ws://127.0.0.1:8000/api-ws/v1/inference"
TASK_PATH = "/api-ws/v1/inference"


class VoiceLookupError(Exception):
    """The server's voice list could not be read, or it lists none (what to do is the message)."""


def server_voice(url: str, api_key: str) -> str:
    """The first voice the server at WebSocket `url` lists (GET /v1/audio/voices): a built-in speaker, else a saved
    voice; OpenAI names (`alias_of`) are other names for those. VoiceLookupError says how to save one when there is none."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme)
    if scheme is None:
        raise VoiceLookupError(f"{url} is no WebSocket URL (ws:// or wss://)")
    base = f"{scheme}://{parts.netloc}{parts.path.removesuffix(TASK_PATH)}"
    headers = {"Authorization": f"Bearer {api_key}"}
    request = urllib.request.Request(base + "/v1/audio/voices", headers=headers)  # noqa: S310 (scheme checked above)
    try:
        with urllib.request.urlopen(request, timeout=30) as r:  # noqa: S310 (scheme checked above)
            voices = [v["id"] for v in json.load(r)["voices"] if "alias_of" not in v]
    except urllib.error.HTTPError as e:
        raise VoiceLookupError(f"GET {base}/v1/audio/voices answered {e.code}: {e.read().decode(errors='replace')}") from e
    if not voices:
        raise VoiceLookupError(
            f"the server has no voice yet (a model without built-in speakers, like CosyVoice2, speaks saved voices): "
            "save one, e.g.\n"
            f"  curl -F name=alice -F audio=@alice.wav -F transcript='the words spoken' {base}/v1/voices\n"
            "then run this again (or pass --voice alice)"
        )
    return voices[0]


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
    p.add_argument("--voice", help="built-in speaker or saved voice of the server (default: the first it lists)")
    p.add_argument("--out", default="reply.pcm", help="raw 16-bit mono PCM at 22,050 Hz")
    args = p.parse_args(argv)
    if args.voice is None:
        try:
            args.voice = server_voice(args.url, args.api_key)
        except (VoiceLookupError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"voice: {args.voice} (the first the server lists)", file=sys.stderr)

    dashscope.base_websocket_api_url = args.url  # the one line that moves an app from the cloud to cosyvoice-lite
    dashscope.api_key = args.api_key

    log = EventLog()
    fmt = AudioFormat.PCM_22050HZ_MONO_16BIT
    synthesizer = SpeechSynthesizer(model=args.model, voice=args.voice, format=fmt, callback=log)
    try:
        for piece in REPLY:  # as an LLM streams its reply
            synthesizer.streaming_call(piece)
        synthesizer.streaming_complete()
        log.done.wait(30)  # the SDK's callback thread reports the end: let it print before this thread goes on
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
