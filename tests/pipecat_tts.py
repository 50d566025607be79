"""Run the Pipecat recipe of docs/integrations.md with the real pipecat-ai package: the snippet builds the service
(every DeprecationWarning it raises is recorded), then a Pipecat pipeline speaks one text through it.

Run by tests/test_integrations.py in a child process whose PYTHONPATH holds .venv/pipecat (requirements-pipecat.txt):
    python tests/pipecat_tts.py HOST:PORT TEXT OUT.pcm
The last stdout line is JSON: deprecations, error frames, the audio frames' sample rates and byte count.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import warnings
from pathlib import Path

from pipecat.frames.frames import ErrorFrame, TTSAudioRawFrame, TTSSpeakFrame
from pipecat.services.openai.tts import OpenAITTSService  # imported before the snippet: its own import is not timed
from pipecat.tests.utils import run_test

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"


def snippet() -> str:
    """The first python block of the Pipecat section."""
    section = RECIPES.read_text(encoding="utf-8").split("## Pipecat", 1)[1]
    found = re.search(r"```python\n(.*?)```", section, re.S)
    if found is None:
        raise SystemExit("docs/integrations.md has no python block under ## Pipecat")
    return found.group(1)


def main(address: str, text: str, out: Path) -> None:
    scope: dict[str, object] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(snippet().replace("HOST:8000", address), scope)  # our own documentation, run as a reader would
    tts = scope["tts"]
    assert isinstance(tts, OpenAITTSService), "the snippet must define `tts`"
    down, up = asyncio.run(run_test(tts, frames_to_send=[TTSSpeakFrame(text)]))
    audio = [f for f in down if isinstance(f, TTSAudioRawFrame)]
    out.write_bytes(b"".join(f.audio for f in audio))
    result = {
        "deprecations": [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)],
        "errors": [f.error for f in [*down, *up] if isinstance(f, ErrorFrame)],
        "sample_rates": sorted({f.sample_rate for f in audio}),
        "bytes": sum(len(f.audio) for f in audio),
    }
    print(json.dumps(result, ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))
