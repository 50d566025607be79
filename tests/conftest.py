"""Shared pytest fixtures: paths to the reference fixtures and the committed tiny bundle."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from servers import RedisServer

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests" / "reference"  # vendored copy of ../shared/reference (see its README.md)
TINY_REF = REFERENCE / "tiny"
TINY_COSYVOICE2_REF = REFERENCE / "tiny-cosyvoice2"  # generated here by scripts/cosyvoice2_*.py (see its README.md)
TINY_COSYVOICE3_REF = REFERENCE / "tiny-cosyvoice3"  # generated here by scripts/cosyvoice3_*.py (see its README.md)
TINY_BUNDLE = REPO / "models" / "tiny"
TINY_V2_REF = REFERENCE / "tiny-cosyvoice2"
TINY_V2_BUNDLE = REPO / "models" / "tiny-cosyvoice2"
TINY_V3_BUNDLE = REPO / "models" / "tiny-cosyvoice3"
# Apps built by tests listen for gRPC only where a test asks for it (tests/test_grpc.py): every app on the default
# port 50000 would collide with the others and with a `make run` on this machine.
os.environ.setdefault("TTS_GRPC_PORT", "0")
# OpenVINO's compiled-graph cache goes to a directory of this run, removed at its end (pytest_sessionfinish): the
# default, ~/.cache/cosyvoice-lite, would gain blobs of every graph the suite exports, run after run.
_CACHE_DIR = tempfile.mkdtemp(prefix="cosyvoice-lite-test-cache-")
os.environ.setdefault("TTS_CACHE_DIR", _CACHE_DIR)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_CACHE_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def ref_dir() -> Path:
    """The tiny official checkpoint + fixtures (tests/reference/tiny)."""
    if not TINY_REF.is_dir():
        pytest.fail(f"reference fixtures not found at {TINY_REF}")
    return TINY_REF


@pytest.fixture(scope="session")
def full_size_shapes() -> Path:
    """State-dict keys, shapes and dtypes of the released full-size checkpoint (JSON, one table per .pt file)."""
    return REFERENCE / "cosyvoice-300m-sft.shapes.json"


@pytest.fixture(scope="session")
def tiny_bundle() -> Path:
    """The committed tiny bundle (models/tiny)."""
    if not (TINY_BUNDLE / "manifest.json").is_file():
        pytest.fail(f"{TINY_BUNDLE} is missing: run `make models/tiny`")
    return TINY_BUNDLE


@pytest.fixture(scope="session")
def tiny_v2_bundle() -> Path:
    """The committed tiny CosyVoice2 bundle (models/tiny-cosyvoice2: int8, random weights, 24 kHz, no built-in
    speakers; prompt analysis and instruct2)."""
    if not (TINY_V2_BUNDLE / "manifest.json").is_file():
        pytest.fail(f"{TINY_V2_BUNDLE} is missing: run `make models/tiny-cosyvoice2`")
    return TINY_V2_BUNDLE


@pytest.fixture(scope="session")
def cv2_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random CosyVoice2 checkpoint in the official layout, written by our torch modules (needs torch)."""
    from cosyvoice2_checkpoint import build_checkpoint

    return build_checkpoint(tmp_path_factory.mktemp("cv2-checkpoint") / "CosyVoice2-tiny")


@pytest.fixture(scope="session")
def cv2_bundle(cv2_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`cv2_checkpoint` exported with --verify --test-model --quantize int8 (the int8 twin beside it, `-int8`)."""
    from cosyvoice2_checkpoint import export_checkpoint

    return export_checkpoint(cv2_checkpoint, tmp_path_factory.mktemp("cv2-bundle") / "cv2")


@pytest.fixture(scope="session")
def cv2_ref_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The official-layout tiny CosyVoice2 checkpoint (tests/reference/tiny-cosyvoice2) exported (fp32, --verify)."""
    from cosyvoice2_checkpoint import run_export

    out = tmp_path_factory.mktemp("cv2-ref") / "tiny-cosyvoice2"
    proc = run_export("--model-dir", TINY_V2_REF, "--out", out, "--verify", "--test-model")
    if proc.returncode != 0:
        pytest.fail(f"export of {TINY_V2_REF} failed:\n{proc.stderr}")
    return out


@pytest.fixture(scope="session")
def tiny_v3_bundle() -> Path:
    """The committed tiny Fun-CosyVoice3 bundle (models/tiny-cosyvoice3: int8, random weights, 24 kHz, no built-in
    speakers; prompt analysis and instruct2)."""
    if not (TINY_V3_BUNDLE / "manifest.json").is_file():
        pytest.fail(f"{TINY_V3_BUNDLE} is missing: run `make models/tiny-cosyvoice3`")
    return TINY_V3_BUNDLE


@pytest.fixture(scope="session")
def cv3_ref_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The official-layout tiny Fun-CosyVoice3 checkpoint (tests/reference/tiny-cosyvoice3) exported (fp32, --verify,
    with its int8 twin beside it, `-int8`)."""
    from cosyvoice2_checkpoint import run_export

    out = tmp_path_factory.mktemp("cv3-ref") / "tiny-cosyvoice3"
    proc = run_export("--model-dir", TINY_COSYVOICE3_REF, "--out", out, "--verify", "--test-model", "--quantize", "int8")
    if proc.returncode != 0:
        pytest.fail(f"export of {TINY_COSYVOICE3_REF} failed:\n{proc.stderr}")
    return out


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port for one test module, stopped by PID afterwards."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
    server.dump_log()


@pytest.fixture(scope="session")
def native_library() -> Path:
    """Our kernels' library as `make native` builds it (`make test` builds it first); built here when a C compiler
    exists, else the test is skipped (the engine then runs ONNX Runtime's graphs)."""
    from service.engine import native

    if not native.LIBRARY_PATH.is_file() and shutil.which("cc"):
        subprocess.run(["make", "-s", "native"], cwd=REPO, check=True)
    if not native.LIBRARY_PATH.is_file():
        pytest.skip("no C compiler here: the native kernels cannot be built (the engine runs ONNX Runtime's graphs)")
    return native.LIBRARY_PATH
