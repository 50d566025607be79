"""docker/Dockerfile without a Docker engine: its install steps are docs/install.md's, and replaying the runtime stage works."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import container_image
import httpx
import pytest
from deploy_servers import ProcessInDir
from servers import LOOPBACK, free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "docker" / "Dockerfile"
INSTALL_COMMAND = re.compile(r"^(\S*python3?(\.\d+)? -m venv |\S*python3?(\.\d+)? -m pip install |\S*pip3? install )")
# RUN steps of the runtime stage that are not install steps: checked, but not replayed (they change the system).
SYSTEM_COMMANDS = (  # user, voices volume, the venv trimmed of what the service never loads
    "useradd ",
    "mkdir -p /app/data",
    "chown 10001:0 /app/data",
    "chmod 775 /app/data",
    "python3 trim_venv.py .venv",
    "rm trim_venv.py",
)
# Secrets, virtualenvs, checkpoints, bytecode and other bundles must never reach the Docker daemon.
KEPT_OUT_OF_CONTEXT = (
    ".env",
    "tests/reference/tiny/llm.pt",
    ".venv/bin/python",
    ".git/HEAD",
    "pretrained_models/x/llm.pt",
    "service/__pycache__/a.pyc",
    "models/big/x",
)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [rest for kw, rest in self.instructions if kw == keyword]


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def resolve(self, name: str) -> Stage:
        """The stage `COPY --from=name` reads: follows `FROM <other stage> AS name` aliases."""
        found = [s for s in self.stages if s.name == name]
        assert len(found) == 1, f"no stage named {name}"
        stage = found[0]
        return self.resolve(stage.base) if not stage.instructions and stage.base != "scratch" else stage

    @property
    def runtime(self) -> Stage:
        return self.stages[-1]  # `docker build` without --target builds the last stage


def expand(text: str, values: dict[str, str]) -> str:
    """Docker's $VAR / ${VAR} / ${VAR:-default} substitution (unknown variables become empty, as in Docker)."""
    return re.sub(
        r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)",
        lambda m: values.get(m.group(1) or m.group(3), "") or (m.group(2) or ""),
        text,
    )


def parse_dockerfile(text: str) -> Dockerfile:
    """Instructions per stage, continuation lines joined, comments dropped (enough for this Dockerfile's syntax)."""
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n\s*", "", "\n".join(lines))
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in filter(None, (raw.strip() for raw in joined.splitlines())):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            parts = rest.split()
            stages.append(Stage(expand(parts[0], global_args), parts[2] if len(parts) == 3 else None))
        elif not stages and keyword == "ARG":
            name, _, default = rest.partition("=")
            global_args[name] = default
        else:
            stages[-1].instructions.append((keyword, rest))
    return Dockerfile(global_args, stages)


DOCKER = parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


def run_commands(stage: Stage) -> list[str]:
    return [c.strip() for run in stage.args("RUN") for c in run.split("&&")]


def install_commands(stage: Stage) -> list[str]:
    return [c for c in run_commands(stage) if INSTALL_COMMAND.match(c)]


INSTALL_PAGE = REPO / "docs" / "install.md"  # prerequisites, install without make, export
DEPLOYMENT_PAGE = REPO / "docs" / "deployment.md"  # the container commands


def documented_install_commands() -> list[str]:
    """Install commands of the docs/install.md code block that installs requirements-lite.txt."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", INSTALL_PAGE.read_text(encoding="utf-8"), re.S)
    found = [
        [line.strip() for line in block.splitlines() if INSTALL_COMMAND.match(line.strip())]
        for block in blocks
        if "-r requirements-lite.txt" in block
    ]
    assert len(found) == 1, "docs/install.md should document the install commands in one code block (install without make)"
    return found[0]


def make_dry_run(target: str, *assignments: str) -> list[str]:
    """The commands `make -n` prints for `target` (forced), with the given VAR=value overrides."""
    env = {k: v for k, v in os.environ.items() if k not in {"PY", "VENV", "MAKEFLAGS", "MAKELEVEL", "TORCH_INDEX_URL"}}
    argv = ["make", "-n", "-B", target, *assignments]
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, check=True)
    return [line.strip() for line in out.stdout.splitlines()]


def make_install_commands() -> list[str]:
    """What `make run` executes to install (its .venv/.lite prerequisite), as `make -n` prints it."""
    return [line for line in make_dry_run(".venv/.lite") if INSTALL_COMMAND.match(line)]


def glob_regex(glob: str) -> re.Pattern[str]:
    """A .dockerignore glob: `*` and `?` stay within one path element, `**` spans any number of them."""
    out, i = "", 0
    while i < len(glob):
        if glob.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif glob.startswith("**", i):
            out, i = out + ".*", i + 2
        else:
            out, i = out + {"*": "[^/]*", "?": "[^/]"}.get(glob[i], re.escape(glob[i])), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern that matches the path or one of its parent directories decides."""
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        regex = glob_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.match(c) for c in candidates):
            ignored = not pattern.startswith("!")
    return ignored


