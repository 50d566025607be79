"""Speak an LLM's reply while it is still being written: text deltas in, audio out, over cosyvoice-lite's WebSocket.

    python examples/stream_client.py --url ws://127.0.0.1:8000/v1/audio/speech/stream --out reply.wav

The reply text is fed a few characters at a time (as an LLM streams tokens); audio frames are written to a WAV
file as they arrive, and each finished sentence is printed as a caption with the time its first audio came.
Without --voice it speaks in the first voice the server lists (GET /v1/audio/voices): a CosyVoice-300M-SFT model's
first built-in speaker, or on CosyVoice2 (no built-in speakers) a voice saved before (POST /v1/voices).
Needs only `websockets` (pip install websockets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import wave

import websockets

REPLY = (
    "你好！今天天气很好，适合出去散步。我们可以先去公园，然后在湖边喝杯咖啡。"
    "If it rains later, we can visit the museum instead. See you at 3 p.m. tomorrow!"
)
HEADER = struct.Struct(">II")  # sequence number, sentence index (big-endian uint32), then the audio
STREAM_PATH = "/v1/audio/speech/stream"


class VoiceLookupError(Exception):
    """The server's voice list could not be read, or it lists none (what to do is the message)."""


def server_voice(url: str, api_key: str | None) -> str:
    """The first voice the server at WebSocket `url` lists (GET /v1/audio/voices): a built-in speaker, else a saved
    voice; OpenAI names (`alias_of`) are other names for those. VoiceLookupError says how to save one when there is none."""
    parts = urllib.parse.urlsplit(url)
    scheme = {"ws": "http", "wss": "https"}.get(parts.scheme)
    if scheme is None:
        raise VoiceLookupError(f"{url} is no WebSocket URL (ws:// or wss://)")
    base = f"{scheme}://{parts.netloc}{parts.path.removesuffix(STREAM_PATH)}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
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


async def feed(ws: websockets.ClientConnection, text: str, piece_chars: int, delay_s: float) -> None:
    """Send `text` in pieces of `piece_chars` characters every `delay_s` seconds, then ask for the rest and close."""
    for i in range(0, len(text), piece_chars):
        await ws.send(json.dumps({"type": "text", "text": text[i : i + piece_chars]}))
        await asyncio.sleep(delay_s)
    await ws.send(json.dumps({"type": "close"}))


async def speak(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    async with websockets.connect(args.url, additional_headers=headers, max_size=None) as ws:
        config = {"type": "config", "voice": args.voice, "format": "pcm", "sample_rate": args.sample_rate}
        await ws.send(json.dumps(config))
        ready = json.loads(await ws.recv())
        if ready.get("type") != "ready":
            print(f"error: {ready}", file=sys.stderr)
            return 1
        if "random" in str(ready.get("model", "")):
            print(f"note: {ready['model']} has random weights: the audio is noise, not speech", file=sys.stderr)
        start = time.perf_counter()
        feeder = asyncio.create_task(feed(ws, args.text, args.piece_chars, args.delay_s))
        first: dict[int, float] = {}
        with wave.open(args.out, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(ready["sample_rate"])
            async for message in ws:
                if isinstance(message, bytes):
                    _seq, sentence = HEADER.unpack_from(message)
                    first.setdefault(sentence, time.perf_counter() - start)
                    out.writeframes(message[HEADER.size :])
                    continue
                event = json.loads(message)
                if event["type"] == "sentence_end":
                    at = first.get(event["sentence"], float("nan"))
                    print(f"[{event['sentence']}] first audio at {at:.2f} s: {event['text']}")
                elif event["type"] == "error":
                    print(f"error: {event['error']['message']}", file=sys.stderr)
                    return 1
        await feeder
    print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/audio/speech/stream")
    p.add_argument("--voice", help="built-in speaker, saved voice or OpenAI voice name (default: the server's first)")
    p.add_argument("--text", default=REPLY, help="the reply to speak")
    p.add_argument("--piece-chars", type=int, default=4, help="characters per text delta")
    p.add_argument("--delay-s", type=float, default=0.03, help="seconds between deltas (an LLM's token rate)")
    p.add_argument("--sample-rate", type=int, default=24000)
    p.add_argument("--api-key", help="API key, when the server has TTS_API_KEYS")
    p.add_argument("--out", default="reply.wav")
    args = p.parse_args(argv)
    try:
        if args.voice is None:
            args.voice = server_voice(args.url, args.api_key)
            print(f"voice: {args.voice} (the first the server lists)", file=sys.stderr)
        return asyncio.run(speak(args))
    except VoiceLookupError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, websockets.InvalidHandshake) as e:
        print(f"error: cannot talk to {args.url}: {e}", file=sys.stderr)
        return 1
    except websockets.ConnectionClosedError as e:
        print(f"error: the server closed the stream: {e.rcvd.reason if e.rcvd else e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
