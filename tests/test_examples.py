"""examples/stream_client.py and examples/dashscope_client.py as docs/websocket.md and docs/dashscope.md run them (no
--voice), against both model families: they ask the server for a voice, and on CosyVoice2 (no built-in speakers) say
how to save one."""

from __future__ import annotations

import subprocess
import sys
import wave
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import REPO, AppServer

pytestmark = [pytest.mark.integration]

PROMPT = REPO / "tests" / "reference" / "tiny-cosyvoice2" / "prompts" / "zh_16k.wav"
PROMPT_TEXT = "希望你以后能够做的比我还好呦。"


def serve(tmp_path_factory: pytest.TempPathFactory, bundle: Path, name: str) -> Iterator[AppServer]:
    env = {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_INTRA_OP_THREADS": "1"}
    server = AppServer(tmp_path_factory.mktemp(name), bundle, env, name=name)
    server.start()
    yield server
    server.stop()
    server.dump_log()


@pytest.fixture(scope="module")
def v1(tmp_path_factory: pytest.TempPathFactory, tiny_bundle: Path) -> Iterator[AppServer]:
    yield from serve(tmp_path_factory, tiny_bundle, "examples-v1")


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory, tiny_v2_bundle: Path) -> Iterator[AppServer]:
    yield from serve(tmp_path_factory, tiny_v2_bundle, "examples-v2")


def run(example: str, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(REPO / "examples" / example), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False, cwd=REPO)


def stream_client(server: AppServer, out: Path) -> subprocess.CompletedProcess[str]:
    return run("stream_client.py", "--url", f"ws://127.0.0.1:{server.port}/v1/audio/speech/stream", "--out", str(out))


def dashscope_client(server: AppServer, out: Path) -> subprocess.CompletedProcess[str]:
    return run("dashscope_client.py", "--url", f"ws://127.0.0.1:{server.port}/api-ws/v1/inference", "--out", str(out))


def assert_spoke(done: subprocess.CompletedProcess[str], voice: str, out: Path) -> None:
    assert done.returncode == 0, done.stderr
    assert f"voice: {voice} (the first the server lists)" in done.stderr, done.stderr
    assert out.stat().st_size > 1000, done.stdout


def test_the_examples_speak_in_the_first_builtin_speaker_of_a_v1_server(v1: AppServer, tmp_path: Path) -> None:
    done = stream_client(v1, tmp_path / "reply.wav")
    assert_spoke(done, "中文女", tmp_path / "reply.wav")
    with wave.open(str(tmp_path / "reply.wav")) as w:
        assert w.getframerate() == 24000 and w.getnframes() > 0
    assert_spoke(dashscope_client(v1, tmp_path / "reply.pcm"), "中文女", tmp_path / "reply.pcm")


def test_on_cosyvoice2_the_examples_say_how_to_save_a_voice_then_speak_in_it(v2: AppServer, tmp_path: Path) -> None:
    for client in (stream_client, dashscope_client):
        refused = client(v2, tmp_path / "none")
        assert refused.returncode == 1 and refused.stderr.startswith("error: the server has no voice yet"), refused.stderr
        assert f"curl -F name=alice -F audio=@alice.wav -F transcript='the words spoken' {v2.base_url}/v1/voices" in (
            refused.stderr
        )
        assert "Traceback" not in refused.stderr and not (tmp_path / "none").exists()
    with v2.client() as http:
        files = {"audio": ("p.wav", PROMPT.read_bytes(), "audio/wav")}
        saved = http.post("/v1/voices", data={"name": "narrator", "transcript": PROMPT_TEXT}, files=files)
        assert saved.status_code == 201, saved.text
    assert_spoke(stream_client(v2, tmp_path / "reply.wav"), "narrator", tmp_path / "reply.wav")
    assert_spoke(dashscope_client(v2, tmp_path / "reply.pcm"), "narrator", tmp_path / "reply.pcm")


def test_the_dashscope_example_says_how_to_install_the_sdk(tmp_path: Path) -> None:
    """Run in an interpreter where `import dashscope` fails, as in the server's own .venv (requirements-lite)."""
    code = (
        "import runpy, sys; sys.modules['dashscope'] = None; sys.argv = ['dashscope_client.py']; "
        f"runpy.run_path({str(REPO / 'examples' / 'dashscope_client.py')!r}, run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "pip install dashscope" in done.stderr and ".venv/bin/pip install dashscope" in done.stderr, done.stderr
