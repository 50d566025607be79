"""The docs stay true: README.md and docs/*.md commands run (or say why they cannot here), relative links resolve,
the settings pages list exactly the settings and levers the code has, and the README stays a short first screen."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from settings_table import PAGES, with_table  # scripts/ is put on sys.path by conftest

from service.levers import LEVERS
from service.settings import ENV_PREFIX, RENAMED, Settings

REPO = Path(__file__).resolve().parents[1]
PAGES_CHECKED = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
README = (REPO / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^[ \t]*```(\w*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
SHELL = {"bash", "sh", "shell", "console"}
# A command the test cannot run here says why, in a comment that starts with one of these (on its own line at the top
# of its block, for the whole block, or after the command). "tested by" names the test file that runs it.
MARKER = re.compile(
    r"#\s*(?:needs (?:a real checkpoint|the network|the official CosyVoice checkout|docker)|tested by (tests/[\w/]+\.py))"
)
SERVER_ADDRESS = re.compile(r"\b(?:localhost|127\.0\.0\.1):8000\b")
RECORDING = REPO / "tests" / "reference" / "tiny" / "prompts" / "zh_16k.wav"  # 4.1 s of speech-like audio at 16 kHz
WORK_SESSION = re.compile(r"session[ -]?\d|(this|last|previous|next|earlier|same) session", re.I)


@dataclass(frozen=True)
class Command:
    page: str
    text: str
    marker: re.Match[str] | None

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def logical_lines(block: str) -> Iterator[str]:
    """A shell block's commands: continuation lines joined, a here-document kept with its command."""
    lines, i = block.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        heredoc = re.search(r"<<-?'?(\w+)'?", line)
        if heredoc:
            end = lines.index(heredoc.group(1), i + 1)
            line, i = "\n".join(lines[i : end + 1]), end
        yield line
        i += 1


def commands(page: Path) -> list[Command]:
    """Every command of the page's shell blocks, with the marker that excuses it from running (if any)."""
    out = []
    for lang, block in FENCE.findall(page.read_text(encoding="utf-8")):
        if lang not in SHELL:
            continue
        lines = list(logical_lines(textwrap.dedent(block)))
        block_marker = MARKER.match(lines[0].strip()) if lines else None
        for line in lines:
            if line.strip() and not line.lstrip().startswith("#"):
                own = re.search(r"\s(#.*)$", line.splitlines()[0])
                marker = block_marker or (MARKER.match(own.group(1)) if own else None)
                out.append(Command(page.relative_to(REPO).as_posix(), line.strip(), marker))
    return out


ALL_COMMANDS = [c for page in PAGES_CHECKED for c in commands(page)]
TO_RUN = [c for c in ALL_COMMANDS if c.marker is None]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def sandbox(tmp: Path) -> Path:
    """A working directory that sees the repository's files (by symlink) and holds what commands write, and the
    recordings the cloning examples upload."""
    for entry in REPO.iterdir():
        if entry.name not in {".git", "data"}:
            (tmp / entry.name).symlink_to(entry)
    for name in ("alice.wav", "me.wav"):
        shutil.copyfile(RECORDING, tmp / name)
    return tmp