def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def copy_pairs(copy_args: str) -> list[tuple[str, str]]:
    """(build-context source, destination) of one COPY; `--from=<stage>` is followed back to the context files."""
    words = [w for w in copy_args.split() if not w.startswith(("--chown", "--chmod", "--link"))]
    if not words[0].startswith("--from="):
        *sources, dest = words
        return [(source, dest) for source in sources]
    stage_path, dest = words[1].rstrip("/"), words[2]
    source_stage = DOCKER.resolve(words[0].removeprefix("--from="))
    made = [pair for args in source_stage.args("COPY") for pair in copy_pairs(args)]
    return [(source, dest) for source, made_at in made if made_at.rstrip("/") == stage_path]


def test_runtime_install_steps_are_exactly_the_documented_install_steps() -> None:
    docker = install_commands(DOCKER.runtime)
    assert any("-r requirements-lite.txt" in c for c in docker), "the runtime stage does not install requirements-lite.txt"
    assert docker == documented_install_commands(), "docker/Dockerfile and docs/install.md install differently"
    assert docker == make_install_commands(), "docker/Dockerfile and `make run` install differently"


def test_runtime_stage_is_slim_torch_free_and_non_root() -> None:
    runtime = DOCKER.runtime
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", runtime.base), runtime.base
    assert all(INSTALL_COMMAND.match(c) or c.startswith(SYSTEM_COMMANDS) for c in run_commands(runtime)), run_commands(runtime)
    assert not any("torch" in c or "requirements-export" in c for c in run_commands(runtime))
    assert not re.search(r"^torch\b", (REPO / "requirements-lite.txt").read_text(encoding="utf-8"), re.M)
    assert runtime.args("USER")[-1].split(":")[0] not in {"root", "0"}
    assert "/healthz" in runtime.args("HEALTHCHECK")[-1]
    assert json.loads(runtime.args("CMD")[-1]) == ["python", "-m", "service.api"]


def test_torch_is_installed_only_in_the_optional_export_stage() -> None:
    installing = [s.name for s in DOCKER.stages if any("requirements-export.txt" in c for c in install_commands(s))]
    assert installing == ["export"]
    assert DOCKER.global_args["MODEL"] == "tiny", "the default image bakes in the committed tiny bundle"
    assert copy_pairs("--from=model /bundle models/default") == [("models/tiny", "models/default")]


def test_the_model_stage_is_chosen_without_arg_defaults_as_old_buildah_chooses() -> None:
    """buildah < 1.29 (Debian 12's podman) picks the stages to build from FROM lines expanded with the --build-arg
    values only, not the ARG defaults: without MODEL given, the default model stage must still be named."""
    text = re.sub(r"^ARG (\w+)=.*$", r"ARG \1", DOCKERFILE.read_text(encoding="utf-8"), flags=re.M)  # defaults dropped
    picked = parse_dockerfile(text).resolve("model")
    assert picked.name == f"model-{DOCKER.global_args['MODEL']}", picked.name
    assert parse_dockerfile(text.replace("ARG MODEL\n", "ARG MODEL=exported\n")).resolve("model").name == "model-exported"


def test_the_runtime_user_shares_group_0_with_arbitrary_uids() -> None:
    """OpenShift runs the image as an arbitrary uid in group 0: the service user is in group 0 and the voices volume
    is writable by the group (tests/test_image.py runs both for real)."""
    assert DOCKER.runtime.args("USER")[-1] == "10001:0"
    commands = run_commands(DOCKER.runtime)
    assert "chown 10001:0 /app/data" in commands and "chmod 775 /app/data" in commands, commands
    assert DOCKER.global_args["PYTHON_IMAGE"] == container_image.OFFICIAL_BASE


