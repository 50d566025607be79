"""Speak an LLM's reply while it is still being written: text deltas in, audio out, over cosyvoice-lite's WebSocket.

    python examples/stream_client.py --url ws://127.0.0.1:8000/v1/audio/speech/stream --out reply.wav

The reply text is fed a few characters at a time (as an LLM streams tokens); audio frames are written to a WAV
file as they arrive, and each finished sentence is printed as a caption with the time its first audio came.
Needs only `websockets` (pip install websockets).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import sys
import time
import wave

import websockets

REPLY = (
    "你好！今天天气很好，适合出去散步。我们可以先去公园，然后在湖边喝杯咖啡。"
    "If it rains later, we can visit the museum instead. See you at 3 p.m. tomorrow!"
)
HEADER = struct.Struct(">II")  # sequence number, sentence index (big-endian uint32), then the audio


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
    p.add_argument("--voice", default="中文女", help="built-in speaker, saved voice or OpenAI voice name")
    p.add_argument("--text", default=REPLY, help="the reply to speak")
    p.add_argument("--piece-chars", type=int, default=4, help="characters per text delta")
    p.add_argument("--delay-s", type=float, default=0.03, help="seconds between deltas (an LLM's token rate)")
    p.add_argument("--sample-rate", type=int, default=24000)
    p.add_argument("--api-key", help="API key, when the server has TTS_API_KEYS")
    p.add_argument("--out", default="reply.wav")
    args = p.parse_args(argv)
    try:
        return asyncio.run(speak(args))
    except (OSError, websockets.InvalidHandshake) as e:
        print(f"error: cannot talk to {args.url}: {e}", file=sys.stderr)
        return 1
    except websockets.ConnectionClosedError as e:
        print(f"error: the server closed the stream: {e.rcvd.reason if e.rcvd else e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