def run_documented(command: Command, cwd: Path, port: int | None = None) -> None:
    """Run one documented command: `make …` as a dry run (`make -n`), anything else in bash in `cwd`, with the
    server's address put where the docs say localhost:8000; a curl that gets an HTTP error fails."""
    text = SERVER_ADDRESS.sub(f"127.0.0.1:{port}", command.text) if port else command.text
    assignments = re.match(r"((?:[A-Z_][A-Z0-9_]*=\S*\s+)*)(.*)", text, re.S)
    assert assignments is not None
    env = os.environ | {"PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    if re.match(r"make(\s|$)", assignments.group(2)):
        env |= dict(a.split("=", 1) for a in assignments.group(1).split())
        argv = ["make", "-n", *shlex.split(assignments.group(2), comments=True)[1:]]
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    else:
        prelude = 'set -eo pipefail; curl() { command curl --fail-with-body --max-time 120 "$@"; }\n'
        done = subprocess.run(["bash", "-c", prelude + text], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{command}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"


def test_every_command_runs_here_or_says_why_not() -> None:
    """Markers name a known reason, and a "tested by" names a test file that exists."""
    assert len(ALL_COMMANDS) > 30
    for command in ALL_COMMANDS:
        if command.marker and command.marker.group(1):
            assert (REPO / command.marker.group(1)).is_file(), command
    assert any(c.text.startswith("make run") and c.page == "README.md" for c in TO_RUN)


def test_the_commands_without_a_server_run(tmp_path: Path) -> None:
    """make targets (dry run), the command line on the tiny bundle, shell assignments."""
    cwd = sandbox(tmp_path)
    for command in (c for c in TO_RUN if not SERVER_ADDRESS.search(c.text)):
        run_documented(command, cwd)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The README's `make run`, for real (its install and build prerequisites are what `make test` made; `make -n run`
    above shows them), on free ports with its voices and caches in a temporary directory; yields the HTTP port."""
    tmp, port = tmp_path_factory.mktemp("served"), free_port()
    env = os.environ | {"TTS_VOICES_DIR": str(tmp / "voices"), "TTS_CACHE_DIR": str(tmp / "cache")}
    env |= {"TTS_RATE_LIMIT_PER_MINUTE": "0", "TTS_LOG_LEVEL": "warning"}
    argv = ["make", "-o", ".venv/.lite", "-o", "native", "run", "HOST=127.0.0.1", f"PORT={port}", "GRPC_PORT=0"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        wait_ready(proc, port)
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], port: int) -> None:
    """Until /readyz answers 200 (the model is loaded and warmed up); the server exiting first fails the test."""
    while proc.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"make run exited with status {proc.returncode} before it was ready")


@pytest.mark.integration
def test_the_quick_start_and_every_curl_example_run_against_make_run(served: int, tmp_path: Path) -> None:
    """README's quick start, then every documented request to localhost:8000, in page order, on the tiny v1 bundle."""
    cwd = sandbox(tmp_path)
    against_server = [c for c in TO_RUN if SERVER_ADDRESS.search(c.text)]
    assert any(c.page == "README.md" for c in against_server) and any("/v1/voices" in c.text for c in against_server)
    for command in against_server:
        run_documented(command, cwd, served)
    assert (cwd / "out.wav").stat().st_size > 1000


def markdown_links(text: str) -> list[str]:
    """Link targets of a page outside code: fences and inline code spans are left out."""
    text = re.sub(FENCE, "", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids of a page: lower case, punctuation dropped, blanks to hyphens."""
    text = re.sub(FENCE, "", page.read_text(encoding="utf-8"))
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, re.M):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
        out.add(re.sub(r"[^\w\- ]", "", plain).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES_CHECKED, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    for target in markdown_links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{page.name}: {target} does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in anchors(resolved), f"{page.name}: {target}: no such heading"


def test_the_settings_page_lists_exactly_the_settings() -> None:
    page = (REPO / "docs" / "settings.md").read_text(encoding="utf-8")
    assert with_table(page, Settings) == page, "run: python scripts/settings_table.py --write"
    documented = set(re.findall(r"`(TTS_[A-Z0-9_]+)`", page.split("<!-- settings-table:start -->")[1]))
    assert documented == {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    assert set(PAGES) == {"docs/settings.md", "docs/engine-profile.md"}


def test_the_engine_profile_page_lists_exactly_the_levers() -> None:
    page = (REPO / "docs" / "engine-profile.md").read_text(encoding="utf-8")
    assert with_table(page, PAGES["docs/engine-profile.md"]) == page, "run: python scripts/settings_table.py --write"
    table = page.split("<!-- settings-table:start -->")[1].split("<!-- settings-table:end -->")[0]
    assert set(re.findall(r"^\| `(\w+)` \|", table, re.M)) == set(LEVERS)


def test_every_setting_named_in_the_docs_exists() -> None:
    """`TTS_*` names on every page are settings (or the old name still read); engine-profile.md names the one refused."""
    real = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields} | set(RENAMED)
    for page in PAGES_CHECKED:
        named = set(re.findall(r"\bTTS_[A-Z0-9_]*[A-Z0-9]\b", page.read_text(encoding="utf-8")))
        refused = {"TTS_FIRST_HOP_TOKENS"} if page.name == "engine-profile.md" else set()
        assert named - refused <= real, f"{page.name}: {sorted(named - refused - real)}"


def test_the_readme_is_a_short_first_screen() -> None:
    lines = README.splitlines()
    assert len(lines) <= 250
    first = "\n".join(lines[:40])
    for needed in ("CosyVoice-300M", "CosyVoice2", "CosyVoice3", "make run", "make test"):
        assert needed in first, needed
    assert re.findall(r"^(make \w+)", README, flags=re.M)[:2] == ["make run", "make test"]


def test_no_work_session_is_mentioned() -> None:
    """Code and the README say what is, not when it was done; the README does not use the word at all (it says
    connection for WebSocket and gRPC ones)."""
    assert "session" not in README.lower()
    for path in (REPO / "service").rglob("*"):
        if path.is_file() and path.suffix in {".py", ".c", ".h", ".md", ".proto", ".html", ".js", ".css"}:
            found = WORK_SESSION.search(path.read_text(encoding="utf-8", errors="replace"))
            assert found is None, f"{path.relative_to(REPO)}: {found.group(0) if found else ''}"


def test_client_snippets_say_how_to_install_the_client() -> None:
    """A reader can paste each snippet into a fresh shell: a client the server does not ship is installed first."""
    for page in PAGES_CHECKED:
        for _, block in FENCE.findall(page.read_text(encoding="utf-8")):
            if "from openai import" in block:
                assert "pip install openai" in block.split("from openai import")[0], (page.name, block)