def test_the_documented_container_commands_are_the_ones_the_image_test_runs() -> None:
    """tests/test_image.py builds with container_image.build_argv, runs with run_argv and stops with stop_argv."""
    page = DEPLOYMENT_PAGE.read_text(encoding="utf-8")
    for engine in ("docker", "podman"):
        commands = [
            container_image.build_argv(engine, container_image.IMAGE),
            container_image.run_argv(engine, container_image.IMAGE),
            container_image.run_argv(engine, container_image.IMAGE, "tts-any-uid", ports=("8001", "50001"), user="12345"),
            container_image.stop_argv(engine),
        ]
        for argv in commands:
            assert shlex.join(argv) in page, f"docs/deployment.md does not give: {shlex.join(argv)}"
    assert "podman healthcheck run tts" in page


def makefile_default(name: str) -> str:
    found = re.findall(rf"^{name}\s*\?=\s*(\S+)\s*$", (REPO / "Makefile").read_text(encoding="utf-8"), re.M)
    assert len(found) == 1, f"the Makefile should set `{name} ?= ...` once"
    return found[0]


def test_torch_index_is_one_variable_shared_by_makefile_dockerfile_and_docs() -> None:
    url = makefile_default("TORCH_INDEX_URL")
    assert re.fullmatch(r"https://\S+/cpu", url), f"TORCH_INDEX_URL should default to a CPU wheel index, not {url}"

    export = DOCKER.resolve("export")
    assert f"TORCH_INDEX_URL={url}" in export.args("ARG"), "the export stage's ARG TORCH_INDEX_URL differs from the Makefile's"
    assert not any("PIP_EXTRA_INDEX_URL" in env for env in export.args("ENV")), "a second, hard-coded index variable"
    torch_install = [c for c in install_commands(export) if "requirements-export.txt" in c]
    assert len(torch_install) == 1 and re.search(r"--extra-index-url \"?\$\{?TORCH_INDEX_URL", torch_install[0]), torch_install

    other = "https://wheels.example.invalid/cpu"
    dev_install = [line for line in make_dry_run(".venv/.dev", f"TORCH_INDEX_URL={other}") if "-r requirements-dev.txt" in line]
    assert len(dev_install) == 1 and other in dev_install[0], "the install that brings torch does not use TORCH_INDEX_URL"
    assert not any(url in line for line in make_dry_run(".venv/.lite")), "`make run` should not need the torch index"

    page = INSTALL_PAGE.read_text(encoding="utf-8")
    assert f"TORCH_INDEX_URL ?= {url}" in page or f"TORCH_INDEX_URL={url}" in page, "docs/install.md should give the default"
    assert "--build-arg TORCH_INDEX_URL=" in page and "make export TORCH_INDEX_URL=" in page


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    patterns = ignore_patterns()
    for stage in DOCKER.stages:
        for source, _ in (pair for args in stage.args("COPY") for pair in copy_pairs(args)):
            assert (REPO / source).exists(), f"COPY {source}: no such file"
            assert not dockerignored(source, patterns), f"COPY {source}: excluded by .dockerignore"
    assert not dockerignored("service/api/static/index.html", patterns)
    for kept_out in KEPT_OUT_OF_CONTEXT:
        assert dockerignored(kept_out, patterns), f"{kept_out} would be sent to the Docker daemon"


@dataclass
class ImageReplay:
    """The runtime stage replayed in a scratch directory that stands for the image's `/`."""

    root: Path
    env: dict[str, str]
    workdir: Path

    def remap(self, value: str) -> str:
        """Absolute image paths (/app/...) -> the scratch directory."""
        return re.sub(r"(?<![\w.])/(?=app\b)", str(self.root) + "/", value)


def replay_runtime_stage(root: Path) -> ImageReplay:
    """WORKDIR, ENV, COPY (honouring .dockerignore) and the install RUN steps of the runtime stage, in order."""
    replay = ImageReplay(root, {"PATH": os.environ["PATH"], "HOME": str(root)}, root)
    patterns = ignore_patterns()
    for keyword, rest in DOCKER.runtime.instructions:
        if keyword == "WORKDIR":
            replay.workdir = Path(replay.remap(rest))
            replay.workdir.mkdir(parents=True, exist_ok=True)
        elif keyword == "ENV":
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                replay.env[name] = replay.remap(expand(value, replay.env))
        elif keyword == "COPY":
            for source, dest in copy_pairs(rest):
                copy_context(source, replay.workdir, dest, patterns)
        elif keyword == "RUN" and INSTALL_COMMAND.match(rest):
            subprocess.run(["sh", "-c", rest], cwd=replay.workdir, env=replay.env, check=True, timeout=600)
    return replay


