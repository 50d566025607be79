"""The native kernels' C tests (tests/native/test_*.c): each built with the library's sources under AddressSanitizer
and UBSan (`-fsanitize=address,undefined -fno-sanitize-recover=all`) and run twice: with every code path this host
has (each variant against the portable C) and with the portable path forced (the ceiling `portable`), so a host
without AVX-512 runs code this suite has exercised. Skipped only where no C compiler exists."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
KIT = REPO / "service" / "engine" / "native"
LAYERS = REPO / "service" / "layers" / "native"
FAMILIES = sorted((REPO / "service" / "families").glob("*/native"))  # fused layers a family owns
SOURCE_DIRS = [KIT, LAYERS, *FAMILIES]
TESTS = REPO / "tests" / "native"
CC = shutil.which("cc")
FLAGS = ["-g", "-O1", "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-fno-omit-frame-pointer"]
SANITIZERS = ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
PROGRAMS = sorted(p.stem for p in TESTS.glob("test_*.c"))

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler (cc) here: the native kernels cannot be built")


@pytest.fixture(scope="module")
def library_objects(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """The library's sources compiled once, with the sanitizers, into objects the test programs link."""
    out = tmp_path_factory.mktemp("native-objects")
    sources = [c for folder in SOURCE_DIRS for c in sorted(folder.glob("*.c"))]
    subprocess.run([str(CC), "-c", *FLAGS, *SANITIZERS, f"-I{KIT}", f"-I{LAYERS}", *map(str, sources)], cwd=out, check=True)
    return sorted(out.glob("*.o"))


@pytest.fixture(scope="module")
def programs(library_objects: list[Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("native-tests")
    built = {}
    for name in PROGRAMS:
        binary = out / name
        includes = [f"-I{folder}" for folder in SOURCE_DIRS]
        command = [str(CC), *FLAGS, *SANITIZERS, *includes, f"-I{TESTS}", "-o", str(binary)]
        subprocess.run([*command, str(TESTS / f"{name}.c"), *map(str, library_objects), "-lpthread", "-lm"], check=True)
        built[name] = binary
    return built


def test_every_op_has_a_test_program() -> None:
    """One C test per op (the kit's and the layers'), plus the probe's, the runtime table's, the frame codec's and the
    work buffers'."""
    ops = {p.stem for folder in SOURCE_DIRS for p in folder.glob("*_op.c")} - {"ort_custom_op"}  # the registration
    others = {"test_cpu", "test_ort_api", "test_frame_codec", "test_work"}
    assert {f"test_{op.removesuffix('_op')}" for op in ops} | others == set(PROGRAMS)


@pytest.mark.parametrize("ceiling", ["auto", "portable"])
@pytest.mark.parametrize("program", PROGRAMS)
def test_the_c_test_passes_under_the_sanitizers(programs: dict[str, Path], program: str, ceiling: str) -> None:
    run = subprocess.run([str(programs[program]), ceiling], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"{program} {ceiling}:\n{run.stdout}\n{run.stderr}"
    assert "checks passed" in run.stdout
    if ceiling == "portable":
        assert "(features 0x0)" in run.stdout  # nothing but the portable C ran