def copy_context(source: str, workdir: Path, dest: str, patterns: list[str]) -> None:
    """COPY semantics for one source: a file lands in `dest` (a directory if it ends in /), a directory's contents too."""
    src = REPO / source
    target = workdir / dest
    if src.is_file():
        target = target / src.name if dest.endswith("/") or dest == "." else target
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        return
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        inner = path.relative_to(src).as_posix()
        if not dockerignored(f"{source.rstrip('/')}/{inner}", patterns):
            (target / inner).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target / inner)


def ready(port: int) -> bool:
    try:
        return httpx.get(f"http://{LOOPBACK}:{port}/readyz", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def healthcheck(env: dict[str, str]) -> int:
    """Exit code of the Dockerfile's HEALTHCHECK command (shell form), run with the image's environment."""
    command = DOCKER.runtime.args("HEALTHCHECK")[-1].split(" CMD ", 1)[1]
    return subprocess.run(["sh", "-c", command], env=env, timeout=30, capture_output=True).returncode


@pytest.mark.integration
def test_replayed_image_installs_serves_and_passes_its_healthcheck(tmp_path: Path) -> None:
    replay = replay_runtime_stage(tmp_path / "image")
    python = shutil.which("python", path=replay.env["PATH"])
    assert python and python.startswith(str(replay.root)), "the image's PATH should find the venv's python first"
    version = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    assert version.stdout.strip() == DOCKER.runtime.base.split(":")[1].split("-")[0], "replayed with another Python"
    no_torch = subprocess.run([python, "-c", "import torch"], capture_output=True, text=True, cwd=replay.workdir)
    assert "No module named 'torch'" in no_torch.stderr
    # every pinned serving requirement is installed at its version, and what trim_venv.py removes is gone (no pip)
    pins = [line.split("#")[0].strip() for line in (REPO / "requirements-lite.txt").read_text().splitlines()]
    check = "import importlib.metadata as m, sys; print(all(m.version(n) == v for n, v in (p.split('==') for p in sys.argv[1:])))"
    installed = subprocess.run([python, "-c", check, *[p for p in pins if p]], capture_output=True, text=True, cwd=replay.workdir)
    assert installed.stdout.strip() == "True", installed.stderr
    no_pip = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True, cwd=replay.workdir)
    assert no_pip.returncode != 0 and "No module named pip" in no_pip.stderr

    # both ports free by construction: the image's defaults (8000, 50000) may be taken on a shared CI host
    port, grpc_port = free_port(), free_port()
    while grpc_port == port:
        grpc_port = free_port()
    env = {**replay.env, "TTS_HOST": LOOPBACK, "TTS_PORT": str(port), "TTS_GRPC_PORT": str(grpc_port)}
    app = ProcessInDir("image-app", json.loads(DOCKER.runtime.args("CMD")[-1]), tmp_path / "app.log", env, replay.workdir)
    try:
        app.start()
        wait_until(lambda: ready(port) or not app.alive(), 120, "the replayed image's app", interval_s=0.2)
        assert app.alive(), app.log_text()
        assert str(replay.workdir / "models" / "default") in app.log_text(), "the app should serve the baked-in bundle"
        assert healthcheck(env) == 0
        speech = httpx.post(f"http://{LOOPBACK}:{port}/tts", json={"text": "镜像测试。"}, timeout=60)
        assert speech.status_code == 200 and speech.content[:4] == b"RIFF"
        with socket.create_connection((LOOPBACK, grpc_port), timeout=5):
            pass  # the official gRPC service listens where TTS_GRPC_PORT says
    finally:
        app.stop()
        app.dump_log()
    assert healthcheck(env) != 0, "the healthcheck should fail once the app is gone"


def make_run_command(*assignments: str, **env: str) -> str:
    """The serving command `make -n run` prints, with make-variable `assignments` and extra environment `env`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TTS_") and k not in {"MAKEFLAGS", "MAKELEVEL"}}
    out = subprocess.run(
        ["make", "-n", "run", *assignments], cwd=REPO, env=base | env, capture_output=True, text=True, check=True
    )
    return next(line for line in out.stdout.splitlines() if "-m service.api" in line)


def test_make_run_passes_the_grpc_port_as_it_passes_the_http_port() -> None:
    assert "TTS_PORT=8000 TTS_GRPC_PORT=50000 " in make_run_command()
    assert "TTS_PORT=9000 TTS_GRPC_PORT=50001 " in make_run_command("PORT=9000", "GRPC_PORT=50001")
    assert "TTS_GRPC_PORT=0 " in make_run_command("GRPC_PORT=0")
    assert "TTS_GRPC_PORT=0 " in make_run_command(TTS_GRPC_PORT="0"), "`TTS_GRPC_PORT=0 make run` still works"
